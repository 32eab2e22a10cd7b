"""Issue 22, hardening: optc never deletes what it did not create, never lets two runs write one
output, refuses bad input before the work in one line, and never passes a broken model through a
gate. Each test here failed on main at 7f692fc.

The data-loss tests run on a temporary tree of sentinel files whose sha256 are compared."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import namedtuple
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import optc.export.checkpoint as checkpoint
import optc.run.pipeline
from optc.cli.main import app
from optc.errors import OptcError
from optc.evaluate.gates import check_gates, parse_gates
from optc.export.checkpoint import check_output
from optc.recipe import parse_recipe

runner = CliRunner()
NON_FINITE_EXIT_CODE = 4  # README: a model computing NaN or infinite values


def _invoke(args: list[str]):
    return runner.invoke(app, [str(a) for a in args])


def _error_line(args: list[str], code: int = 1, single: bool = True) -> str:
    result = _invoke(args)
    assert result.exit_code == code and isinstance(result.exception, SystemExit), (result.output, result.exception)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error:"), result.output
    if single:
        assert len(lines) == 1, result.output
    return lines[-1]


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _quantize(model: Path, out: Path | str, *extra: str) -> list[str]:
    return ["quantize", "--model", model, "--samples", "4", "--seqlen", "32", "--no-eval", "--quiet",
            "--output", out, *extra]


@pytest.fixture
def tree(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """DIR/m (a model), DIR/notes.txt, DIR/sub/data.bin: what a user's directory holds."""
    root = tmp_path / "dir"
    shutil.copytree(tiny_checkpoint, root / "m")
    (root / "notes.txt").write_text("my only copy\n")
    (root / "sub").mkdir()
    (root / "sub" / "data.bin").write_bytes(os.urandom(4096))
    return root


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a run loads its model (a check that must come before the work)."""
    def refuse(*_a, **_k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(optc.run.pipeline, "load_model", refuse)


# --- data loss ------------------------------------------------------------------------------


def test_overwrite_never_deletes_a_directory_holding_the_input(tree: Path) -> None:
    before = _digest(tree)
    for out, why in ((tree, "contains the input model directory"), (tree / "m", "is the input model directory"),
                     (tree / "m" / "sub", "is inside the input model directory")):
        assert why in _error_line(_quantize(tree / "m", out, "--overwrite"))
        assert why in _error_line(["export", tree / "m", "--format", "dense", "--output", out, "--overwrite"])
        assert _digest(tree) == before
    assert "contains the input" in _error_line(_quantize(tree / "m", tree.parent, "--force-overwrite"))
    # Every input counts: the baseline of optc eval, the calibration and evaluation texts.
    line = _error_line(["eval", tree / "m", "--baseline", tree / "m", "--output", tree / "m" / "r", "--overwrite"])
    assert "inside the input model directory" in line
    text = tree / "sub" / "calibration.txt"
    text.write_text("some calibration text\n" * 50)
    before = _digest(tree)
    assert "contains the input calibration text file" in _error_line(
        _quantize(tree / "m", tree / "sub", "--dataset", text, "--force-overwrite"))
    assert "is the input evaluation text file" in _error_line(
        ["eval", tree / "m", "--dataset", text, "--output", text, "--overwrite"])
    assert _digest(tree) == before


def test_overwrite_refuses_the_working_directory_home_and_root(tree: Path, tiny_checkpoint: Path,
                                                               monkeypatch) -> None:
    before = _digest(tree)
    monkeypatch.chdir(tree / "sub")
    for out in (".", "..", tree.parent):
        assert "the working directory" in _error_line(_quantize(tiny_checkpoint, out, "--overwrite"))
    monkeypatch.chdir(tree.parent.parent)
    monkeypatch.setenv("HOME", str(tree))
    for out in (tree, "~"):
        assert "your home directory" in _error_line(_quantize(tiny_checkpoint, out, "--force-overwrite"))
    with pytest.raises(OptcError, match="file system root"):
        check_output(Path("/"), overwrite=True, force=True)
    assert _digest(tree) == before
    assert not list(tree.parent.glob(".*partial*")) and not list(tree.parent.glob(".*old*"))


def test_overwrite_replaces_only_what_optc_wrote(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("not optc's")
    before = _digest(out)
    line = _error_line(_quantize(tiny_checkpoint, out, "--overwrite"))
    assert "optc did not write it" in line and "--force-overwrite" in line
    assert _digest(out) == before
    assert _invoke(_quantize(tiny_checkpoint, out, "--force-overwrite")).exit_code == 0
    assert (out / "recipe.yaml").is_file() and not (out / "precious.txt").exists()
    assert _invoke(_quantize(tiny_checkpoint, out, "--overwrite")).exit_code == 0  # optc's own: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", overwrite=True)  # an empty directory holds nothing to lose


def test_a_second_run_to_the_same_output_is_refused(tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    """Two runs started without --overwrite before the output exists: the second one is refused
    naming the first one's PID, and the first one's output is its own."""
    out = tmp_path / "out"
    export = optc.run.pipeline.export_checkpoint
    second: list = []

    def export_while_another_run_starts(*args, **kwargs):
        if not second:  # the first run is exporting: a second run to the same output starts now
            second.append(_invoke(_quantize(tiny_checkpoint, out, "--bits", "8")))
        return export(*args, **kwargs)

    monkeypatch.setattr(optc.run.pipeline, "export_checkpoint", export_while_another_run_starts)
    first = _invoke(_quantize(tiny_checkpoint, out))
    assert first.exit_code == 0, first.output
    assert second[0].exit_code == 1, second[0].output
    lines = [ln for ln in second[0].stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"another optc run (PID {os.getpid()}) is writing" in lines[0], lines
    assert yaml.safe_load((out / "recipe.yaml").read_text())["stages"][0]["scheme"]["bits"] == 4  # the first run's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock, partial or state left


def test_the_lock_names_the_process_holding_it(tiny_checkpoint: Path, tmp_path: Path, no_load) -> None:
    from optc.export.checkpoint import lock_path, output_lock

    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, f'{os.getpid()}\\n'.encode())\n"
         "print('locked', flush=True)\ntime.sleep(60)\n", str(lock_path(out))],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert f"another optc run (PID {holder.pid})" in _error_line(_quantize(tiny_checkpoint, out))
    finally:
        holder.kill()
        holder.wait()
    with output_lock(out):  # the kernel dropped the dead holder's lock
        assert lock_path(out).read_text().strip() == str(os.getpid())
    assert not lock_path(out).exists() and not out.exists()


def test_an_output_appearing_during_the_run_is_never_replaced(tiny_checkpoint: Path, tmp_path: Path,
                                                              monkeypatch) -> None:
    out = tmp_path / "out"
    export = optc.run.pipeline.export_checkpoint

    def someone_creates_the_output(*args, **kwargs):
        out.mkdir()
        (out / "theirs.txt").write_text("written by someone else meanwhile")
        return export(*args, **kwargs)

    monkeypatch.setattr(optc.run.pipeline, "export_checkpoint", someone_creates_the_output)
    line = _error_line(_quantize(tiny_checkpoint, out))
    assert "appeared while this run was working" in line
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_leftovers_of_killed_runs_are_cleaned_by_the_next_run(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    partial = tmp_path / ".out.partial-k1ll3d"  # a run killed during export
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 1024)
    assert _invoke(_quantize(tiny_checkpoint, out)).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # A run killed between moving the old output aside and moving its own in: the old one is put
    # back (as if that run never ran), then replaced by this run's.
    before = _digest(out)
    old = tmp_path / ".out.old-k1ll3d"
    old.mkdir()
    out.rename(old / "x")
    (tmp_path / ".out.partial-n3w").mkdir()
    assert "already exists" in _error_line(_quantize(tiny_checkpoint, out), single=False)  # after "restored ..."
    assert _digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- checks before the work -----------------------------------------------------------------


def _tiny_disk(monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _p: usage(10**9, 10**9 - 2**20, 2**20))


def test_an_unwritable_output_is_found_before_loading(tiny_checkpoint: Path, tmp_path: Path, monkeypatch,
                                                      no_load) -> None:
    _tiny_disk(monkeypatch)  # a nearly full disk too: the message must still say why it cannot write
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in _error_line(_quantize(tiny_checkpoint, tmp_path / "file" / "out"))
    locked = tmp_path / "locked"
    locked.mkdir()
    mkstemp = tempfile.mkstemp

    def no_permission(*args, dir=None, **kwargs):  # root ignores mode bits: refuse like EACCES does
        if dir is not None and Path(dir).resolve() == locked.resolve():
            raise PermissionError(errno.EACCES, "Permission denied", str(locked))
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(checkpoint.tempfile, "mkstemp", no_permission)
    line = _error_line(_quantize(tiny_checkpoint, locked / "out"))
    assert "permission denied" in line and "disk space" not in line, line
    assert list(locked.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["file", "locked"]


@pytest.fixture
def read_only_fs(tmp_path: Path):
    """A real read-only file system (needs root and mount; skipped where either is missing)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_read_only_file_system_is_found_before_loading(tiny_checkpoint: Path, read_only_fs: Path, no_load) -> None:
    line = _error_line(_quantize(tiny_checkpoint, read_only_fs / "out"))
    assert "read-only file system" in line and "disk space" not in line, line


