"""The export format registry: torch-free import, a format registered by a test is found by
``get_format``, ``detect_format``, recipes and the CLI's ``export`` / ``inspect``, and writers
fed tensors one at a time (as from disk) write the same bytes as from memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optc.cli.main import app
from optc.errors import OptcError
from optc.export.formats import FORMATS, Format, detect_format, get_format, register
from optc.export.source import ExportSource, ModelSource
from optc.model.safetensors_io import Lazy
from test_formats_support import quantize_rtn, tiny_lm, tiny_tokenizer  # noqa: F401 - fixtures

runner = CliRunner()
BUILTIN = ["dense", "compressed-tensors", "gptq", "awq", "gguf-q4_0", "gguf-q4_1", "gguf-q5_0", "gguf-q5_1", "gguf-q8_0", "gguf-f16",
           "gguf-q2_k", "gguf-q3_k_s", "gguf-q3_k_m", "gguf-q3_k_l", "gguf-q4_k_s", "gguf-q4_k_m", "gguf-q5_k_s",
           "gguf-q5_k_m", "gguf-q6_k"]


def test_importing_the_registry_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys\n"
        "import optc.export.formats as f\n"
        "assert list(f.FORMATS)[:%d] == %r, list(f.FORMATS)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print(heavy)\n" % (len(BUILTIN), BUILTIN)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_builtin_formats_and_unknown_names() -> None:
    assert list(FORMATS)[: len(BUILTIN)] == BUILTIN
    assert get_format("awq").one_scheme and get_format("compressed-tensors").holds_activations
    with pytest.raises(OptcError, match="unknown export format 'exl2' \\(expected one of dense, compressed-tensors"):
        get_format("exl2")
    with pytest.raises(ValueError, match="already registered"):
        register(Format(**{**vars(get_format("dense")), "description": "another"}))


# --- a format that exists only in this test ---------------------------------------------------

TOY = "toy-json"


def _toy_write(src: ExportSource, directory: Path, *, max_shard_bytes: int | None = None,
               requantize: bool = False) -> dict:
    """Shapes and grids, no weights: enough to show a writer needs only the source."""
    entries = {k: [str(src.spec(k)[0]), list(src.spec(k)[1])] for k in src.keys()}
    grids = {n: p.scheme.label() for n, p in src.qparams.items()}
    (Path(directory) / "toy.json").write_text(json.dumps({"tensors": entries, "grids": grids}))
    return {"format": TOY, "bytes": (Path(directory) / "toy.json").stat().st_size, "modules": len(grids)}


def _toy_describe(path: Path) -> dict:
    data = json.loads((Path(path) / "toy.json").read_text())
    return {"path": str(path), "format": TOY, "tensors": len(data["tensors"]), "modules": len(data["grids"])}


@pytest.fixture
def toy_format():
    fmt = register(Format(
        name=TOY,
        description="test-only: tensor shapes as JSON",
        fits=lambda scheme, permuted: None if scheme is None or scheme.bits >= 4 else "toy holds 4+ bits",
        write=_toy_write,
        read=None,
        detect=lambda path: (Path(path) / "toy.json").is_file(),
        describe=_toy_describe,
        bits_per_weight=lambda scheme, in_features: None,
        needs_quantized=True,
    ))
    yield fmt
    FORMATS.pop(TOY)


def test_a_registered_format_is_found_everywhere(toy_format, tiny_lm, tiny_tokenizer, tmp_path) -> None:
    from optc.export.formats import check_schemes
    from optc.recipe import parse_recipe
    from optc.run.pipeline import check_recipe_export

    assert get_format(TOY) is toy_format
    recipe = parse_recipe({"version": 1, "stages": [{"type": "rtn", "scheme": {"bits": 3}}], "export": {"format": TOY}})
    assert recipe.export.format == TOY
    with pytest.raises(OptcError, match="export format toy-json: stage 0 \\(rtn\\) scheme: toy holds 4\\+ bits"):
        check_recipe_export(recipe)
    check_schemes(TOY, [])

    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, bits=4, group_size=32)
    source = tmp_path / "ct"
    source.mkdir()
    get_format("compressed-tensors").write(ModelSource(model, tiny_tokenizer, qparams), source)
    result = runner.invoke(app, ["export", str(source), "--format", TOY, "--output", str(tmp_path / "toy")])
    assert result.exit_code == 0, result.output
    assert TOY in result.output and (tmp_path / "toy" / "toy.json").is_file()
    assert detect_format(tmp_path / "toy") is toy_format
    assert detect_format(source).name == "compressed-tensors"
    info = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "toy"), "--json"]).output)
    assert info["format"] == TOY and info["modules"] == 14 and info["tensors"] == len(ModelSource(model).keys())


def test_unregistered_format_is_refused_by_recipes_and_cli(tmp_path) -> None:
    from optc.recipe import parse_recipe

    with pytest.raises(OptcError, match="export.format"):
        parse_recipe({"version": 1, "export": {"format": TOY}})
    result = runner.invoke(app, ["export", str(tmp_path), "--format", TOY, "--output", str(tmp_path / "x")])
    assert result.exit_code == 1 and "unknown export format" in result.output


# --- writers read a source one tensor at a time -----------------------------------------------


class LazySource(ModelSource):
    """Every unchanged tensor handed over as a lazy load, as a source on disk would."""

    def entry(self, key: str):
        dtype, shape = self.spec(key)
        return Lazy(lambda k=key: self.tensor(k).clone(), dtype, shape)


@pytest.mark.parametrize(("fmt", "scheme"), [
    ("compressed-tensors", {"bits": 4, "symmetric": False, "group_size": 32}),
    ("gptq", {"bits": 4, "symmetric": True, "group_size": 64}),
    ("awq", {"bits": 4, "symmetric": False, "group_size": 32}),
])
def test_lazy_entries_write_the_same_bytes(fmt, scheme, tiny_lm, tiny_tokenizer, tmp_path) -> None:
    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, **scheme)
    for shard in (2 * 1024**3, 30_000):
        eager, lazy = tmp_path / f"eager-{shard}", tmp_path / f"lazy-{shard}"
        eager.mkdir()
        lazy.mkdir()
        a = get_format(fmt).write(ModelSource(model, None, qparams), eager, max_shard_bytes=shard)
        b = get_format(fmt).write(LazySource(model, None, qparams), lazy, max_shard_bytes=shard)
        assert a == b
        files = sorted(p.name for p in eager.iterdir())
        assert files == sorted(p.name for p in lazy.iterdir()) and (len(a["files"]) > 1) == (shard < 10**6)
        for name in files:
            assert (eager / name).read_bytes() == (lazy / name).read_bytes(), name
