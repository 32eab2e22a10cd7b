from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from optc.model.anatomy import find_decoder_layers, weight_2d
from optc.compress.awq import apply_scale, awq_search_clip, awq_search_scale, gram, resolve_mappings, scaled_gram
from optc.compress.quant import QuantScheme, compute_qparams, fake_quantize
from optc.errors import OptcError
from optc.testing import TINY_ARCHS, tiny_config, tiny_model, tiny_tokens

EXPECTED = {
    "llama": [
        ("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"]),
        ("mlp.up_proj", ["mlp.down_proj"]),
    ],
    "opt": [
        ("self_attn_layer_norm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        ("self_attn.v_proj", ["self_attn.out_proj"]),
        ("final_layer_norm", ["fc1"]),
        ("fc1", ["fc2"]),
    ],
    "gpt2": [("ln_1", ["attn.c_attn"]), ("ln_2", ["mlp.c_fc"])],
}
EXPECTED["qwen2"] = EXPECTED["mistral"] = EXPECTED["llama"]


def _names(layer: nn.Module) -> list[tuple[str, list[str]]]:
    return [(m.prev_name, m.linear_names) for m in resolve_mappings(layer)]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_resolve_mappings(arch: str) -> None:
    _, layers = find_decoder_layers(tiny_model(arch))
    assert _names(layers[0]) == EXPECTED[arch]


def test_resolve_mappings_mha_keeps_v_to_o() -> None:
    cfg = tiny_config("llama")
    cfg.num_key_value_heads = cfg.num_attention_heads
    model = AutoModelForCausalLM.from_config(cfg)
    _, layers = find_decoder_layers(model)
    assert ("self_attn.v_proj", ["self_attn.o_proj"]) in _names(layers[0])


