"""KV-cache quantization: the fake quantization against compressed-tensors' own, the hook on a
real attention forward, the checkpoint round trip, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from optc.cli.main import app
from optc.compress.kvquant import KVCacheScheme, KVQuant, attach_kv_quant, detach_kv_quant, kv_quant_of, observe_kv, quantize_kv
from optc.export.formats import get_format
from optc.testing import tiny_model, tiny_tokens

ct_args = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize  # noqa: E402


@pytest.mark.parametrize("grid", ["float", "int"])
def test_cache_grid_matches_compressed_tensors(grid: str) -> None:
    x = torch.randn(2, 3, 17, 8) * 4
    scale = torch.tensor([x.abs().max() / (448.0 if grid == "float" else 127.5)])
    args = ct_args.QuantizationArgs(num_bits=8, type=grid, strategy="tensor", symmetric=True, dynamic=False)
    ours = quantize_kv(x, scale, KVCacheScheme(type=grid))
    assert torch.equal(ours, ct_fake_quantize(x, scale, torch.zeros(1, dtype=torch.int8 if grid == "int" else x.dtype), args))


def test_hook_quantizes_what_attention_reads() -> None:
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    x = tiny_tokens(2, 16)
    seen: list[torch.Tensor] = []
    with torch.no_grad(), observe_kv(attn, lambda k, v: seen.append(k.clone())) as calls:
        ref = model(x).logits
    assert calls[0] == 1 and seen[0].shape[:2] == (2, 2)
    scheme = KVCacheScheme()
    kq = KVQuant(scheme, seen[0].abs().max().reshape(1) / 448, torch.tensor([0.5 / 448]))
    attach_kv_quant(attn, kq)
    assert list(kv_quant_of(model)) == ["model.layers.0.self_attn"]
    with torch.no_grad():
        got = model(x).logits
        # with a real cache (generation) the hook quantizes the same states
        cached = model(x, use_cache=True).logits
        # what the observer sees under the quantizing hook: the states before quantization
        with observe_kv(attn, lambda k, v: seen.append(k.clone())):
            model(x)
    assert not torch.equal(got, ref) and torch.allclose(got, cached, atol=1e-5)
    assert torch.equal(seen[-1], seen[0])
    detach_kv_quant(attn)
    with torch.no_grad():
        assert torch.allclose(model(x).logits, ref, atol=1e-6)


def test_recipe_writes_and_reads_kv_scales(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "version: 1\nname: kv\nstages:\n  - type: w8a8\n    scheme: {type: float, bits: 8, group_size: null}\n"
        "    method: rtn\n    weight_observer: minmax\n    activations: {type: float, strategy: token, dynamic: true}\n"
        "  - type: kv_cache\n    scheme: {type: float}\nexport: {format: compressed-tensors}\n", encoding="utf-8")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(recipe), "--model", str(tiny_checkpoint), "--no-eval",
                                      "--output", str(out), "-q", "--samples", "2", "--seqlen", "16"])
    assert result.exit_code == 0, result.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                                     "strategy": "tensor", "dynamic": False, "observer": "minmax"}
    report = json.loads((out / "report.json").read_text())
    stats = next(s for s in report["stages"] if s["type"] == "kv_cache")["stats"]["attention"]
    read = get_format("compressed-tensors").read(out, torch.float32)
    kv = kv_quant_of(read.model)
    assert sorted(kv) == sorted(stats) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for name, kq in kv.items():
        assert kq.k_scale.item() == pytest.approx(stats[name]["k_scale"], rel=1e-6)
        assert kq.k_scale.item() == pytest.approx(stats[name]["k_absmax"] / 448, rel=1e-5)


def test_refusals(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="kl observer searches an int8 grid"):
        KVCacheScheme(type="float", observer="kl")
    with pytest.raises(ValidationError, match="bits"):
        KVCacheScheme(bits=4)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nname: kv\nstages:\n  - type: rtn\n  - type: kv_cache\nexport: {format: gptq}\n",
                      encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(recipe), "--model", str(tiny_checkpoint), "--no-eval",
                                      "--output", str(tmp_path / "out"), "-q"])
    assert result.exit_code != 0
    assert "stage 1 (kv_cache) quantizes the KV cache, which gptq cannot store (use compressed-tensors)" in result.output
    assert not (tmp_path / "out").exists()


def test_an_attention_without_a_cache_argument_is_refused(tiny_checkpoint: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An architecture whose attention takes its cache under a name optc does not know: one
    line naming the layer, before any calibration, nothing written."""
    import optc.model.anatomy as anatomy

    monkeypatch.setattr(anatomy, "CACHE_ARGUMENTS", ("kv_store",))
    result = CliRunner().invoke(app, ["run", "fp8-kv", "--model", str(tiny_checkpoint), "--no-eval",
                                      "--output", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 1, result.output
    assert "kv_cache: no module of LlamaDecoderLayer (model.layers.0) takes a KV cache argument (kv_store)" \
        in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()
