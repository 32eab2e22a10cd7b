"""Optimized rounding (SignRound): kernel invariants, the method on tiny models, refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError
from test_quantize_e2e import assert_pack_quantized_reloads, logit_error

from optc.compress import signround as sr
from optc.compress.quant import (
    QuantParams, QuantScheme, compute_qparams, dequantize, fake_quantize, group_view, quantize,
)
from optc.errors import OptcError
from optc.export.ct_pack import read_pack_quantized
from optc.export.reading import load_dequantized
from optc.methods import METHODS, Workspace
from optc.methods.signround import SignRoundStage, check_steps
from optc.model.anatomy import weight_2d
from optc.testing import tiny_model, tiny_tokens

SCHEMES = [QuantScheme(bits=3, symmetric=True, group_size=32), QuantScheme(bits=2, symmetric=False, group_size=24),
           QuantScheme(bits=4, symmetric=False, group_size=None)]


def _weight(n=12, k=80, seed=0):
    # k = 80 is not a multiple of 32 or 24: the last group is short.
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :40] = 0.0  # whole zero groups
    return w


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label())
def test_rtn_start_is_round_to_nearest(scheme):
    w = _weight()
    r = sr.init_rounding(w, scheme)
    w_hat, p = sr.finish(w, r, scheme)
    ref = compute_qparams(w, scheme)
    assert torch.allclose(p.scale, ref.scale, rtol=1e-6) and torch.equal(p.zero, ref.zero)
    assert torch.allclose(w_hat, fake_quantize(w, ref), atol=1e-7)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label())
def test_zero_offsets_reproduce_start_codes(scheme):
    """From a given grid and codes (not the nearest ones: up to one step away), V = 0 gives
    those codes back exactly, and one step of V can reach the neighbour on the nearer side."""
    w = _weight(seed=1)
    start = compute_qparams(w, scheme, clip=0.8)
    nearest = quantize(w, start).int()
    g = torch.Generator().manual_seed(2)
    codes = (nearest + torch.randint(-1, 2, nearest.shape, generator=g)).clamp(scheme.qmin, scheme.qmax)
    r = sr.init_rounding(w, scheme, start, codes)
    _, p = sr.finish(w, r, scheme)
    assert torch.equal(quantize(sr.finish(w, r, scheme)[0], p).int(), codes)
    assert torch.allclose(p.scale, start.scale, rtol=1e-5) and torch.equal(p.zero, start.zero)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label())
def test_fixed_grid_codes_finish_as_the_search_saw_them(scheme):
    """On a fixed grid the stored codes rebuild exactly the weight the steps evaluated, on the
    start's grid, and V = 0 gives the start codes back."""
    w = _weight(seed=7)
    start = compute_qparams(w, scheme, clip=0.8)
    codes = quantize(w, start).int()
    r = sr.init_rounding(w, scheme, start, codes)
    fg = sr.fixed_grid(group_view(w, scheme.group_size), r, scheme)
    w_hat, p = sr.finish_fixed(fg, sr.codes_fixed(fg, r.V, scheme), scheme, w.shape[1])
    assert torch.equal(quantize(w_hat, p).int(), codes)
    assert torch.allclose(p.scale, start.scale, rtol=1e-5) and torch.equal(p.zero, start.zero)
    V = (torch.rand(r.V.shape, generator=torch.Generator().manual_seed(8)) - 0.5)
    seen, _ = sr.dequantize_fixed(fg, V, scheme)
    w_hat, p = sr.finish_fixed(fg, sr.codes_fixed(fg, V, scheme), scheme, w.shape[1])
    assert torch.equal(w_hat, sr.as_weight(seen, w.shape[1]))
    assert not torch.equal(quantize(w_hat, p).int(), codes)
    assert torch.allclose(dequantize(quantize(w_hat, p), p), w_hat, atol=1e-7)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label())