def test_bad_inputs_are_one_line(tiny_checkpoint: Path, tmp_path: Path) -> None:
    line = _error_line(_quantize(tiny_checkpoint, tmp_path / "g", "--group-size", "99999999999999999999"))
    assert "group_size must be at most" in line and "99999999999999999999" in line
    four = tmp_path / "four.gguf"
    four.write_bytes(b"GGUF")
    assert "cannot load GGUF file" in _error_line(["eval", four, "--quiet"]) and str(four) in _error_line(["eval", four])

    import gguf
    import numpy as np

    mamba = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(mamba), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # single=False: transformers' GGUF reader draws its own tqdm bar, which --quiet cannot reach.
    line = _error_line(["eval", mamba, "--quiet"], single=False)
    assert "cannot load GGUF file" in line and str(mamba) in line and "mamba" in line

    absurd = tmp_path / "absurd"
    shutil.copytree(tiny_checkpoint, absurd)
    weights = absurd / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")  # a header length no file has
    weights.write_bytes(bytes(data))
    for args in (_quantize(absurd, tmp_path / "q"), ["eval", absurd, "--windows", "1", "--seqlen", "16"],
                 ["inspect", absurd]):
        assert str(weights) in _error_line(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["absurd", "four.gguf", "mamba.gguf"]


def test_text_that_is_not_utf8_is_refused_before_loading(tiny_checkpoint: Path, tmp_path: Path, no_load) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 100)
    out = tmp_path / "out"
    line = _error_line(_quantize(tiny_checkpoint, out, "--method", "gptq", "--dataset", bad))
    assert f"dataset file {bad} is not UTF-8 text (byte 0xe9 at offset 3)" in line
    args = ["quantize", "--model", tiny_checkpoint, "--eval-dataset", bad, "--windows", "1", "--output", out, "-q"]
    assert "is not UTF-8 text" in _error_line(args)
    assert "is not UTF-8 text" in _error_line(["eval", tiny_checkpoint, "--dataset", bad, "--windows", "1"])
    assert not out.exists()


