import logging

import pytest
import torch

from optc.calibrate.hessian import HessianAccumulator
from optc.compress.gptq import gptq_quantize
from optc.compress.quant import (
    QuantParams,
    QuantScheme,
    compute_qparams,
    default_g_idx,
    dequantize,
    fake_quantize,
    mse_clip_search,
    quantize,
)
from optc.errors import OptcError
from optc.testing import tiny_model, tiny_tokens


def _correlated_problem(n: int = 48, k: int = 96, t: int = 1024, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(t, k, generator=g) @ torch.randn(k, k, generator=g) / k**0.5
    X[:, :3] *= 12  # a few outlier channels, as in real LLM activations
    W = torch.randn(n, k, generator=g) * 0.05
    return W, X


def _output_err(W: torch.Tensor, W_hat: torch.Tensor, X: torch.Tensor) -> float:
    return float(((W - W_hat) @ X.T).pow(2).sum())


def _hessian(X: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(X.shape[-1])
    acc.add(X)
    return acc.H


def _llama_inputs(module_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    model = tiny_model("llama")
    layer = model.get_submodule(module_name)
    seen = []
    handle = layer.register_forward_hook(lambda m, inp, out: seen.append(inp[0].detach()))
    with torch.no_grad():
        model(tiny_tokens())
    handle.remove()
    return layer.weight.detach().clone(), torch.cat(seen).reshape(-1, layer.in_features)


@pytest.fixture(scope="module")
def llama_down_proj():
    return _llama_inputs("model.layers.0.mlp.down_proj")  # K = 200: groups of 32/64 do not divide


def _check_beats_rtn(W, X, bits, group_size, observer):
    scheme = QuantScheme(bits=bits, symmetric=False, group_size=group_size)
    H = _hessian(X)
    res = gptq_quantize(W, H, scheme, observer=observer, name="t")
    rtn = fake_quantize(W, compute_qparams(W, scheme))
    rtn_mse = fake_quantize(W, mse_clip_search(W, scheme))
    e_gptq = _output_err(W, res.weight, X)
    assert e_gptq < _output_err(W, rtn, X)
    assert e_gptq < _output_err(W, rtn_mse, X)
    assert res.weight.shape == W.shape and res.weight.dtype == W.dtype
    assert res.seconds >= 0 and res.loss > 0


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("group_size", [None, 32, 64])
@pytest.mark.parametrize("observer", ["minmax", "mse"])
def test_beats_rtn_synthetic(bits, group_size, observer):
    W, X = _correlated_problem(k=96 if group_size != 64 else 200)
    _check_beats_rtn(W, X, bits, group_size, observer)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("group_size", [None, 32, 64])
def test_beats_rtn_tiny_llama(llama_down_proj, bits, group_size):
    W, X = llama_down_proj
    _check_beats_rtn(W, X, bits, group_size, "mse")


def test_loss_is_quadratic_error():
    # With exact OBS updates the per-column errors add up to 1/2 tr(dW H_damped dW^T).
    W, X = _correlated_problem(k=200)
    H = _hessian(X)
    damp = 0.01
    res = gptq_quantize(
        W, H, QuantScheme(bits=4, group_size=64), dampening=damp, block_size=48, refit=False
    )
    Hd = H + damp * torch.diag(H).mean() * torch.eye(H.shape[0])
    dW = (res.weight - W).double()
    expected = 0.5 * float(torch.einsum("nk,kl,nl->", dW, Hd.double(), dW))
    assert res.loss == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("groups", ["lazy", "static", "permuted"])
def test_scale_refit_never_hurts(symmetric, groups):
    W, X = _correlated_problem(k=200)
    H = _hessian(X)
    scheme = QuantScheme(bits=4, group_size=64, symmetric=symmetric)
    err = {}
    for refit in (False, True):
        res = gptq_quantize(W, H, scheme, groups=groups, refit=refit)
        err[refit] = float(((W - res.weight) @ X.T).pow(2).sum())
        assert torch.allclose(dequantize(quantize(res.weight, res.params), res.params), res.weight, atol=1e-6)
    assert err[True] <= err[False] * (1 + 1e-6)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [None, 32, 64])
@pytest.mark.parametrize("actorder,groups", [(False, "lazy"), (True, "permuted"), (True, "static"), (True, "lazy")])
def test_params_requantize_exactly(llama_down_proj, symmetric, group_size, actorder, groups):
    W, X = llama_down_proj
    scheme = QuantScheme(bits=4, symmetric=symmetric, group_size=group_size)
    res = gptq_quantize(
        W, _hessian(X), scheme, actorder=actorder, groups=groups, block_size=48
    )
    p = res.params
    k = W.shape[1]
    assert p.scale.shape == p.zero.shape == (W.shape[0], scheme.num_groups(k))
    assert p.g_idx.shape == (k,) and p.g_idx.dtype == torch.int32
    assert torch.allclose(dequantize(quantize(res.weight, p), p), res.weight, rtol=0, atol=1e-6)
    raw = torch.round(res.weight / p.scale[:, p.g_idx.long()]) + p.zero[:, p.g_idx.long()]
    assert raw.min() >= scheme.qmin and raw.max() <= scheme.qmax
    if group_size is not None:
        assert torch.bincount(p.g_idx.long()).max() <= group_size
        assert p.actorder == (actorder and groups == "permuted")
    else:
        assert torch.equal(p.g_idx, default_g_idx(k, scheme))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("groups", ["lazy", "static", "permuted"])
@pytest.mark.parametrize("masked", [False, True])
def test_stacked_rows_get_their_own_solves(symmetric, groups, masked):
    """solve_gptq stacks Linears that share a Hessian (q/k/v, gate/up) into one call: GPTQ
    treats rows independently given H, so each part gets the integer codes of its own solve;
    its scales and losses may differ in the last float bits (the BLAS blocking of the stacked
    matmuls and the refit's solves depends on the row count)."""
    W, X = _correlated_problem(n=72, k=200)
    H = _hessian(X)
    scheme = QuantScheme(bits=4, group_size=64, symmetric=symmetric)
    mask = (torch.rand(W.shape, generator=torch.Generator().manual_seed(1)) > 0.5) if masked else None
    whole = gptq_quantize(W, H, scheme, groups=groups, mask=mask)
    r0 = 0
    for rows in (40, 16, 16):
        r1 = r0 + rows
        part = gptq_quantize(W[r0:r1], H, scheme, groups=groups, mask=None if mask is None else mask[r0:r1])
        p = whole.params
        mine = QuantParams(scheme, p.scale[r0:r1], p.zero[r0:r1], p.g_idx)
        assert torch.equal(quantize(part.weight, part.params), quantize(whole.weight[r0:r1], mine))
        assert torch.equal(part.params.zero, mine.zero) and torch.equal(part.params.g_idx, mine.g_idx)
        torch.testing.assert_close(part.params.scale, mine.scale, rtol=1e-5, atol=0)
        torch.testing.assert_close(part.weight, whole.weight[r0:r1], rtol=1e-5, atol=0)
        torch.testing.assert_close(part.row_loss, whole.row_loss[r0:r1], rtol=1e-5, atol=0)
        r0 = r1


def test_dead_columns():
    W, X = _correlated_problem()
    X[:, [5, 40]] = 0
    res = gptq_quantize(W, _hessian(X), QuantScheme(bits=4, group_size=32))
    assert torch.isfinite(res.weight).all()
    assert torch.all(res.weight[:, [5, 40]] == 0)


def test_non_pd_hessian_raises(caplog):
    W = torch.randn(8, 16)
    with caplog.at_level(logging.WARNING), pytest.raises(OptcError, match="layers.3.mlp.up_proj"):
        gptq_quantize(
            W, -torch.eye(16), QuantScheme(bits=4, group_size=8), name="layers.3.mlp.up_proj"
        )
    assert "not positive definite" in caplog.text


@pytest.mark.parametrize("k", [24, 500])  # 500: two whole column blocks and a partial one
def test_hessian_accumulator_incremental(k):
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 7, k, generator=g), torch.randn(5, k, generator=g),
               torch.randn(1, 3, 4, k, generator=g) * 10]
    acc = HessianAccumulator(k)
    for b in batches:
        acc.add(b)
    X = torch.cat([b.reshape(-1, k) for b in batches])
    expected = 2 / X.shape[0] * X.T @ X
    assert acc.nsamples == X.shape[0]
    assert torch.allclose(acc.H, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(acc.H, acc.H.T)

    a, b = HessianAccumulator(k), HessianAccumulator(k)
    a.add(batches[0])
    b.add(batches[1])
    b.add(batches[2])
    a.merge(b)
    assert a.nsamples == X.shape[0] and torch.allclose(a.H, expected, rtol=1e-5, atol=1e-4)

    c = HessianAccumulator(k)
    c.load_state_dict(acc.state_dict())
    assert c.nsamples == acc.nsamples and torch.allclose(c.H, acc.H)


def test_hessian_accumulator_gpt2_conv1d():
    model = tiny_model("gpt2")
    layer = model.transformer.h[0].mlp.c_fc  # Conv1D: weight [K, N], input [..., K]
    acc = HessianAccumulator(layer.weight.shape[0])
    seen = []

    def hook(m, inp, out):
        acc.add(inp[0])
        seen.append(inp[0].reshape(-1, inp[0].shape[-1]))

    handle = layer.register_forward_hook(hook)
    with torch.no_grad():
        model(tiny_tokens(n=4))
    handle.remove()
    X = torch.cat(seen)
    assert torch.allclose(acc.H, 2 / X.shape[0] * X.T @ X, rtol=1e-5, atol=1e-6)