def test_signed_steps_stay_in_bounds_and_codes_stay_on_the_grid(scheme):
    w = _weight(seed=3)
    r = sr.requires_grad_(sr.init_rounding(w, scheme, compute_qparams(w, scheme, clip=0.9),
                                           quantize(w, compute_qparams(w, scheme, clip=0.9)).int()))
    w3 = group_view(w, scheme.group_size)
    target = torch.randn(w.shape[1], 5, generator=torch.Generator().manual_seed(4))
    for t in range(40):
        out = sr.as_weight(sr.quantize_dequantize(w3, r, scheme), w.shape[1]) @ target
        (out - w @ target).pow(2).mean().backward()
        sr.sign_step_(r, 0.05 * (1 - t / 40))
    assert r.V.abs().max() <= 0.5
    assert (r.alpha >= r.lower).all() and (r.alpha <= r.upper).all()
    assert (r.beta >= r.lower).all() and (r.beta <= r.upper).all()
    w_hat, p = sr.finish(w, r, scheme)
    # Exact on the grid: quantizing the result with its own grid gives it back, so every
    # exporter stores these codes without re-rounding them.
    assert torch.allclose(dequantize(quantize(w_hat, p), p), w_hat, atol=1e-7)
    assert (p.scale > 0).all()


def test_normalized_output_error_weighs_every_token_alike():
    g = torch.Generator().manual_seed(9)
    target = torch.randn(2, 6, 16, generator=g)
    out = target + 0.01 * torch.randn(2, 6, 16, generator=g)
    big_t, big_o = target.clone(), out.clone()
    big_t[:, 0] *= 100  # a token with massive activations (an attention sink), its error as large relatively
    big_o[:, 0] = big_t[:, 0] + 100 * (out[:, 0] - target[:, 0])
    assert torch.allclose(sr.output_error(out, target), torch.nn.functional.mse_loss(out, target))
    assert sr.output_error(big_o, big_t) > 1000 * sr.output_error(out, target)
    assert torch.allclose(sr.output_error(big_o, big_t, "normalized"), sr.output_error(out, target, "normalized"),
                          rtol=1e-5)
    per_token = ((out - target).pow(2).mean(-1) / target.pow(2).mean(-1)).mean()
    assert torch.allclose(sr.output_error(out, target, "normalized"), per_token)


def test_clipped_output_error_is_the_mse_but_for_the_sinks():
    g = torch.Generator().manual_seed(9)
    target = torch.randn(2, 7, 16, generator=g)
    out = target + 0.01 * torch.randn(2, 7, 16, generator=g)
    err = (out - target).pow(2).mean(-1)
    scale = target.pow(2).mean(-1)
    median = scale.median()
    # Tokens up to the median's scale count as the MSE counts them.
    low = scale <= median
    weights = torch.where(low, torch.ones_like(scale), median / scale)
    assert torch.allclose(sr.output_error(out, target, "clipped"), (err * weights).mean())
    # A sink 1000 times larger with an error 1000 times larger (the same relative error) weighs
    # as a token at the median's scale with that relative error, not a million times more.
    big_t, big_o = target.clone(), out.clone()
    big_t[:, 0] *= 1000
    big_o[:, 0] = big_t[:, 0] + 1000 * (out[:, 0] - target[:, 0])
    big_scale = big_t.pow(2).mean(-1)
    big_err = (big_o - big_t).pow(2).mean(-1)
    m = big_scale.median()
    expected = torch.where(big_scale <= m, big_err, big_err / big_scale * m).mean()
    got = sr.output_error(big_o, big_t, "clipped")
    assert torch.allclose(got, expected)
    assert got < 10 * sr.output_error(out, target, "clipped")
    assert sr.output_error(big_o, big_t) > 1000 * sr.output_error(out, target)
    with pytest.raises(ValueError, match="unknown loss"):
        sr.output_error(out, target, "l1")


def test_the_best_iterate_beats_round_to_nearest():
    """On correlated inputs (where round-to-nearest is not the least-squares optimum; on white
    inputs it is, and every flip costs) the best iterate's error is far below the start's."""
    scheme = QuantScheme(bits=2, symmetric=False, group_size=16)
    w = _weight(8, 64, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(256, 8, generator=g) @ torch.randn(8, 64, generator=g) + 0.1 * torch.randn(256, 64, generator=g)
    r = sr.requires_grad_(sr.init_rounding(w, scheme))
    w3 = group_view(w, scheme.group_size)
    losses = []
    for t in range(100):
        loss = (x @ sr.as_weight(sr.quantize_dequantize(w3, r, scheme), 64).t() - x @ w.t()).pow(2).mean()
        losses.append(loss.item())
        loss.backward()
        sr.sign_step_(r, 0.01 * (1 - t / 100))
    assert min(losses) < 0.6 * losses[0]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label())