def test_resolve_mappings_unknown_layer() -> None:
    class Mystery(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(OptcError, match="Mystery"):
        resolve_mappings(Mystery())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_apply_scale_preserves_logits(arch: str) -> None:
    model = tiny_model(arch)
    tokens = tiny_tokens(n=2, seqlen=16)
    with torch.no_grad():
        ref = model(tokens).logits
    _, layers = find_decoder_layers(model)
    g = torch.Generator().manual_seed(1)
    for layer in layers:
        for m in resolve_mappings(layer):
            k = weight_2d(m.linears[0]).shape[1]
            s = torch.exp(0.5 * torch.randn(k, generator=g))
            before = weight_2d(m.linears[0]).clone()
            apply_scale(m.prev, m.linears, s)
            assert not torch.allclose(before, weight_2d(m.linears[0]))
    with torch.no_grad():
        out = model(tokens).logits
    assert (out - ref).abs().max().item() < 1e-4


def test_apply_scale_rejects_non_proportional_norm() -> None:
    class OnePlusNorm(nn.Module):  # Gemma-style: y = x * (1 + w)
        def __init__(self, k: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(k))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (1 + self.weight)

    norm, lin = OnePlusNorm(8), nn.Linear(8, 4)
    w0, l0 = norm.weight.detach().clone(), lin.weight.detach().clone()
    with pytest.raises(OptcError, match="OnePlusNorm"):
        apply_scale(norm, [lin], torch.full((8,), 2.0))
    assert torch.equal(norm.weight, w0) and torch.equal(lin.weight, l0)


def _outlier_data(k: int, n: int, seed: int, t: int = 1024) -> tuple[torch.Tensor, list]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:4]] *= 50.0  # a few salient channels (§2.2)
    ws = [torch.randn(n, k, generator=g), torch.randn(n // 2, k, generator=g)]
    return x, ws


def _out_mse(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return (x @ w.T - x @ w_hat.T).pow(2).mean().item()


@pytest.mark.parametrize("duo", [True, False])
@pytest.mark.parametrize("k,group", [(256, 64), (200, 64), (192, None)])
def test_search_scale_beats_rtn(k: int, group: int | None, duo: bool) -> None:
    scheme = QuantScheme(bits=4, group_size=group)
    x, ws = _outlier_data(k, 128, seed=k)
    res = awq_search_scale(gram(x), x.abs().mean(0), ws, scheme, duo_scaling=duo)
    assert res.scale.shape == (k,)
    w = torch.cat(ws)
    rtn = _out_mse(x, w, fake_quantize(w, compute_qparams(w, scheme)))
    ws_ = w * res.scale
    awq = _out_mse(x, w, fake_quantize(ws_, compute_qparams(ws_, scheme)) / res.scale)
    assert awq == pytest.approx(res.loss, rel=1e-3)
    assert res.loss_no_scale == pytest.approx(rtn, rel=1e-3)
    assert res.ratio > 0 and awq < 0.8 * rtn


@pytest.mark.parametrize("seed", range(3))
def test_search_scale_never_worse_than_unscaled(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 96, generator=g)  # fewer tokens than channels: a singular Gram matrix
    ws = [torch.randn(48, 96, generator=g)]
    res = awq_search_scale(gram(x), x.abs().mean(0), ws, QuantScheme(bits=3, group_size=32), grid=5)
    assert res.loss <= res.loss_no_scale
    if res.ratio == 0.0:
        assert torch.equal(res.scale, torch.ones(96))


@pytest.mark.parametrize("k,group", [(256, 64), (200, 64), (96, None)])
def test_search_clip_reduces_error(k: int, group: int | None) -> None:
    scheme = QuantScheme(bits=3, symmetric=False, group_size=group)
    torch.manual_seed(k)  # StudentT.sample takes no generator
    x = torch.randn(2048, k)
    # Heavy-tailed weights: a few large entries waste most of a min-max grid.
    w = torch.distributions.StudentT(2.0).sample((64, k))
    clip = awq_search_clip(gram(x), w, scheme)
    assert clip.shape == (64, scheme.num_groups(k))
    assert (clip <= 1).all() and (clip > 0.5).all() and (clip < 1).any()
    plain = _out_mse(x, w, fake_quantize(w, compute_qparams(w, scheme)))
    clipped = _out_mse(x, w, fake_quantize(w, compute_qparams(w, scheme, clip=clip)))
    assert clipped < plain


def test_resolve_mappings_opt_post_ln_skips_norms() -> None:
    _, layers = find_decoder_layers(tiny_model("opt"))
    layers[0].do_layer_norm_before = False  # OPT-350m layout
    assert [p for p, _ in _names(layers[0])] == ["self_attn.v_proj", "fc1"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_apply_scale_half_precision(dtype: torch.dtype) -> None:
    _, layers = find_decoder_layers(tiny_model("llama").to(dtype))
    g = torch.Generator().manual_seed(2)
    for m in resolve_mappings(layers[0]):
        s = torch.exp(torch.randn(weight_2d(m.linears[0]).shape[1], generator=g))
        apply_scale(m.prev, m.linears, s)
        assert m.prev.weight.dtype == dtype


def test_search_scale_with_clip_measures_the_clipped_quantizer() -> None:
    # s is chosen for the quantizer that will be used: Q with awq_search_clip's ranges.
    scheme = QuantScheme(bits=4, group_size=64)
    x, ws = _outlier_data(200, 96, seed=7)
    G, x_mean = gram(x), x.abs().mean(0)

    def clipped_mse(s: torch.Tensor) -> float:
        w = torch.cat(ws)
        ws_ = w * s
        p = compute_qparams(ws_, scheme, clip=awq_search_clip(scaled_gram(G, s), ws_, scheme))
        return _out_mse(x, w, fake_quantize(ws_, p) / s)

    joint = awq_search_scale(G, x_mean, ws, scheme, clip=[True, True])
    plain = awq_search_scale(G, x_mean, ws, scheme)
    assert joint.loss == pytest.approx(clipped_mse(joint.scale), rel=1e-3)
    assert joint.loss <= clipped_mse(plain.scale) * (1 + 1e-6)
    assert joint.loss <= joint.loss_no_scale < plain.loss_no_scale  # clipping helps even unscaled


def test_apply_scale_refuses_a_prev_of_another_width() -> None:
    lin_prev, lin = nn.Linear(8, 4), nn.Linear(8, 3)  # v_proj -> o_proj under GQA
    with pytest.raises(OptcError, match="4 outputs, s has 8"):
        apply_scale(lin_prev, [lin], torch.linspace(1, 2, 8))