# --- gates and numbers that lie -------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("nan") / "nan-llama"
    shutil.copytree(tiny_checkpoint, path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.self_attn.q_proj.weight"][0, 0] = math.nan
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _strict_json(text: str):
    def refuse(token: str):
        raise AssertionError(f"not strict JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_a_model_computing_nan_fails_every_gate_with_its_own_exit_code(nan_checkpoint: Path,
                                                                       tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    args = ["eval", nan_checkpoint, "--baseline", tiny_checkpoint, "--seqlen", "32", "--windows", "2",
            "--gate", "kl_max<=1", "--gate", "bits_per_weight<=64", "--output", out, "--quiet"]
    line = _error_line(args, code=NON_FINITE_EXIT_CODE, single=False)  # after the failed gates
    assert "non-finite logits" in line and "first produced by model.layers.1.self_attn.q_proj" in line, line
    report = _strict_json((out / "report.json").read_text())
    assert [g["passed"] for g in report["gates"]] == [False, False]
    assert report["metrics"]["divergence"]["kl_max"] is None  # NaN, never 0.0
    assert "perplexity_compressed.perplexity" in report["metrics"]["non_finite"]["metrics"]
    assert _invoke(["report", out]).exit_code == 0  # the strict report reads back

    run = tmp_path / "run"
    args = ["quantize", "--model", nan_checkpoint, "--windows", "1", "--seqlen", "32", "--gate", "ppl<=1e9",
            "--output", run, "--quiet", "--json"]
    result = _invoke(args)
    assert result.exit_code == NON_FINITE_EXIT_CODE, result.output
    assert _strict_json(result.stdout)["gates"][0]["passed"] is False
    assert _strict_json((run / "report.json").read_text())["metrics"]["non_finite"]["logits"] > 0


def test_gates_fail_on_non_finite_values() -> None:
    report = {"metrics": {"perplexity_model": {"perplexity": math.inf}, "divergence": {"kl_max": math.nan}}}
    results = check_gates(parse_gates(["ppl>=1", "kl_max<=1", "kl_max>=0"]), report)
    assert [r.passed for r in results] == [False, False, False]
    assert "not a finite number" in results[0].message


def test_duplicate_keys_and_lost_stages_are_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("version: 1\nstages:\n  - type: rtn\nexport: {format: dense}\nstages: []\n")
    out = tmp_path / "out"
    line = _error_line(["run", path, "--model", tiny_checkpoint, "--no-eval", "--output", out])
    assert "duplicate key 'stages' (first at line 2)" in line and "line 5" in line
    path.write_text("version: 1\nstages: []\n")
    line = _error_line(["run", path, "--model", tiny_checkpoint, "--no-eval", "--output", out])
    assert "has no stages" in line and "only evaluates" in line
    assert not out.exists()
    recipe = parse_recipe({"version": 1, "model": str(tiny_checkpoint), "evaluation": None})
    assert optc.run.pipeline.run_recipe(recipe, None)["stages"] == []  # without an output: fine


def test_a_grid_larger_than_float16_is_refused_before_calibration(tiny_checkpoint: Path, tmp_path: Path,
                                                                  monkeypatch) -> None:
    def no_calibration(*_a, **_k):
        raise AssertionError("calibration started")

    monkeypatch.setattr("optc.methods.common.run_sequential", no_calibration)
    out = tmp_path / "g7"
    line = _error_line(_quantize(tiny_checkpoint, out, "--method", "gptq", "--group-size", "7"))
    assert "int4-sym-g7" in line and "more than float16's 16" in line and "bits per weight" in line
    assert not out.exists()


def test_sparsity_and_pattern_together_are_refused(tiny_checkpoint: Path, tmp_path: Path, no_load) -> None:
    common = ["--model", tiny_checkpoint, "--no-eval", "--output", tmp_path / "p"]
    assert "exclude each other" in _error_line(["prune", "--sparsity", "0.5", "--pattern", "2:4", *common])
    line = _error_line(["prune", "--recipe", "prune-2of4-wanda", "--sparsity", "0.3", *common])
    assert "prunes to the pattern 2:4" in line


def test_auto_map_is_refused_and_never_copied(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "mapped"
    shutil.copytree(tiny_checkpoint, path)
    (path / "custom_llama.py").write_text(
        "from transformers import LlamaForCausalLM\nclass CustomLlama(LlamaForCausalLM):\n    pass\n")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"  # a known architecture: transformers would not ask
    config["auto_map"] = {"AutoModelForCausalLM": "custom_llama.CustomLlama"}
    (path / "config.json").write_text(json.dumps(config))
    line = _error_line(["eval", path, "--windows", "1", "--seqlen", "16", "--quiet"])
    assert "ships its own model code" in line and "--trust-remote-code" in line
    out = tmp_path / "out"
    assert "ships its own model code" in _error_line(_quantize(path, out))
    assert _invoke(_quantize(path, out, "--trust-remote-code")).exit_code == 0
    assert "auto_map" not in json.loads((out / "config.json").read_text())


def test_commands_that_compress_need_an_output_or_no_save(tiny_checkpoint: Path, monkeypatch) -> None:
    common = ["--model", tiny_checkpoint, "--no-eval", "--quiet"]
    with monkeypatch.context() as m:
        m.setattr(optc.run.pipeline, "load_model", lambda *_a, **_k: pytest.fail("loaded"))
        for command in (["quantize"], ["prune", "--pattern", "2:4"], ["run", "w4a16-rtn"]):
            line = _error_line([*command, *common])
            assert "no --output" in line and "--no-save" in line
    assert _invoke(["quantize", *common, "--no-save"]).exit_code == 0


def test_oversized_recipes_are_refused_before_parsing(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text("version: 1\n" + "#" * 2**20 + "\n")
    monkeypatch.setattr("optc.recipe._UniqueKeyLoader", None)  # never parsed
    assert "larger than 1 MiB" in _error_line(["recipes", "validate", path])


def test_no_network_fails_at_once_in_one_line(tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    from optc import network

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once, locally
    t0 = time.monotonic()
    assert not network.reachable()
    line = _error_line(["eval", "someone/some-model", "--windows", "1"])
    assert "model 'someone/some-model' would be downloaded from http://127.0.0.1:9, which cannot be reached" in line
    assert "local model directory" in line
    line = _error_line(["eval", tiny_checkpoint, "--dataset", "wikitext2", "--windows", "1"])
    assert "dataset 'wikitext2'" in line and "local .txt/.jsonl" in line
    assert time.monotonic() - t0 < 20


def test_a_failed_final_rename_puts_the_previous_output_back(tmp_path: Path, monkeypatch) -> None:
    from optc.export.checkpoint import staged_output

    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("{}")
    before = _digest(out)
    rename = Path.rename

    def tmp_cannot_move(self, target):
        if self.name.startswith(".out.partial-"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", tmp_cannot_move)
    with pytest.raises(OptcError, match="nothing was written"):
        with staged_output(out, overwrite=True) as tmp:
            (tmp / "model.safetensors").write_bytes(b"new")
    assert _digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