def test_group_scaled_weight_gradient_and_grid(scheme):
    """``W~ (1 + theta)`` per group: its values and theta's gradient are plain autograd's on the
    expanded product (short last group included), and the scaled grid holds the very same codes."""
    w = _weight()
    p = compute_qparams(w, scheme)
    w_hat = fake_quantize(w, p)
    theta = (torch.randn(p.scale.shape, generator=torch.Generator().manual_seed(1)) * 0.01).requires_grad_(True)
    g = torch.randn_like(w_hat)
    out = sr.group_scaled(w_hat, theta, scheme.group_size)
    (out * g).sum().backward()
    ours, theta.grad = theta.grad.clone(), None
    ref = sr.as_weight(group_view(w_hat, scheme.group_size) * (1 + theta)[..., None], w.shape[1])
    (ref * g).sum().backward()
    assert torch.allclose(out, ref) and torch.allclose(ours, theta.grad, atol=1e-6)
    scaled = sr.scaled_params(p, theta)
    assert torch.equal(quantize(out.detach(), scaled), quantize(w_hat, p))
    assert torch.allclose(dequantize(quantize(w_hat, p), scaled), out.detach(), atol=1e-7)


def _quantize(model, ids, **extra) -> tuple[Workspace, dict]:
    ws = Workspace(model, None)
    ws._ids = ids
    m = METHODS[extra.pop("type", "signround")]
    cfg = m.config.model_validate({"type": m.name, "scheme": {"bits": 3, "group_size": 32}, **extra})
    return ws, m.run(ws, cfg)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_signround_beats_gptq_and_its_checkpoint_reloads(arch, tmp_path):
    ids = tiny_tokens(16, 64)
    base = tiny_model(arch)
    with torch.no_grad():
        ref = base(ids).logits
    errors = {}
    for name, extra in {"rtn": {"type": "rtn"}, "gptq": {"type": "gptq"},
                        "signround": {"iters": 40, "batch": 16}}.items():
        model = copy.deepcopy(base)
        ws, stats = _quantize(model, ids, **extra)
        errors[name] = logit_error(model, ref, ids)
    assert errors["signround"] < errors["gptq"] < errors["rtn"], errors
    for layer in stats["layers"]:
        first, best = layer["signround_loss"]
        assert best <= first and layer["signround_seconds"] > 0
    if arch == "llama":
        assert_pack_quantized_reloads(model, ws.qparams, ids, tmp_path)


@pytest.mark.parametrize("arch, autocast", [("llama", "auto"), ("gpt2", "auto"), ("llama", "off")])
def test_end_to_end_scales_keep_the_codes_and_lower_the_error(arch, autocast, tmp_path):
    """The end-to-end phase trains only the group scales: the codes are the layer-wise search's,
    every weight stays on its (new) grid, the scales moved, and the logits came closer to the
    float model's; the checkpoint holds the tuned scales. ``autocast: off`` is the float32 path
    of hosts without AMX (``auto`` is bfloat16 on AMX hosts)."""
    ids = tiny_tokens(16, 64)
    base = tiny_model(arch)
    with torch.no_grad():
        ref = base(ids).logits
    runs = {}
    for steps in (0, 24):
        model = copy.deepcopy(base)
        ws, stats = _quantize(model, ids, iters=10, e2e_steps=steps, e2e_lr=5e-3, autocast=autocast)
        runs[steps] = (model, ws, stats)
    (plain, ws0, stats0), (tuned, ws1, stats1) = runs[0], runs[24]
    assert "e2e_steps" not in stats0 and stats1["e2e_steps"] == 24 and stats1["e2e_mean_scale_change"] > 0
    assert logit_error(tuned, ref, ids) < logit_error(plain, ref, ids)
    for name, p in ws1.qparams.items():
        w = weight_2d(tuned.get_submodule(name)).detach()
        assert torch.equal(fake_quantize(w, p), w), name
        assert torch.equal(quantize(w, p), quantize(weight_2d(plain.get_submodule(name)).detach(), ws0.qparams[name]))
        assert not torch.equal(p.scale, ws0.qparams[name].scale)
    assert not tuned.training
    # Only the scale factors took gradients: no weight-sized gradient is left on the model.
    assert all(q.grad is None for q in tuned.parameters())
    if arch == "llama":
        assert_pack_quantized_reloads(tuned, ws1.qparams, ids, tmp_path)


