"""INT8 weights and activations: activation fake-quant, the W8A8 and SmoothQuant stages,
int-quantized export (transformers + compressed-tensors reload), recipes and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, OPTConfig
from typer.testing import CliRunner

from optc.cli.main import app
from optc.compress.actquant import (
    ActivationScheme,
    InputQuant,
    attach_input_quant,
    detach_input_quant,
    dynamic_scale,
    fake_quantize_activation,
    input_quant_of,
    scale_from_threshold,
)
from optc.compress.smoothquant import smoothquant_scale
from optc.errors import OptcError
from optc.export.compressed_tensors import read_compressed_tensors, write_int_quantized
from optc.export.load import load_checkpoint as load_model
from optc.recipe import builtin_recipes, load_recipe, parse_recipe
from optc.methods import Workspace
from optc.methods.smoothquant import SmoothQuantStage, run_smoothquant
from optc.methods.w8a8 import W8A8Stage, run_w8a8
from optc.testing import TINY_ARCHS, tiny_model, tiny_tokens

runner = CliRunner()
INT8_RECIPES = ("int8", "int8-kl", "int8-percentile", "int8-minmax", "int8-smoothquant")


def _workspace(model: torch.nn.Module, n: int = 8, seqlen: int = 32) -> Workspace:
    ws = Workspace(model, None)
    ws._ids = tiny_tokens(n, seqlen)  # calibration tokens without a tokenizer
    return ws


def _logits(model: torch.nn.Module, ids: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(tiny_tokens(2, 24, seed=5) if ids is None else ids).logits


# --- activation fake-quantization ---------------------------------------------------------


def test_fake_quant_matches_compressed_tensors() -> None:
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    x = torch.randn(2, 7, 33, generator=torch.Generator().manual_seed(0)) * 3
    static = ct.QuantizationArgs(num_bits=8, symmetric=True, strategy="tensor", dynamic=False)
    s = scale_from_threshold(4.0)
    assert torch.equal(fake_quantize_activation(x, s), fake_quantize(x, s, None, static))
    token = ct.QuantizationArgs(num_bits=8, symmetric=True, strategy="token", dynamic=True)
    ct_scale, _ = compute_dynamic_scales_and_zp(x, token, module=torch.nn.Identity())
    ours = dynamic_scale(x, "token")
    torch.testing.assert_close(ours, ct_scale, rtol=0, atol=0)
    assert torch.equal(fake_quantize_activation(x, ours), fake_quantize(x, ct_scale, None, token))


def test_attached_quant_really_quantizes_inputs() -> None:
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    seen = []
    lin.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    iq = InputQuant(ActivationScheme(), scale_from_threshold(1.0))
    attach_input_quant(lin, iq)
    lin(x)
    codes = seen[-1] / iq.scale
    assert torch.equal(codes, codes.round()) and codes.abs().max() <= 128
    assert input_quant_of(torch.nn.Sequential(lin)) == {"0": iq}
    detach_input_quant(lin)
    lin(x)
    assert torch.equal(seen[-1], x)
    with pytest.raises(ValueError):
        InputQuant(ActivationScheme(strategy="token", dynamic=True), scale_from_threshold(1.0))


# --- SmoothQuant --------------------------------------------------------------------------


def test_smoothquant_scale_formula() -> None:
    act = torch.tensor([4.0, 1.0, 9.0])
    w = torch.tensor([[1.0, -4.0, 1.0], [0.5, 2.0, -1.0]])  # column maxima 1, 4, 1
    torch.testing.assert_close(smoothquant_scale(act, [w], 0.5), torch.tensor([2.0, 0.5, 3.0]))
    torch.testing.assert_close(smoothquant_scale(act, [w], 1.0), act)
    torch.testing.assert_close(smoothquant_scale(act, [w, 2 * w], 0.0), 1 / torch.tensor([2.0, 8.0, 2.0]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        smoothquant_scale(act, [w], 1.2)


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("scope", ["norms", "all"])
def test_smoothquant_leaves_float_logits_unchanged(arch: str, scope: str) -> None:
    model = tiny_model(arch)
    before = _logits(model)
    ws = _workspace(model)
    stats = run_smoothquant(ws, SmoothQuantStage(type="smoothquant", alpha=0.8, scope=scope))
    assert stats["modules"], "nothing was smoothed"
    torch.testing.assert_close(_logits(model), before, atol=2e-5, rtol=1e-4)


def test_smoothquant_migrates_a_planted_outlier_channel() -> None:
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[7] = 60.0  # one outlier channel into q/k/v
    before = _logits(model)
    stats = run_smoothquant(_workspace(model), SmoothQuantStage(type="smoothquant", alpha=0.5))
    q = stats["modules"]["model.layers.0.self_attn.q_proj"]
    assert q["smoothed_by"] == "model.layers.0.input_layernorm"
    assert q["act_absmax"] > 10 * q["act_absmax_smoothed"]
    torch.testing.assert_close(_logits(model), before, atol=2e-5, rtol=1e-4)


def test_smoothquant_refuses_post_norm_layers() -> None:
    cfg = OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=64, word_embed_proj_dim=32, do_layer_norm_before=False)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(OptcError, match=r"cannot smooth model\.decoder\.layers\.0 .*no normalization"):
        run_smoothquant(_workspace(model), SmoothQuantStage(type="smoothquant"))


# --- the W8A8 stage -----------------------------------------------------------------------


@pytest.mark.parametrize("observer", ["minmax", "moving_minmax", "percentile", "mse", "kl"])
def test_w8a8_static_attaches_calibrated_scales(observer: str) -> None:
    model = tiny_model("llama")
    float_logits = _logits(model)
    ws = _workspace(model)
    cfg = W8A8Stage(type="w8a8", method="rtn", activations={"observer": observer})
    stats = run_w8a8(ws, cfg)
    iq = input_quant_of(model)
    assert set(iq) == set(ws.qparams) == set(stats["modules"])  # every Linear, weights and inputs
    q, k = iq["model.layers.0.self_attn.q_proj"], iq["model.layers.0.self_attn.k_proj"]
    assert q.scale is not None and torch.equal(q.scale, k.scale)  # a shared input: one scale
    entry = stats["modules"]["model.layers.0.self_attn.q_proj"]
    assert set(entry["ranges"]) == {"minmax", "moving_minmax", "percentile", "mse", "kl"}
    assert entry["threshold"] == pytest.approx(entry["ranges"][observer], rel=1e-5)
    assert 0 < entry["clip_ratio"] <= 1 and entry["output_sqnr_db"] > 10
    assert any("static per-tensor" in n for n in stats["notes"])
    quantized = _logits(model)
    for m in iq:
        detach_input_quant(model.get_submodule(m))
    weight_only = _logits(model)
    # Activations are quantized for real: removing their quantization changes the logits.
    assert not torch.allclose(quantized, weight_only)
    assert (quantized - float_logits).abs().max() < 0.5


def test_w8a8_dynamic_gptq_and_mixed_precision() -> None:
    model = tiny_model("llama")
    ws = _workspace(model)
    cfg = W8A8Stage(
        type="w8a8", activations={"strategy": "token", "dynamic": True},
        overrides=[{"pattern": r"layers\.1\.mlp\.down_proj", "scheme": None}],
        activation_overrides=[{"pattern": "o_proj", "activations": None}],
    )
    stats = run_w8a8(ws, cfg)
    iq = input_quant_of(model)
    assert "model.layers.1.mlp.down_proj" not in ws.qparams | iq  # kept 16-bit entirely
    assert "model.layers.0.self_attn.o_proj" in ws.qparams and "model.layers.0.self_attn.o_proj" not in iq
    assert all(v.scale is None and v.scheme.strategy == "token" for v in iq.values())
    assert stats["modules"]["model.layers.0.self_attn.o_proj"]["activations"] == "16-bit"
    assert "gptq_loss" not in stats["modules"]["model.layers.0.mlp.up_proj"]
    assert len(ws.qparams) == 13 and len(iq) == 11


# --- export -------------------------------------------------------------------------------


def _export_and_reload(model: torch.nn.Module, ws: Workspace, directory: Path) -> dict:
    info = write_int_quantized(model, ws.qparams, input_quant_of(model), directory)
    ids = tiny_tokens(2, 24, seed=9)
    ours = _logits(model, ids)
    # Eager attention like the tiny model's: dynamic per-token rounding would amplify the
    # last-bit differences between attention kernels.
    hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    torch.testing.assert_close(_logits(hf, ids), ours, atol=1e-5, rtol=1e-5)
    _, qparams, iq = read_compressed_tensors(directory)
    assert set(qparams) == set(ws.qparams) and set(iq) == set(input_quant_of(model))
    return info


@pytest.mark.parametrize("activations", [{"observer": "kl"}, {"strategy": "token", "dynamic": True}])
def test_int_quantized_round_trip_through_transformers(activations: dict, tmp_path: Path) -> None:
    model = tiny_model("llama")
    ws = _workspace(model)
    run_w8a8(ws, W8A8Stage(type="w8a8", activations=activations))
    info = _export_and_reload(model, ws, tmp_path / "ck")
    assert info["format"] == "int-quantized"
    qc = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group["input_activations"]["dynamic"] is bool(activations.get("dynamic"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as fh:
        w = fh.get_tensor("model.layers.0.mlp.down_proj.weight")
        assert w.dtype == torch.int8 and w.shape == (96, 200)
        assert ("model.layers.0.mlp.down_proj.input_scale" in fh.keys()) is not activations.get("dynamic", False)


def test_mixed_precision_export_reloads(tmp_path: Path, default_tokenizer) -> None:
    model = tiny_model("llama")
    ws = _workspace(model)
    run_w8a8(ws, W8A8Stage(
        type="w8a8", method="rtn", activations={"observer": "percentile", "percentile": 99.9},
        overrides=[{"pattern": "layers\\.0\\.mlp\\.down_proj", "scheme": None}],
        activation_overrides=[{"pattern": "o_proj", "activations": None}],
    ))
    info = _export_and_reload(model, ws, tmp_path / "mixed")
    assert info["format"] == "mixed-precision"
    qc = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization_config"]
    assert sorted(g["format"] for g in qc["config_groups"].values()) == ["int-quantized", "pack-quantized"]
    assert "model.layers.0.mlp.down_proj" in qc["ignore"]
    # optc's own loader attaches the stored activation scales again.
    default_tokenizer.save_pretrained(tmp_path / "mixed")  # load_model wants a tokenizer
    loaded = load_model(str(tmp_path / "mixed")).model
    ids = tiny_tokens(2, 24, seed=9)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), atol=1e-5, rtol=1e-5)
    assert set(input_quant_of(loaded)) == set(input_quant_of(model))


# --- recipes, the CLI and bad input -------------------------------------------------------


def test_builtin_int8_recipes_validate() -> None:
    names = builtin_recipes()
    for name in INT8_RECIPES:
        assert f"{name}.yaml" in names
        recipe = load_recipe(name)
        assert recipe.stages[-1].type == "w8a8" and recipe.export.format == "compressed-tensors"
    assert [s.type for s in load_recipe("int8-smoothquant").stages] == ["smoothquant", "w8a8"]
    assert load_recipe("int8-kl").stages[-1].activations.observer == "kl"


@pytest.mark.parametrize(
    ("stage", "message"),
    [
        ({"type": "w8a8", "activations": {"observer": "entropy"}}, "activations.observer"),
        ({"type": "w8a8", "activations": {"observer": "percentile", "percentile": 0}}, "percentile must be in (0, 100]"),
        ({"type": "w8a8", "activations": {"percentile": 100.5}}, "percentile must be in (0, 100]"),
        ({"type": "w8a8", "activations": {"strategy": "token"}}, "set dynamic: true"),
        ({"type": "smoothquant", "alpha": 1.5}, "alpha"),
        ({"type": "smoothquant", "alpha": -0.1}, "alpha"),
    ],
)
def test_bad_recipe_values_are_named(stage: dict, message: str) -> None:
    with pytest.raises(OptcError) as exc:
        parse_recipe({"version": 1, "stages": [stage]})
    assert message in str(exc.value)


def _cli_error(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 1, (result.output, result.exception)
    assert "Traceback" not in result.output
    return result.output


def test_cli_bad_input_exits_1_and_writes_nothing(tiny_checkpoint: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nstages:\n  - type: w8a8\n    activations: {observer: kl2}\n")
    out = tmp_path / "out"
    assert "observer" in _cli_error(["quantize", "--recipe", str(bad), "--model", str(tiny_checkpoint), "--output", str(out), "--no-eval"])
    alpha = tmp_path / "alpha.yaml"
    alpha.write_text("version: 1\nstages:\n  - type: smoothquant\n    alpha: 2\n  - type: w8a8\n")
    assert "alpha" in _cli_error(["quantize", "--recipe", str(alpha), "--model", str(tiny_checkpoint), "--output", str(out), "--no-eval"])
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == sorted(["alpha.yaml", "bad.yaml"]) or not out.exists()


def test_cli_post_norm_model_error_names_the_layer(tmp_path: Path, default_tokenizer) -> None:
    cfg = OPTConfig(vocab_size=len(default_tokenizer), hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=1024, word_embed_proj_dim=32,
                    do_layer_norm_before=False)
    src = tmp_path / "post-ln"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    default_tokenizer.save_pretrained(src)
    out = tmp_path / "out"
    msg = _cli_error(["quantize", "--recipe", "int8-smoothquant", "--model", str(src), "--output", str(out),
                      "--samples", "4", "--seqlen", "64", "--no-eval"])
    assert "model.decoder.layers.0" in msg and "SmoothQuant" in msg
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_cli_int8_run_reports_and_reloads(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "w8a8"
    result = runner.invoke(app, ["quantize", "--recipe", "int8-smoothquant", "--model", str(tiny_checkpoint),
                                 "--output", str(out), "--samples", "8", "--seqlen", "64", "--windows", "2"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "report.json").read_text())
    assert report["checkpoint"]["format"] == "compressed-tensors/int-quantized"
    w8a8 = report["stages"][-1]
    assert "static per-tensor" in w8a8["summary"] and "output SQNR" in w8a8["summary"]
    assert "| layer |" in (out / "report.md").read_text()  # the per-layer calibration table
    loaded = load_model(str(out))
    assert len(input_quant_of(loaded.model)) == len(w8a8["stats"]["modules"])
