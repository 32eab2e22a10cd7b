"""A new method and a new format, each defined here and registered from this module alone, go
through every path optc has: a recipe naming them on the command line (in memory and streaming),
``optc inspect``, ``optc eval`` and ``optc export`` both ways. Nothing in optc names them."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pytest
import torch
import yaml
from pydantic import Field
from typer.testing import CliRunner

from optc.cli.main import app
from optc.errors import OptcError
from optc.export.files import describe_safetensors, quant_method, read_config, read_tensors, write_config
from optc.export.formats import FORMATS
from optc.export.registry import Format, register as register_format
from optc.export.source import ExportSource, check_linear, refuse_activations, save_tokenizer, uniform_scheme
from optc.methods import METHODS, Method, unregister
from optc.methods import register as register_method
from optc.methods.base import WeightQuantConfig

if TYPE_CHECKING:
    from optc.calibrate.sequential import LayerStep
    from optc.compress.quant import QuantScheme
    from optc.methods.workspace import Workspace

runner = CliRunner()


# --- a method: round-to-nearest on a grid shrunk by a fixed clip ratio ---------------------------


class ShrinkStage(WeightQuantConfig):
    """Round-to-nearest with each group's range clipped to ``ratio`` of its min/max."""

    type: Literal["shrink"]
    ratio: float = Field(0.9, gt=0, le=1)


def run_shrink(ws: Workspace, cfg: ShrinkStage) -> dict:
    from optc.calibrate.sequential import run_sequential
    from optc.compress.quant import compute_qparams, fake_quantize
    from optc.methods.common import record_quantized
    from optc.model.anatomy import weight_2d

    per_module: dict[str, dict] = {}

    def solve(step: LayerStep) -> dict:
        with torch.no_grad():
            for name, module in step.linears.items():
                scheme = cfg.scheme_for(name)
                if scheme is not None:
                    w = weight_2d(module).detach()
                    p = compute_qparams(w, scheme, clip=torch.tensor(cfg.ratio))
                    per_module[name] = record_quantized(ws, name, module, fake_quantize(w, p), p)
        return {}

    run_sequential(ws.model, torch.zeros(0, 1, dtype=torch.long), solve, targets=cfg.targets,
                   ignore=cfg.ignore, batch_size=1, device=ws.device, progress=ws.progress,
                   description="shrink", store=ws.store, records=per_module)
    return {"modules": per_module}


# --- a format: per-channel int8 codes and a float16 scale per row ------------------------------

NAME = "int8-rows"


def _fits(scheme: QuantScheme | None, permuted: bool) -> str | None:
    if scheme is not None and (scheme.bits != 8 or not scheme.symmetric or scheme.group_size is not None):
        return f"int8-rows holds symmetric per-channel 8-bit weights, not {scheme.label()}"
    return None


def _write(src: ExportSource, directory: Path, *, max_shard_bytes: int | None = None, requantize: bool = False) -> dict:
    from optc.export.packing import grid_codes, splice, write_weights

    refuse_activations(src, NAME)
    uniform_scheme(src.qparams, NAME)
    packed = {}
    for name, p in src.qparams.items():
        check_linear(src, name, NAME)
        q = grid_codes(name, src.tensor(f"{name}.weight"), p)
        packed[name] = {"qweight": q.to(torch.int8), "scales": p.scale[:, 0].to(torch.float16)}
    files = write_weights(splice(src, packed), Path(directory), max_shard_bytes or 2 * 1024**3)
    write_config(src, {"quant_method": NAME, "bits": 8}, Path(directory))
    save_tokenizer(src, directory)
    return {"format": NAME, "modules": len(packed), "bytes": sum(f.stat().st_size for f in files)}