def test_rtn_start_and_float_inputs_run():
    ids = tiny_tokens(8, 32)
    base = tiny_model("llama")
    with torch.no_grad():
        ref = base(ids).logits
    rtn = copy.deepcopy(base)
    _quantize(rtn, ids, type="rtn")
    for extra in ({"start": "rtn", "observer": "minmax", "refit_scales": False}, {"start": "rtn"}, {"inputs": "float", "clip": True},
                  {"hessian_samples": 2}, {"hessian_inputs": "quantized"}, {"loss": "normalized"}):
        model = copy.deepcopy(base)
        _quantize(model, ids, iters=20, **extra)
        assert logit_error(model, ref, ids) < logit_error(rtn, ref, ids), extra


def test_compiled_training_is_one_graph_for_every_layer_and_matches_eager():
    """``compile: on`` runs the training forward and backward through torch.compile with the
    layer as an argument: one graph serves both layers (no recompilation, no graph break), and
    in float32 its steps are the eager ones (same losses). ``auto`` compiles only long bfloat16
    runs, so this short float32 one stays eager."""
    from torch._dynamo.utils import counters

    ids = tiny_tokens(8, 32)
    base = tiny_model("llama")
    losses = {}
    for mode in ("auto", "on"):
        torch._dynamo.reset()
        counters.clear()
        model = copy.deepcopy(base)
        _, stats = _quantize(model, ids, iters=10, autocast="off", compile=mode)
        losses[mode] = [layer["signround_loss"] for layer in stats["layers"]]
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == (1 if mode == "on" else 0) and not counters["graph_break"], (mode, dict(counters))
    assert len(losses["on"]) == 2
    for (first, best), (first_c, best_c) in zip(losses["auto"], losses["on"]):
        assert first_c == first and best_c == pytest.approx(best, rel=1e-3)


def test_presets_and_schedule():
    cfg = SignRoundStage.model_validate({"type": "signround", "scheme": {"bits": 4}})
    assert cfg.schedule() == (200, 1 / 200)
    light = SignRoundStage.model_validate({"type": "signround", "preset": "light", "scheme": {"bits": 4}})
    assert light.schedule() == (32, 1 / 32)
    own = SignRoundStage.model_validate({"type": "signround", "preset": "best", "iters": 10, "scheme": {"bits": 4}})
    assert own.schedule() == (10, 0.1)


@pytest.mark.parametrize("bad, field", [
    ({"iters": 0}, "iters"), ({"lr": 0.0}, "lr"), ({"lr": -1e-3}, "lr"), ({"batch": 0}, "batch"),
    ({"scheme": {"bits": 1}}, "bits"), ({"scheme": {"bits": 9}}, "bits"), ({"iter": 100}, "iter"),
    ({"scheme": {"type": "float", "bits": 4, "group_size": 16}}, "signround"), ({"hessian_samples": 0}, "hessian_samples"),
    ({"e2e_steps": -1}, "e2e_steps"), ({"e2e_lr": 0.0}, "e2e_lr"), ({"e2e_batch": 0}, "e2e_batch"),
])
def test_bad_config_is_one_line_naming_the_field(bad, field):
    with pytest.raises(ValidationError) as e:
        SignRoundStage.model_validate({"type": "signround", "scheme": {"bits": 4}, **bad})
    assert field in str(e.value)


