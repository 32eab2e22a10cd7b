"""Safety: safetensors only, no remote code unless asked, free space checked, a full disk
cleans up, the input model untouched."""

from __future__ import annotations

import errno
import hashlib
import re
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import optc
import optc.export.checkpoint as checkpoint
import optc.methods.common
import optc.run.pipeline
from optc.cli.main import app
from optc.errors import OptcError
from optc.export.checkpoint import estimate_checkpoint_bytes, is_disk_full
from optc.export.load import load_checkpoint as load_model
from optc.testing import tiny_model

SOURCE = Path(optc.__file__).parent


def _error_line(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


def _quantize(model: Path, out: Path, *extra: str, method: str = "rtn") -> list[str]:
    return ["quantize", "--model", str(model), "--method", method, "--samples", "4", "--seqlen", "32",
            "--no-eval", "--output", str(out), "--quiet", *extra]


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir()) if out.parent.exists() else []


def test_source_never_unpickles_or_loads_yaml_unsafely() -> None:
    """A static check of every module: torch.load / pickle / unsafe YAML / remote code on."""
    banned = [r"\btorch\.load\(", r"import pickle|pickle\.loads?\(|from pickle", r"\byaml\.load\(", r"unsafe_load",
              r"trust_remote_code\s*=\s*True", r"weights_only\s*=\s*False"]
    hits = [f"{p.relative_to(SOURCE)}:{i}: {line.strip()}"
            for p in sorted(SOURCE.rglob("*.py")) for i, line in enumerate(p.read_text().splitlines(), 1)
            if any(re.search(b, line) for b in banned)]
    assert not hits, hits


def test_pickle_only_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bin-only"
    model = tiny_model("llama")
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")  # the legacy pickle layout
    assert (path / "pytorch_model.bin").is_file() and not list(path.glob("*.safetensors"))
    with pytest.raises(OptcError, match="pickle files .*pytorch_model.bin.*safetensors only"):
        load_model(str(path))


def test_remote_code_needs_the_flag(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "custom"
    shutil.copytree(tiny_checkpoint, path)
    marker = tmp_path / "code-ran"
    (path / "custom_model.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'custom-llama'\n"
        "class CustomModel(LlamaForCausalLM):\n    config_class = CustomConfig\n"
    )
    config = (path / "config.json").read_text()
    (path / "config.json").write_text(config.replace(
        '"model_type": "llama"',
        '"model_type": "custom-llama", "auto_map": {"AutoConfig": "custom_model.CustomConfig", '
        '"AutoModelForCausalLM": "custom_model.CustomModel"}'))
    line = _error_line(["eval", str(path), "--windows", "1", "--seqlen", "32", "--quiet"])
    assert "trust_remote_code" in line or "trust-remote-code" in line
    assert not marker.exists()  # the repository's code never ran


def test_input_model_is_never_modified(tiny_checkpoint: Path, tmp_path: Path) -> None:
    def digest(root: Path) -> dict[str, str]:
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() + f"-{p.stat().st_mtime_ns}"
                for p in sorted(root.rglob("*")) if p.is_file()}

    before = digest(tiny_checkpoint)
    out = tmp_path / "out"
    assert CliRunner().invoke(app, _quantize(tiny_checkpoint, out)).exit_code == 0
    assert CliRunner().invoke(app, _quantize(tiny_checkpoint, out, "--overwrite", "--format", "dense")).exit_code == 0
    assert digest(tiny_checkpoint) == before


def test_free_space_is_checked_before_calibration(tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _p: usage(10**9, 10**9 - 2**20, 2**20))

    def no_calibration(*_a, **_k):
        raise AssertionError("calibration started although the checkpoint cannot be written")

    monkeypatch.setattr(optc.methods.common, "run_sequential", no_calibration)
    out = tmp_path / "out"
    line = _error_line(_quantize(tiny_checkpoint, out, method="gptq"))
    assert re.fullmatch(r"error: not enough disk space for .*out: the checkpoint needs about [\d,]+ MiB, "
                        r".* has 1 MiB free", line), line
    assert _leftovers(out) == []


def test_estimate_is_an_upper_bound_of_what_is_written(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "ct"
    assert CliRunner().invoke(app, _quantize(tiny_checkpoint, out, "--format", "compressed-tensors")).exit_code == 0
    model = load_model(str(tiny_checkpoint)).model
    loaded = load_model(str(out))
    estimate = estimate_checkpoint_bytes(model, {n: p.scheme for n, p in loaded.qparams.items()}, "compressed-tensors")
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert weights <= estimate <= 1.5 * weights
    dense = estimate_checkpoint_bytes(model, {}, "dense")
    assert dense >= sum(p.stat().st_size for p in tiny_checkpoint.glob("*.safetensors")) * 0.99


def test_disk_full_mid_write_cleans_up(tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    def writer_hits_enospc(src, fmt, directory: Path, *options):
        (directory / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(optc.run.pipeline, "export_checkpoint", writer_hits_enospc)
    out = tmp_path / "out"
    line = _error_line(_quantize(tiny_checkpoint, out))
    assert re.fullmatch(r"error: disk full while writing .*out \(\d+ MiB free\): the partial checkpoint was "
                        r"removed, nothing was written", line), line
    assert _leftovers(out) == []


def test_safetensors_disk_full_is_recognised() -> None:
    from safetensors import SafetensorError

    rust = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                           'message: "No space left on device" })')
    assert is_disk_full(rust) and is_disk_full(OSError(errno.ENOSPC, "x"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied")) and not is_disk_full(ValueError("x"))


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A real 1 MiB file system (needs root and mount; skipped where either is missing)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_really_full_disk(tiny_checkpoint: Path, small_tmpfs: Path, monkeypatch) -> None:
    out = small_tmpfs / "ckpt"
    assert "not enough disk space" in _error_line(_quantize(tiny_checkpoint, out, "--format", "dense"))
    # Without the early check, the real writers (safetensors, then tokenizer files) hit ENOSPC.
    monkeypatch.setattr(optc.run.pipeline, "check_free_space", lambda *_a: None)
    assert "disk full while writing" in _error_line(_quantize(tiny_checkpoint, out, "--format", "dense"))
    assert list(small_tmpfs.iterdir()) == []
