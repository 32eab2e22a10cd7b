"""Low-precision CPU kernels: they compute the checkpoint's weights, and fallbacks are named."""

from __future__ import annotations

import copy

import pytest
import torch

from optc.compress.quant import QuantScheme, compute_qparams, fake_quantize
from optc.evaluate.latency import (
    INT4_KERNEL,
    INT8_DYNAMIC_KERNEL,
    INT8_WO_KERNEL,
    Int4WeightOnlyLinear,
    apply_kernels,
    float_summary,
    kernel_available,
    kernel_for,
    measure_latency,
    percentile,
)
from optc.methods import Workspace
from optc.methods.rtn import RTNStage, run_rtn
from optc.testing import tiny_model, tiny_tokens


def _quantized_linear(n: int, k: int, scheme: QuantScheme, bias: bool = True):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=bias)
    p = compute_qparams(lin.weight.detach(), scheme)
    with torch.no_grad():
        lin.weight.copy_(fake_quantize(lin.weight, p))
    return lin, p


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, None])
def test_int4_kernel_matches_dequantized_weights(symmetric: bool, group: int | None) -> None:
    if not kernel_available("int4"):
        pytest.skip("int4 CPU kernel not in this torch build")
    lin, p = _quantized_linear(48, 128, QuantScheme(bits=4, symmetric=symmetric, group_size=group))
    model = torch.nn.Sequential(lin)
    summary = apply_kernels(model, {"0": p})
    assert isinstance(model[0], Int4WeightOnlyLinear) and summary.kernel == INT4_KERNEL
    x = torch.randn(3, 5, 128)
    with torch.inference_mode():
        ref, out = lin(x), model(x)
    # bfloat16 activations and scales inside the kernel: ~3 significant digits.
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < 0.02 * ref.abs().max()


@pytest.mark.parametrize("choice,name", [("int8-dynamic", INT8_DYNAMIC_KERNEL), ("auto", INT8_WO_KERNEL), ("int8-weight-only", INT8_WO_KERNEL)])
def test_int8_kernels_match_dequantized_weights(choice: str, name: str) -> None:
    lin, p = _quantized_linear(40, 96, QuantScheme(bits=8, group_size=None))
    model = torch.nn.Sequential(lin)
    summary = apply_kernels(model, {"0": p}, choice)
    if summary.fallbacks:
        pytest.skip(f"int8 kernel unavailable: {summary.fallbacks}")
    assert summary.kernel == name and model[0].kernel == name
    x = torch.randn(7, 96)
    with torch.inference_mode():
        ref, out = lin(x), model(x)
    assert (out - ref).abs().max() < 0.03 * ref.abs().max()


def test_unsupported_schemes_fall_back_and_say_why() -> None:
    scheme3 = QuantScheme(bits=3, group_size=32)
    _, p3 = _quantized_linear(32, 64, scheme3)
    assert kernel_for(p3, 32, 64)[0] is None
    _, p4 = _quantized_linear(40, 64, QuantScheme(bits=4, group_size=32))
    kind, why = kernel_for(p4, 40, 64)
    assert kind is None and "divisible by 16" in why
    _, pg = _quantized_linear(32, 96, QuantScheme(bits=8, group_size=32))
    assert "per-channel" in kernel_for(pg, 32, 96)[1]
    _, p4 = _quantized_linear(32, 64, QuantScheme(bits=4, group_size=32))
    p4.g_idx = p4.g_idx.flip(0)  # act-order: groups no longer contiguous
    assert "act-order" in kernel_for(p4, 32, 64)[1]


def test_apply_kernels_on_a_model_reports_mixed_kernels() -> None:
    # Tiny Llama: gate/up have 200 outputs (not a multiple of 16), down_proj 200 inputs.
    model = tiny_model("llama")
    ref_model = copy.deepcopy(model)
    ws = Workspace(model, tokenizer=None)
    run_rtn(ws, RTNStage(type="rtn", scheme={"bits": 4, "group_size": 32}))
    ref_model.load_state_dict(model.state_dict())
    summary = apply_kernels(model, ws.qparams)
    if not kernel_available("int4"):
        assert summary.kernel.startswith("float fallback")
        return
    assert summary.kernel.startswith("mixed:")
    assert summary.counts[INT4_KERNEL] == 8  # q, k, v, o in 2 layers
    assert summary.counts["float fallback (float32 matmul)"] == 6
    assert set(summary.fallbacks) == {f"model.layers.{i}.mlp.{n}" for i in range(2) for n in ("gate_proj", "up_proj", "down_proj")}
    ids = tiny_tokens(2, 16)
    with torch.inference_mode():
        ref, out = ref_model(ids).logits, model(ids).logits
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_float_model_is_labelled_float() -> None:
    model = tiny_model("llama")
    assert apply_kernels(model, {}).kernel.startswith("float fallback (float32 matmul)")
    assert "no quantized weights" in float_summary(model).kernel


def test_measure_latency_reports_percentiles() -> None:
    model = tiny_model("llama")
    res = measure_latency({"m": (model, float_summary(model))}, tiny_tokens(1, 8)[0], new_tokens=5, repeats=3, threads=1)["m"]
    assert res.decode["samples"] == 15 and res.prefill["samples"] == 3 and res.threads == 1
    assert 0 < res.decode["p50_ms"] <= res.decode["p95_ms"] <= res.decode["p99_ms"]
    assert res.decode_tokens_per_s == pytest.approx(1000 / res.decode["p50_ms"])
    assert res.weights_mb > 0
    assert torch.get_num_threads() >= 1  # restored


def test_percentile_interpolates_like_numpy() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0 and percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 95) == pytest.approx(4.8)