def test_a_layer_without_gradients_is_refused_before_training(monkeypatch):
    ids = tiny_tokens(4, 16)
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    forward = mlp.forward

    def no_backward(x):
        with torch.no_grad():
            return forward(x)

    monkeypatch.setattr(mlp, "forward", no_backward)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(OptcError, match="no gradient"):
        _quantize(model, ids, iters=5)
    # Refused before the first layer was changed.
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_cli_quantize_with_signround(tiny_checkpoint, tmp_path):
    from typer.testing import CliRunner

    from optc.cli.main import app

    out = tmp_path / "q"
    result = CliRunner().invoke(app, [
        "quantize", "--model", str(tiny_checkpoint), "--method", "signround", "--bits", "3",
        "--group-size", "32", "--samples", "4", "--seqlen", "32", "--no-eval", "--output", str(out), "--json"])
    assert result.exit_code == 0, result.output
    model, qparams = load_dequantized(out, torch.float32, read_pack_quantized)
    assert qparams and all(isinstance(p, QuantParams) and p.scheme.bits == 3 for p in qparams.values())


def test_steps_draw_across_multi_sample_batches():
    """Engine batches of 4 samples, steps of 6: each step takes parts of two or three batches,
    their per-sample layer inputs (rotary tables, masks) cut and concatenated alike."""
    from optc.data import CalibrationConfig

    ids = tiny_tokens(16, 32)
    base = tiny_model("qwen2")
    with torch.no_grad():
        ref = base(ids).logits
    model = copy.deepcopy(base)
    ws = Workspace(model, None, calibration=CalibrationConfig(batch_size=4))
    ws._ids = ids
    cfg = SignRoundStage.model_validate({"type": "signround", "scheme": {"bits": 3, "group_size": 32}, "iters": 20,
                                         "batch": 6})
    METHODS["signround"].run(ws, cfg)
    rtn = copy.deepcopy(base)
    _quantize(rtn, ids, type="rtn")
    assert logit_error(model, ref, ids) < logit_error(rtn, ref, ids)


def test_picked_samples_are_batched_with_their_own_layer_inputs():
    from optc.methods.signround import _step_batches
    from optc.model.forward import Batch

    t = 5
    hidden = [torch.randn(2, t, 3), torch.randn(2, t, 3)]
    cos = [torch.randn(2, t, 4), torch.randn(2, t, 4)]
    targets = [h * 2 for h in hidden]

    def batches(positions):
        return [Batch(h, ((c, c + 1),), {"cache_position": p}) for h, c, p in zip(hidden, cos, positions)]

    same = [torch.arange(t), torch.arange(t)]
    bs = batches(same)
    args = [(b.args, b.kwargs) for b in bs]
    pick = [(0, 1), (1, 0), (1, 1)]
    (x, a, kw, y, share), = list(_step_batches(pick, bs, None, targets, args))
    assert share == 1.0 and x.shape[0] == 3
    assert torch.equal(x, torch.cat([hidden[0][1:], hidden[1]]))
    assert torch.equal(a[0][0], torch.cat([cos[0][1:], cos[1]])) and torch.equal(a[0][1], a[0][0] + 1)
    assert torch.equal(y, 2 * x) and torch.equal(kw["cache_position"], same[0])
    # Extra inputs that differ between batches and are not per sample: one batch each.
    bs = batches([torch.arange(t), torch.arange(t) + 1])
    parts = list(_step_batches(pick, bs, None, targets, [(b.args, b.kwargs) for b in bs]))
    assert [p[4] for p in parts] == [1 / 3, 2 / 3]
    assert [p[0].shape[0] for p in parts] == [1, 2] and torch.equal(parts[0][1][0][0], cos[0][1:])


@pytest.mark.parametrize("iters, steps", [(5, {5}), (10, {10}), (20, {10, 20}), (32, {11, 22, 32}),
                                          (200, set(range(20, 201, 20))), (800, set(range(80, 801, 80)))])
def test_best_iterate_checks_are_spread_to_the_last_step(iters: int, steps: set[int]) -> None:
    assert check_steps(iters) == steps


def test_kl_and_grad_matches_autograd_through_kl_to():
    from optc.compress.lora import kl_and_grad, kl_to

    g = torch.Generator().manual_seed(3)
    s = torch.randn(6, 50, generator=g, requires_grad=True)
    t = torch.randn(6, 50, generator=g)
    ref = kl_to(s.log_softmax(-1), t.log_softmax(-1), "sum")
    ref.backward()
    kl, grad = kl_and_grad(s.detach(), t)
    assert abs(kl - ref.item()) < 1e-5 * max(1.0, abs(ref.item()))
    assert torch.allclose(grad, s.grad, atol=1e-6)
