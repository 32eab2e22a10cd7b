"""Weight quantization end to end on tiny models of every supported architecture."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from optc.model.anatomy import select_linears
from optc.errors import OptcError
from optc.export.ct_pack import read_pack_quantized, write_pack_quantized
from optc.export.dense import write_dense
from optc.export.reading import load_dequantized
from optc.methods import METHODS, Workspace
from optc.testing import TINY_ARCHS, tiny_model, tiny_tokens


def _quantize(model, method: str, ids: torch.Tensor, **extra) -> Workspace:
    ws = Workspace(model, None)
    ws._ids = ids
    cfg_cls, fn = METHODS[method].config, METHODS[method].run
    cfg = cfg_cls.model_validate(
        {"type": method, "scheme": {"bits": 3, "group_size": 32}, **extra}
    )
    fn(ws, cfg)
    return ws


def logit_error(model, ref_logits: torch.Tensor, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(ids).logits - ref_logits).pow(2).mean())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_calibrated_methods_beat_rtn(arch):
    ids = tiny_tokens(16, 64)
    base = tiny_model(arch)
    with torch.no_grad():
        ref = base(ids).logits
    errors = {}
    for method in ("rtn", "gptq", "awq"):
        model = copy.deepcopy(base)
        ws = _quantize(model, method, ids)
        assert set(ws.qparams) == set(select_linears(model, [".*"], ["lm_head"]))
        errors[method] = logit_error(model, ref, ids)
    assert errors["gptq"] < errors["rtn"], errors
    assert errors["awq"] < errors["rtn"], errors


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "opt"])
@pytest.mark.parametrize("groups", ["lazy", "static"])
def test_gptq_checkpoint_reloads_in_transformers(arch, groups, tmp_path):
    ids = tiny_tokens(8, 64)
    model = tiny_model(arch)
    ws = _quantize(model, "gptq", ids, actorder=True, groups=groups)
    assert_pack_quantized_reloads(model, ws.qparams, ids, tmp_path)


def assert_pack_quantized_reloads(model, qparams: dict, ids: torch.Tensor, path) -> None:
    """The pack-quantized checkpoint of ``model`` gives its logits in plain transformers and
    through optc's reader, which finds the same quantized Linears."""
    write_pack_quantized(model, qparams, path)
    with torch.no_grad():
        ours = model(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(path)(ids).logits
        own, read = load_dequantized(path, torch.float32, read_pack_quantized)
        again = own(ids).logits
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - again).abs().max() < 1e-5
    assert set(read) == set(qparams)


def test_gpt2_conv1d_dense_export_reloads(tmp_path):
    ids = tiny_tokens(8, 64)
    model = tiny_model("gpt2")
    _quantize(model, "gptq", ids)
    write_dense(model, None, tmp_path)
    with torch.no_grad():
        diff = (model(ids).logits - AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits)
    assert diff.abs().max() < 1e-5


def test_mixed_precision_overrides():
    ids = tiny_tokens(8, 64)
    model = tiny_model("llama")
    ws = _quantize(
        model, "gptq", ids,
        overrides=[
            {"pattern": r"down_proj", "scheme": {"bits": 8, "group_size": None}},
            {"pattern": r"layers\.0\.self_attn", "scheme": None},
        ],
    )
    assert not any(n.startswith("model.layers.0.self_attn") for n in ws.qparams)
    down = [p for n, p in ws.qparams.items() if n.endswith("down_proj")]
    assert down and all(p.scheme.bits == 8 and p.scheme.group_size is None for p in down)
    assert ws.qparams["model.layers.1.self_attn.q_proj"].scheme.bits == 3


def test_non_dividing_group_size():
    # hidden 96 and intermediate 200 are not multiples of 64.
    ids = tiny_tokens(8, 64)
    model = tiny_model("llama")
    ws = Workspace(model, None)
    ws._ids = ids
    cfg_cls, fn = METHODS["gptq"].config, METHODS["gptq"].run
    fn(ws, cfg_cls.model_validate({"type": "gptq", "scheme": {"bits": 4, "group_size": 64}}))
    p = ws.qparams["model.layers.0.mlp.down_proj"]
    assert p.scale.shape == (96, 4)  # ceil(200 / 64)


def test_non_positive_definite_hessian_names_layer(monkeypatch):
    import optc.calibrate.hessian as stages  # run_gptq imports it when called

    ids = tiny_tokens(4, 32)
    model = tiny_model("llama")

    class Broken:
        def __init__(self, k: int, **_: object) -> None:
            self.H = -torch.eye(k)

        def add(self, x: torch.Tensor) -> None:
            pass

    monkeypatch.setattr(stages, "HessianAccumulator", Broken)
    with pytest.raises(OptcError, match=r"model\.layers\.0\.self_attn\.q_proj"):
        _quantize(model, "gptq", ids)
    for m in model.modules():
        assert not m._forward_hooks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gptq_on_cuda_matches_cpu():
    ids = tiny_tokens(8, 64)
    results = {}
    for device in ("cpu", "cuda"):
        model = tiny_model("llama")
        ws = Workspace(model, None, device=device)
        ws._ids = ids
        cfg_cls, fn = METHODS["gptq"].config, METHODS["gptq"].run
        fn(ws, cfg_cls.model_validate({"type": "gptq", "scheme": {"bits": 4, "group_size": 32}}))
        assert next(model.parameters()).device.type == "cpu"  # only the layer visits the GPU
        results[device] = model.model.layers[1].mlp.down_proj.weight.detach().clone()
    assert (results["cpu"] - results["cuda"]).abs().max() < 1e-3


def test_bfloat16_autocast_calibration_close_to_float():
    ids = tiny_tokens(16, 64)
    base = tiny_model("llama")
    with torch.no_grad():
        ref = base(ids).logits
    errors = {}
    for autocast in ("off", "bfloat16"):
        model = copy.deepcopy(base)
        ws = Workspace(model, None)
        ws.calibration = ws.calibration.model_copy(update={"autocast": autocast})
        ws._ids = ids
        cfg_cls, fn = METHODS["gptq"].config, METHODS["gptq"].run
        fn(ws, cfg_cls.model_validate({"type": "gptq", "scheme": {"bits": 3, "group_size": 32}}))
        errors[autocast] = logit_error(model, ref, ids)
    rtn = copy.deepcopy(base)
    _quantize(rtn, "rtn", ids)
    assert errors["bfloat16"] < logit_error(rtn, ref, ids)
    assert errors["bfloat16"] < 1.5 * errors["off"]


def test_gptq_true_sequential_calibrates_each_group_on_quantized_outputs():
    ids = tiny_tokens(8, 64)
    base = tiny_model("llama")
    weights = {}
    for seq in (False, True):
        model = copy.deepcopy(base)
        _quantize(model, "gptq", ids, sequential=seq)
        weights[seq] = {n: m.weight.detach().clone() for n, m in select_linears(model, [".*"], ["lm_head"]).items()}
    first = "model.layers.0."
    # q/k/v read the layer input: the same Hessian either way. o_proj (and everything after
    # it) is calibrated on the outputs of the already quantized q/k/v in sequential mode.
    for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        assert torch.equal(weights[False][first + n], weights[True][first + n]), n
    for n in ("self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
        assert not torch.equal(weights[False][first + n], weights[True][first + n]), n
