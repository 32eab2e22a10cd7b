"""Unstructured and N:M pruning: magnitude, Wanda, SparseGPT, OWL; masks through later stages."""

from __future__ import annotations

import pytest
import torch

from optc.calibrate.hessian import HessianAccumulator
from optc.model.anatomy import select_linears, weight_2d
from optc.calibrate.stats import FeatureNormAccumulator
from optc.compress.gptq import gptq_quantize
from optc.compress.masks import PackedMasks, nm_mask, nm_violations, pack_mask, parse_pattern, unpack_mask
from optc.compress.owl import outlier_ratio, owl_sparsities
from optc.compress.quant import QuantScheme, quantize
from optc.compress.sparsegpt import masked_least_squares, shrink_hessian, sparsegpt_prune
from optc.compress.wanda import wanda_mask, wanda_scores
from optc.data import CalibrationConfig
from optc.errors import OptcError
from optc.methods import METHODS, Workspace
from optc.testing import TINY_ARCHS, tiny_model, tiny_tokens


def _problem(n: int = 48, k: int = 96, t: int = 1024, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(t, k, generator=g) @ torch.randn(k, k, generator=g) / k**0.5
    X[:, :3] *= 12  # a few outlier features, as in real LLM activations
    W = torch.randn(n, k, generator=g) * 0.05
    return W, X


def _hessian(X: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(X.shape[-1])
    acc.add(X)
    return acc.H


def _out_err(W: torch.Tensor, W_hat: torch.Tensor, X: torch.Tensor) -> float:
    return float(((W - W_hat) @ X.T).pow(2).sum())


def _nonzeros_per_group(w: torch.Tensor, m: int) -> torch.Tensor:
    return (w.reshape(w.shape[0], -1, m) != 0).sum(-1)


# --- N:M counts ---------------------------------------------------------------------------

SHAPES = [(8, 16), (48, 96), (5, 24), (33, 120), (64, 200)]
PATTERNS = ["2:4", "4:8", "1:4", "3:8", "2:3", "1:2", "6:8"]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_method_keeps_exactly_n_of_every_m(shape: tuple[int, int], pattern: str) -> None:
    n, m = parse_pattern(pattern)
    rows, cols = shape
    if cols % m:
        with pytest.raises(OptcError, match="divisible"):
            nm_mask(torch.rand(rows, cols), n, m)
        return
    g = torch.Generator().manual_seed(rows * cols)
    W = torch.randn(rows, cols, generator=g)
    X = torch.randn(4 * cols, cols, generator=g)
    masks = {
        "magnitude": nm_mask(W.abs(), n, m),
        "wanda": wanda_mask(W, X.pow(2).mean(0), nm=(n, m)),
    }
    res = sparsegpt_prune(W, _hessian(X), nm=(n, m), block_size=24)
    masks["sparsegpt"] = res.mask
    for method, mask in masks.items():
        assert mask.dtype == torch.bool and mask.shape == W.shape
        counts = _nonzeros_per_group(mask, m)
        assert torch.equal(counts, torch.full_like(counts, n)), method
    pruned = {"magnitude": W * masks["magnitude"], "wanda": W * masks["wanda"], "sparsegpt": res.weight}
    for method, w in pruned.items():
        # Random weights have no exact zeros, so every kept weight is a non-zero.
        assert torch.equal(_nonzeros_per_group(w, m), torch.full((rows, cols // m), n)), method
        assert nm_violations(w, n, m) == 0
    assert torch.equal(res.weight != 0, res.mask)


@pytest.mark.parametrize("shape", [(7, 13), (4, 8), (1, 1), (0, 5), (3, 4, 5)])
def test_packed_masks_round_trip_the_bit_layout(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    mask = torch.rand(shape, generator=g) < 0.5
    bits = pack_mask(mask)
    assert bits.dtype == torch.uint8 and bits.numel() == -(-mask.numel() // 8)
    # Reference unpacker from the layout: bit j of byte i is element 8 i + j, row-major.
    flat = [bool((int(bits[i // 8]) >> (i % 8)) & 1) for i in range(mask.numel())]
    assert flat == mask.reshape(-1).tolist()
    assert torch.equal(unpack_mask(bits, tuple(shape)), mask)


def test_packed_masks_mapping() -> None:
    a, b = torch.rand(6, 8) < 0.5, torch.rand(3, 5) < 0.5
    masks = PackedMasks({"a": a})
    masks["b"] = b
    assert list(masks) == ["a", "b"] and len(masks) == 2 and "a" in masks
    assert torch.equal(masks["a"], a) and torch.equal(masks.get("b"), b) and masks.get("c") is None
    assert torch.equal(masks.pop("a"), a) and list(masks) == ["b"]
    with pytest.raises(TypeError, match="bool"):
        masks["c"] = torch.ones(2, 2)
    assert isinstance(Workspace(model=tiny_model("llama"), tokenizer=None, masks={"b": b}).masks, PackedMasks)


def test_nm_violations_counts_dense_groups() -> None:
    w = torch.ones(2, 8)
    assert nm_violations(w, 2, 4) == 4
    w[:, ::2] = 0
    assert nm_violations(w, 2, 4) == 0
    with pytest.raises(OptcError, match="divisible by 3"):
        nm_violations(w, 2, 3)


@pytest.mark.parametrize("bad", ["3:2", "0:4", "2:2", "2-4", "a:b", "4"])
def test_bad_patterns_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_pattern(bad)


# --- unstructured ---------------------------------------------------------------------------


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.7])
def test_unstructured_sparsity_is_exact(sparsity: float) -> None:
    W, X = _problem()
    mask = wanda_mask(W, X.pow(2).mean(0), sparsity=sparsity)
    # Wanda compares within each output row: every row loses the same count.
    assert torch.equal((~mask).sum(1), torch.full((W.shape[0],), int(W.shape[1] * sparsity)))
    res = sparsegpt_prune(W, _hessian(X), sparsity=sparsity, block_size=32)
    # SparseGPT chooses per block of columns (all rows together): each block hits the target.
    for b in range(0, W.shape[1], 32):
        blk = res.mask[:, b : b + 32]
        assert int((~blk).sum()) == int(blk.numel() * sparsity)
    for bad in (1.0, -0.1):
        with pytest.raises(OptcError, match=r"\[0, 1\)"):
            wanda_mask(W, X.pow(2).mean(0), sparsity=bad)
        with pytest.raises(OptcError, match=r"\[0, 1\)"):
            sparsegpt_prune(W, _hessian(X), sparsity=bad)


def test_wanda_scores_follow_the_paper() -> None:
    W = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    sq = torch.tensor([4.0, 0.25])
    assert torch.equal(wanda_scores(W, sq), torch.tensor([[2.0, 1.0], [1.0, 2.0]]))
    # An outlier feature protects small weights that a magnitude criterion would drop.
    mask = wanda_mask(W, sq, sparsity=0.5)
    assert mask.tolist() == [[True, False], [False, True]]
    acc = FeatureNormAccumulator(2)
    acc.add(torch.tensor([[2.0, 1.0], [0.0, 0.0]]))
    acc.add(torch.tensor([[[2.0, 0.0]]]))
    assert torch.allclose(acc.sq_norm, torch.tensor([8 / 3, 1 / 3]))


@pytest.mark.parametrize("pattern", [None, "2:4"])
def test_sparsegpt_reconstructs_better_than_wanda_and_magnitude(pattern: str | None) -> None:
    W, X = _problem()
    nm = parse_pattern(pattern) if pattern else None
    if nm:
        mag, wan = nm_mask(W.abs(), *nm), wanda_mask(W, X.pow(2).mean(0), nm=nm)
    else:
        mag = W.abs() > W.abs().flatten().kthvalue(W.numel() // 2).values
        wan = wanda_mask(W, X.pow(2).mean(0), sparsity=0.5)
    res = sparsegpt_prune(W, _hessian(X), sparsity=0.5, nm=nm)
    e_mag, e_wan, e_sgpt = _out_err(W, W * mag, X), _out_err(W, W * wan, X), _out_err(W, res.weight, X)
    assert e_sgpt < 0.9 * e_wan and e_wan < e_mag
    assert res.loss > 0


def test_sparsegpt_on_real_layer_inputs_beats_magnitude() -> None:
    model = tiny_model("llama")
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    seen = []
    handle = layer.register_forward_hook(lambda m, inp, out: seen.append(inp[0].detach()))
    with torch.no_grad():
        model(tiny_tokens(n=16, seqlen=32))
    handle.remove()
    X = torch.cat(seen).reshape(-1, layer.in_features)
    W = layer.weight.detach()
    res = sparsegpt_prune(W, _hessian(X), nm=(2, 4))
    assert _out_err(W, res.weight, X) < _out_err(W, W * nm_mask(W.abs(), 2, 4), X)


@pytest.mark.parametrize("kwargs", [{"nm": (2, 4)}, {"sparsity": 0.5}, {"sparsity": 0.8}])
def test_masked_least_squares_is_the_exact_optimum(kwargs: dict) -> None:
    W, X = _problem()
    H = _hessian(X)
    res = sparsegpt_prune(W, H, **kwargs)
    exact = masked_least_squares(W, H, res.mask, dampening=1e-9, start=res.weight, tol=1e-7)
    assert not exact[~res.mask].any()
    for r in range(W.shape[0]):  # brute force, row by row, in float64
        S = res.mask[r].nonzero().squeeze(1)
        Hd = H.double()
        w_s = torch.linalg.solve(Hd[S][:, S], (Hd @ W[r].double())[S])
        torch.testing.assert_close(exact[r, S].double(), w_s, atol=1e-4, rtol=1e-4)
    damped = masked_least_squares(W, H, res.mask)
    assert _out_err(W, exact, X) <= _out_err(W, damped, X) < _out_err(W, res.weight, X)


def test_sparsegpt_respects_an_earlier_mask() -> None:
    W, X = _problem()
    earlier = torch.rand(W.shape, generator=torch.Generator().manual_seed(1)) > 0.3
    for kwargs in ({"nm": (2, 4)}, {"sparsity": 0.5}):
        res = sparsegpt_prune(W, _hessian(X), keep=earlier, **kwargs)
        assert not (res.mask & ~earlier).any()  # nothing regrows
        assert not res.weight[~earlier].any()
        if "nm" in kwargs:
            assert nm_violations(res.weight, 2, 4) == 0
    mask = wanda_mask(W, X.pow(2).mean(0), nm=(2, 4), keep=earlier)
    assert not (mask & ~earlier).any()


def test_sparsegpt_shares_gptq_dead_input_handling() -> None:
    W, X = _problem()
    X[:, 5] = 0  # an input that never fires
    res = sparsegpt_prune(W, _hessian(X), nm=(2, 4))
    assert torch.isfinite(res.weight).all() and not res.weight[:, 5].any()


# --- GPTQ after pruning -------------------------------------------------------------------


@pytest.mark.parametrize("groups", ["lazy", "static"])
def test_gptq_quantizes_only_kept_weights(groups: str) -> None:
    W, X = _problem()
    res_s = sparsegpt_prune(W, _hessian(X), nm=(2, 4))
    scheme = QuantScheme(bits=4, symmetric=False, group_size=32)
    q = gptq_quantize(res_s.weight, _hessian(X), scheme, mask=res_s.mask, groups=groups)
    assert not q.weight[~res_s.mask].any()  # pruned weights stay exactly zero
    assert nm_violations(q.weight, 2, 4) == 0
    codes = quantize(q.weight, q.params)
    assert torch.equal(codes[~res_s.mask].int(), q.params.zero[:, q.params.g_idx.long()][~res_s.mask])
    plain = gptq_quantize(res_s.weight, _hessian(X), scheme, groups=groups)
    assert (plain.weight[~res_s.mask] != 0).any()  # without the mask zeros would regrow
    assert _out_err(W, q.weight, X) < 1.5 * _out_err(W, res_s.weight, X)


# --- OWL ---------------------------------------------------------------------------------


def test_owl_allocation_keeps_the_mean_and_range() -> None:
    ratios = [0.01, 0.05, 0.02, 0.10]
    s = owl_sparsities(ratios, 0.5, 0.08)
    assert abs(sum(s) / len(s) - 0.5) < 1e-9
    assert max(s) - min(s) == pytest.approx(0.16)
    assert s.index(min(s)) == ratios.index(max(ratios))  # most outliers: least pruned
    assert owl_sparsities([0.03, 0.03], 0.6) == [0.6, 0.6]
    scores = [torch.tensor([1.0, 1.0, 1.0, 100.0]), torch.ones(4)]
    assert outlier_ratio(scores, 5.0) == pytest.approx(1 / 8)


# --- stages on tiny models ----------------------------------------------------------------


def _workspace(arch: str, n: int = 8) -> Workspace:
    model = tiny_model(arch)
    ws = Workspace(model, None, CalibrationConfig(samples=n, seqlen=32, batch_size=4))
    ws._ids = tiny_tokens(n=n, seqlen=32)
    return ws


def _stage(ws: Workspace, **cfg) -> dict:
    config_cls, fn = METHODS[cfg["type"]].config, METHODS[cfg["type"]].run
    return fn(ws, config_cls.model_validate(cfg))


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_nm_stage_on_every_architecture(arch: str, method: str) -> None:
    ws = _workspace(arch)
    stats = _stage(ws, type=method, pattern="2:4")
    linears = select_linears(ws.model, [".*"], ["lm_head"])
    assert set(ws.masks) == set(linears) == set(stats["modules"])
    for name, module in linears.items():
        assert nm_violations(weight_2d(module), 2, 4) == 0, name
        assert torch.equal(weight_2d(module) != 0, ws.masks[name]), name
    assert stats["nm_violations"] == 0 and stats["pattern"] == "2:4"
    assert stats["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert len(stats["layer_sparsity"]) == 2
    assert "exactly 2:4" in stats["notes"][0]


def test_sequential_mode_collects_groups_in_execution_order() -> None:
    ws = _workspace("llama")
    seen: list[list[str]] = []
    import optc.compress.sparsegpt as st

    original = st.sparsegpt_prune

    def spy(W, H, **kw):
        seen.append(kw["name"])
        return original(W, H, **kw)

    st.sparsegpt_prune = spy
    try:
        _stage(ws, type="sparsegpt", pattern="2:4", sequential=True)
    finally:
        st.sparsegpt_prune = original
    first = [n.removeprefix("model.layers.0.") for n in seen[:7]]
    assert set(first[:3]) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
    assert first[3] == "self_attn.o_proj"
    assert set(first[4:6]) == {"mlp.gate_proj", "mlp.up_proj"} and first[6] == "mlp.down_proj"


def test_sequential_mode_lowers_the_layer_error() -> None:
    ids = tiny_tokens(n=8, seqlen=32)
    errs = {}
    for seq in (False, True):
        ws = _workspace("llama")
        ref = ws.model(ids).logits.detach()
        _stage(ws, type="sparsegpt", sparsity=0.6, sequential=seq)
        errs[seq] = float((ws.model(ids).logits.detach() - ref).pow(2).mean())
    assert errs[True] < errs[False]


def test_refit_lowers_the_model_error_and_keeps_the_mask() -> None:
    ids = tiny_tokens(n=8, seqlen=32)
    errs, masks = {}, {}
    for refit in (False, True):
        ws = _workspace("llama")
        ref = ws.model(ids).logits.detach()
        _stage(ws, type="sparsegpt", pattern="2:4", refit=refit)
        errs[refit] = float((ws.model(ids).logits.detach() - ref).pow(2).mean())
        masks[refit] = ws.masks
        for name, module in select_linears(ws.model, [".*"], ["lm_head"]).items():
            assert nm_violations(weight_2d(module), 2, 4) == 0
    assert errs[True] < errs[False]
    # Same mask where the inputs are the same (later layers see the refit layers' outputs).
    first = [n for n in masks[True] if n.startswith("model.layers.0.")]
    assert first and all(torch.equal(masks[True][n], masks[False][n]) for n in first)


def test_hessian_shrinkage_interpolates_toward_the_diagonal() -> None:
    X = torch.randn(64, 12, generator=torch.Generator().manual_seed(3))
    H = 2 * X.T @ X / 64
    assert torch.equal(shrink_hessian(H, 0.0), H) and torch.equal(shrink_hessian(H, 1.0), torch.diag(torch.diag(H)))
    S = shrink_hessian(H, 0.3)
    off = ~torch.eye(12, dtype=torch.bool)
    torch.testing.assert_close(S[off], 0.7 * H[off])
    assert torch.equal(torch.diag(S), torch.diag(H)) and H.data_ptr() != S.data_ptr()
    with pytest.raises(OptcError, match="shrinkage"):
        shrink_hessian(H, 1.5)


def test_sparsegpt_stage_solves_on_the_shrunk_hessian() -> None:
    """shrinkage a: the stage prunes each Linear as the kernel does on (1 - a) H + a diag(H);
    a = 1 leaves no cross-input compensation, so each row's kept weights stay as they were."""
    ws = _workspace("llama")
    name = "model.layers.0.mlp.down_proj"
    w0 = weight_2d(select_linears(ws.model, [".*"], ["lm_head"])[name]).detach().clone()
    _stage(ws, type="sparsegpt", pattern="2:4", shrinkage=1.0, refit=True, targets=[r"down_proj"])
    w = weight_2d(select_linears(ws.model, [".*"], ["lm_head"])[name]).detach()
    keep = ws.masks[name]
    torch.testing.assert_close(w[keep], w0[keep])
    assert nm_violations(w, 2, 4) == 0
    with pytest.raises(ValueError, match="shrinkage"):
        METHODS["sparsegpt"].config.model_validate({"type": "sparsegpt", "shrinkage": 2})


def test_owl_and_overrides_set_per_layer_sparsity() -> None:
    ws = _workspace("llama")
    stats = _stage(ws, type="wanda", sparsity=0.5, allocation="owl", owl_lambda=0.1)
    targets = [layer["target_sparsity"] for layer in stats["layers"]]
    assert targets[0] != targets[1] and sum(targets) / 2 == pytest.approx(0.5)
    for layer, target in zip(sorted(stats["layer_sparsity"]), targets):
        assert stats["layer_sparsity"][layer] == pytest.approx(target, abs=0.01)
    ws = _workspace("llama")
    stats = _stage(ws, type="wanda", sparsity=0.5, overrides=[{"pattern": r"layers\.0\.", "sparsity": 0.2}])
    assert stats["layer_sparsity"]["model.layers.0"] == pytest.approx(0.2, abs=0.01)
    assert stats["layer_sparsity"]["model.layers.1"] == pytest.approx(0.5, abs=0.01)


def test_nm_pattern_excludes_layer_allocation() -> None:
    config_cls = METHODS["wanda"].config
    with pytest.raises(ValueError, match="drop allocation"):
        config_cls.model_validate({"type": "wanda", "pattern": "2:4", "allocation": "owl"})


def test_indivisible_pattern_is_refused_before_calibration() -> None:
    ws = _workspace("llama")  # in_features 96 and 200: 200 is not divisible by 3
    before = {k: v.clone() for k, v in ws.model.state_dict().items()}
    with pytest.raises(OptcError, match="down_proj: N:M pattern 2:3 needs in_features divisible by 3"):
        _stage(ws, type="sparsegpt", pattern="2:3")
    assert all(torch.equal(before[k], v) for k, v in ws.model.state_dict().items())
    assert not ws.masks


@pytest.mark.parametrize("later", [
    {"type": "gptq", "scheme": {"bits": 4, "group_size": 32}},
    {"type": "rtn", "scheme": {"bits": 4, "group_size": 32}},
    {"type": "awq", "scheme": {"bits": 4, "group_size": 32}},
    {"type": "wanda", "sparsity": 0.3},
    {"type": "sparsegpt", "pattern": "2:4"},
    {"type": "magnitude", "sparsity": 0.3},
], ids=lambda c: c["type"])
def test_masks_never_regrow_through_later_stages(later: dict) -> None:
    ws = _workspace("llama")
    _stage(ws, type="sparsegpt", pattern="2:4")
    first = {n: m.clone() for n, m in ws.masks.items()}
    _stage(ws, **later)
    for name, module in select_linears(ws.model, [".*"], ["lm_head"]).items():
        w = weight_2d(module)
        assert not w[~first[name]].any(), name
        assert nm_violations(w, 2, 4) == 0, name
        assert not (ws.masks[name] & ~first[name]).any()