def _read_state(directory: Path) -> tuple[dict, dict]:
    from optc.compress.quant import QuantParams, QuantScheme, default_g_idx, dequantize

    tensors = read_tensors(directory)
    scheme = QuantScheme(bits=8, symmetric=True, group_size=None)
    state, qparams = {}, {}
    for name in [k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")]:
        q = tensors.pop(f"{name}.qweight").to(torch.int32)
        scale = tensors.pop(f"{name}.scales").float()[:, None]
        p = QuantParams(scheme, scale, torch.zeros_like(scale, dtype=torch.int32), default_g_idx(q.shape[1], scheme))
        state[f"{name}.weight"] = dequantize(q, p, torch.float32)
        qparams[name] = p
    if not qparams:
        raise OptcError(f"{directory}: int8-rows config but no .qweight tensors")
    state.update(tensors)
    return state, qparams


def _read(path: Path, dtype: Any):
    from optc.export.reading import load_dequantized
    from optc.model.load import CheckpointRead

    model, qparams = load_dequantized(Path(path), dtype, _read_state)
    return CheckpointRead(model, qparams)


INT8_ROWS = Format(
    name=NAME, description="symmetric per-channel int8 weights with float16 row scales",
    fits=_fits, write=_write, read=_read, detect=lambda path: quant_method(path) == NAME,
    describe=lambda path: describe_safetensors(path, {"format": NAME, **read_config(path)["quantization_config"]}),
    bits_per_weight=lambda scheme, in_features: None if scheme is None else 8 + 16 / in_features,
    one_scheme=True, needs_quantized=True,
)


@pytest.fixture
def registered():
    register_method(Method(name="shrink", config=ShrinkStage, run=run_shrink, kind="quantize", streams=True))
    register_format(INT8_ROWS)
    yield
    unregister("shrink")
    FORMATS.pop(NAME)


def _recipe(tmp_path: Path, bits: int = 8) -> Path:
    path = tmp_path / "shrink.yaml"
    path.write_text(yaml.safe_dump({
        "version": 1, "name": "shrink-int8",
        "stages": [{"type": "shrink", "ratio": 0.95, "scheme": {"bits": bits, "symmetric": True, "group_size": None}}],
        "export": {"format": NAME},
    }), encoding="utf-8")
    return path


def _ok(args: list[str]):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_new_method_and_format_go_everywhere(registered, tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = _recipe(tmp_path)
    common = ["--model", str(tiny_checkpoint), "--no-eval", "--samples", "2", "--seqlen", "32", "-q"]
    _ok(["recipes", "validate", str(recipe)])
    _ok(["run", str(recipe), *common, "--output", str(tmp_path / "mem")])
    _ok(["run", str(recipe), *common, "--streaming", "--output", str(tmp_path / "stream")])
    mem, stream = tmp_path / "mem" / "model.safetensors", tmp_path / "stream" / "model.safetensors"
    assert _sha(mem) == _sha(stream)  # the streamed sink is the same writer

    # What was written is the new layout: int8 codes on the clipped grid, float16 row scales.
    tensors = read_tensors(tmp_path / "mem")
    q = tensors["model.layers.0.mlp.down_proj.qweight"]
    assert q.dtype == torch.int8 and tensors["model.layers.0.mlp.down_proj.scales"].dtype == torch.float16
    assert int(q.abs().max()) <= 127

    info = _ok(["inspect", str(tmp_path / "mem"), "--json"]).output
    assert NAME in info
    report = yaml.safe_load(_ok(["eval", str(tmp_path / "mem"), "--seqlen", "32", "--windows", "1", "--json", "-q"]).output)
    assert report["metrics"]["perplexity_model"]["perplexity"] > 1

    # To another format and back: the same codes and scales, so the same bytes.
    _ok(["export", str(tmp_path / "mem"), "--format", "compressed-tensors", "--output", str(tmp_path / "ct")])
    _ok(["export", str(tmp_path / "ct"), "--format", NAME, "--output", str(tmp_path / "back")])
    assert _sha(tmp_path / "back" / "model.safetensors") == _sha(mem)


def test_the_new_format_refuses_what_it_cannot_hold(registered, tiny_checkpoint: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["run", str(_recipe(tmp_path, bits=4)), "--model", str(tiny_checkpoint),
                                 "--no-eval", "--output", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "int8-rows holds symmetric per-channel 8-bit weights, not int4" in result.output
    assert not (tmp_path / "out").exists()


def test_unregistered_names_are_unknown_again(tmp_path: Path) -> None:
    assert "shrink" not in METHODS and NAME not in FORMATS
    result = runner.invoke(app, ["recipes", "validate", str(_recipe(tmp_path))])
    assert result.exit_code == 1 and "unknown stage type 'shrink'" in result.output
    assert "optc.methods.shrink" not in sys.modules
