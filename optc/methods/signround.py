"""Optimized rounding (SignRound, Cheng et al. 2023): each decoder layer's rounding and clipping
learnt by signed gradient descent on the layer's output error, started from GPTQ's solution."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from optc.methods.base import WeightQuantConfig
from optc.methods.registry import Method, register

if TYPE_CHECKING:
    import torch

    from optc.calibrate.sequential import LayerStep
    from optc.methods.workspace import Workspace

log = logging.getLogger(__name__)

# Iterations of each preset, every one at a learning rate of 1/iters: the paper's 200; best four
# times the default's steps; light 32. From GPTQ's start on the default model (W4 g64, fixed
# protocol), 32 steps at 1/32 scored 22.31 and AutoRound's light schedule, 50 steps at 5e-3,
# 22.36: at 1/32 the decaying steps add up to half a rounding cell, as the default's schedule
# does, where 50 at 5e-3 only reach the weights within 0.13 of a boundary.
PRESETS: dict[str, int] = {"light": 32, "default": 200, "best": 800}

# Samples of one training forward and backward (a step of ``batch`` samples takes several): a
# decoder layer's saved activations and their gradients grow with the tokens of a pass, and they
# are the largest part of the method's memory above GPTQ's. On the default model 2 x 512 tokens
# held the peak of the first four layers 90 MB below 4 x 512 at the same step time and losses:
# the GEMMs are still large enough.
PASS_SAMPLES = 2

# Training steps of a run (iterations x decoder layers) from which ``compile: auto`` compiles the
# training forward. On the default model with bfloat16 on an AMX CPU one compilation (reused by
# every layer: their shapes agree) cost as much as about 70 eager steps, and made each step a fifth
# faster (8 x 512 tokens), so it pays from about 350 steps.
COMPILE_MIN_STEPS = 500

# Tokens per chunk of the end-to-end loss (over a pass's sequences): the vocabulary-wide logits
# of a whole sequence (and their softmax and gradient) would be the largest tensors of the run.
# Chunks of 32 tokens did not lower a full run's peak on the default model (1,686,736 KiB, against
# 1,630,540 to 1,671,656 over four runs with 128): their logits fall below the heap's 8 MiB
# threshold and fragment it, where 128 tokens' get pages of their own.
E2E_CHUNK = 128

# Samples of one end-to-end forward and backward (every layer's activations are recomputed in the
# backward, so a pass holds one layer's and the layer inputs). On the default model passes of two
# made a step a fifth faster and raised the peak by 220 MB; the peak is what this phase adds.
E2E_PASS = 1


class SignRoundStage(WeightQuantConfig):
    """Optimized rounding (SignRound): per decoder layer, a rounding offset per weight and clip
    factors per group, learnt by signed gradient descent on the layer's output error."""

    type: Literal["signround"]
    preset: Literal["light", "default", "best"] = Field(
        "default", description="light: 32 iterations, default: 200, best: 800; each at lr 1/iters")
    iters: int | None = Field(None, gt=0, description="signed-gradient steps per layer (default: the preset's)")
    lr: float | None = Field(None, gt=0, description="initial learning rate, decaying linearly to 0 (default: the "
                             "preset's, 1/iters)")
    batch: int = Field(8, gt=0, description="calibration sequences per step")
    start: Literal["gptq", "rtn"] = Field(
        "gptq", description="start from GPTQ's codes and grids, or round-to-nearest on the min-max range (AutoRound)")
    inputs: Literal["quantized", "float"] = Field(
        "quantized", description="the quantized layer reads the quantized model's activations (AutoRound's setting) "
        "or the float model's; the target is always the float layer on the float model's activations")
    loss: Literal["mse", "normalized", "clipped"] = Field(
        "mse", description="the layer output's mean squared error (AutoRound's); each token's squared error over "
        "its target's mean square (the error the next normalization sees); or clipped: the squared error, with "
        "the tokens whose mean square exceeds the median token's (attention sinks) weighed as normalized at the "
        "median's scale")
    observer: Literal["minmax", "mse"] = Field(
        "mse", description="the start grid: min-max, or the activation-weighted MSE search GPTQ uses (start: rtn, "
        "observer: minmax is AutoRound's start)")
    clip: bool | None = Field(
        None, description="learn the clip factors of every group's range too (default: from the rtn start only; "
        "from GPTQ's searched grid, learning them raised every layer's loss)")
    refit_scales: bool = Field(True, description="least-squares scales for the final codes (GPTQ's refit)")
    autocast: Literal["auto", "off", "bfloat16"] = Field(
        "auto", description="bfloat16 matmuls in the training loop; auto: on CPUs with AMX and on accelerators")
    compile: Literal["auto", "off", "on"] = Field(
        "auto", description="torch.compile the layer's training forward and backward (one compilation serves every "
        f"layer); auto: when training in bfloat16 and the run takes at least {COMPILE_MIN_STEPS} steps (iterations x "
        "layers)")
    e2e_steps: int = Field(
        0, ge=0, description="after the last layer, steps of end-to-end tuning of the group scales (codes fixed; "
        "distillation from the float model's next-token distribution); 0: off")
    e2e_lr: float = Field(1e-3, gt=0, description="end-to-end tuning's initial Adam learning rate (a relative "
                          "change of each scale), decaying linearly to 0")
    e2e_batch: int = Field(4, gt=0, description="calibration sequences per end-to-end step")
    seed: int = 0
    dampening: float = Field(0.01, gt=0, description="GPTQ start: fraction of mean diag(H) added to H")
    hessian_inputs: Literal["float", "quantized"] = Field(
        "float", description="the activations the GPTQ start's and the scale refit's Hessians are taken from: the "
        "float model's, in the forward that computes the float targets, or the quantized model's (a forward more "
        "per layer)")
    hessian_samples: int | None = Field(
        None, gt=0, description="calibration sequences whose inputs form the Hessians of the GPTQ start and the "
        "scale refit (default: all)")

    @model_validator(mode="after")
    def _integer_grids(self) -> SignRoundStage:
        for where, scheme, _ in self.planned_schemes():
            if scheme is not None and scheme.type == "float":
                raise ValueError(f"signround learns integer grids; {where} is {scheme.label()} (use rtn or gptq "
                                 "for floating-point grids)")
            if scheme is not None and scheme.kquant_kind is not None:
                raise ValueError(f"signround learns free group scales; {where} is {scheme.label()}, whose scales "
                                 "are codes of one float16 per 256 weights (use gptq, awq or rtn for k-quant grids)")
        return self

    def learns_clip(self) -> bool:
        return self.start == "rtn" if self.clip is None else self.clip

    def schedule(self) -> tuple[int, float]:
        """Iterations per layer and initial learning rate."""
        iters = self.iters or PRESETS[self.preset]
        return iters, self.lr or 1.0 / iters


def check_steps(iters: int) -> set[int]:
    """The steps after which the best iterate is checked: about every max(10, iters/10) steps,
    spread evenly so that the last is the last step (32 steps: 11, 22 and 32, where checks every
    10 steps and at the end, 10, 20, 30 and 32, spend one forward more on a step two apart)."""
    spans = max(1, iters // max(10, iters // 10))
    return {math.ceil(iters * k / spans) for k in range(1, spans + 1)}


def _layer_forward(layer, params: dict, args: tuple, kwargs: dict):
    """The decoder layer's forward with ``params`` (name -> tensor) in place of its own."""
    from torch.func import functional_call

    return functional_call(layer, params, args, kwargs)


@functools.cache
def _compiled_forward():
    """:func:`_layer_forward` through ``torch.compile``: the layer's elementwise work (norms,
    rotary embeddings, activations, dtype casts) fused around the matmuls, forward and backward.
    The layer is an argument, so layers of one architecture share the compiled graphs."""
    import torch

    return torch.compile(_layer_forward)


def _plain(obj, copies: dict | None = None):
    """Tensors of ``obj`` (nested tuples, lists, dicts) as normal tensors: the calibration inputs
    were made under inference mode, which autograd cannot save for backward. ``copies`` (by id)
    makes a tensor the batches share (a rotary table) one copy, not one per batch."""
    import torch

    copies = {} if copies is None else copies
    if isinstance(obj, torch.Tensor):
        if not obj.is_inference():
            return obj
        if id(obj) not in copies:
            copies[id(obj)] = (obj, obj.clone())  # the original kept: its id stays unique
        return copies[id(obj)][1]
    if isinstance(obj, tuple):
        return tuple(_plain(o, copies) for o in obj)
    if isinstance(obj, list):
        return [_plain(o, copies) for o in obj]
    if isinstance(obj, dict):
        return {k: _plain(v, copies) for k, v in obj.items()}
    return obj


def check_trainable(step: LayerStep, names: list[str]) -> None:
    """Refuse, before this layer is trained, one whose output carries no gradient to one of its
    quantized weights (a custom kernel without a backward): one sample's forward and backward."""
    import torch

    from optc.errors import OptcError
    from optc.methods.common import frozen_parameters

    b = step.batches[0]
    weights = {n: step.linears[n].weight for n in names}
    probed = {id(w) for w in weights.values()}
    # Only the probed weights take a gradient: the layer's others (its norms) would keep one.
    with torch.enable_grad(), frozen_parameters(q for q in step.layer.parameters() if id(q) not in probed):
        for w in weights.values():
            w.requires_grad_(True)
            w.grad = None
        try:
            a, kw = _take(_plain((b.args, b.kwargs)), [0], b.hidden.shape[0])
            out = step.layer(_plain(b.hidden[:1]), *a, **kw)
            out = out[0] if isinstance(out, tuple) else out
            if out.requires_grad:
                out.float().sum().backward()
            dead = [n for n, w in weights.items() if w.grad is None]
        finally:
            for w in weights.values():
                w.requires_grad_(False)
                w.grad = None
    if dead:
        raise OptcError(f"signround: the output of {step.name} carries no gradient to {dead[0]} (a kernel "
                        "without a backward?); use gptq or awq for this model")


class _Differs(Exception):
    """Two batches' extra layer inputs differ where they cannot be concatenated."""


def _cat_samples(parts: list, rows: list[int]):
    """One structure from several batches' (args or kwargs): tensors with a row per sample
    (first dimension ``rows[i]``) concatenated, others (masks broadcast over the batch, cache
    positions) kept when all batches agree."""
    import torch

    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() and all(p.shape[0] == n for p, n in zip(parts, rows)):
            return torch.cat(parts)
        if all(p is first or (p.shape == first.shape and torch.equal(p, first)) for p in parts[1:]):
            return first
        raise _Differs
    if isinstance(first, (tuple, list)):
        if any(len(p) != len(first) for p in parts):
            raise _Differs
        return type(first)(_cat_samples([p[i] for p in parts], rows) for i in range(len(first)))
    if isinstance(first, dict):
        if any(p.keys() != first.keys() for p in parts):
            raise _Differs
        return {k: _cat_samples([p[k] for p in parts], rows) for k in first}
    if any(p is not first and p != first for p in parts[1:]):
        raise _Differs
    return first


def _take(obj, rows: list[int], n: int):
    """``obj``'s tensors with a row per sample (first dimension ``n``) cut to ``rows``."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj[rows] if obj.dim() and obj.shape[0] == n and len(rows) != n else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_take(o, rows, n) for o in obj)
    if isinstance(obj, dict):
        return {k: _take(v, rows, n) for k, v in obj.items()}
    return obj


def _step_batches(pick, batches, inputs, targets, args):
    """The picked samples ((batch, row) pairs) as one batch: (x, args, kwargs, target, share of
    the step's loss); when the batches' extra inputs cannot be concatenated, one per batch."""
    import torch

    by_batch: dict[int, list[int]] = {}
    for i, r in pick:
        by_batch.setdefault(i, []).append(r)
    parts = []
    for i, rows in by_batch.items():
        n = batches[i].hidden.shape[0]
        x = inputs[i] if inputs is not None else batches[i].hidden
        a, kw = _take(args[i], rows, n)
        parts.append((_take(x, rows, n), a, kw, _take(targets[i], rows, n)))
    if len(parts) > 1:
        try:
            a, kw = _cat_samples([(p[1], p[2]) for p in parts], [p[0].shape[0] for p in parts])
            parts = [(torch.cat([p[0] for p in parts]), a, kw, torch.cat([p[3] for p in parts]))]
        except _Differs:
            pass
    total = sum(p[0].shape[0] for p in parts)
    for x, a, kw, y in parts:
        # A clone: a batch of the engine's is an inference tensor, which autograd cannot save.
        yield (x.clone() if x.is_inference() else x), a, kw, y, x.shape[0] / total


def _final_norm(decoder):
    """The normalization after the last decoder layer: the decoder's one direct child that is a
    norm (Llama's ``norm``, GPT-2's ``ln_f``), or None."""
    found = [m for _, m in decoder.named_children() if type(m).__name__.endswith(("Norm", "LayerNorm"))]
    return found[0] if len(found) == 1 else None


def _group_scales(theta, group_size: int | None, transposed: bool):
    """A parametrization of a quantized Linear's weight: each group's scale times ``1 + theta``."""
    import torch

    from optc.compress import signround as sr

    class GroupScales(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.theta = theta

        def forward(self, w):
            if transposed:  # a Conv1D stores [K, N]
                return sr.group_scaled(w.t(), self.theta, group_size).t()
            return sr.group_scaled(w, self.theta, group_size)

    return GroupScales()


def tune_scales(ws: Workspace, cfg: SignRoundStage, names: list[str], float_out: list[torch.Tensor],
                dtype: torch.dtype | None) -> dict:
    """End-to-end tuning of the group scales (EfficientQAT's E2E-QP, Chen et al. 2024, Sec. 3.3)
    after the layer-wise search: the codes fixed, each group's scale trained by Adam on the KL
    divergence from the float model's next-token distribution to the quantized model's, over
    the calibration sequences. ``float_out`` holds the float model's last decoder layer outputs
    (the layer-wise search's float stream), so the teacher costs the head alone.

    Layer-wise, each layer matches its own float output; here the scales also answer for the
    errors the other layers leave."""
    import torch
    from torch.nn.utils import parametrize
    from transformers.pytorch_utils import Conv1D

    from optc.compress import signround as sr
    from optc.compress.lora import kl_and_grad
    from optc.compress.quant import dequantize, quantize
    from optc.memory import trim
    from optc.methods.common import activation_checkpointing, frozen_parameters
    from optc.model.anatomy import set_weight_2d, weight_2d

    model = ws.model
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    norm = _final_norm(decoder) if decoder is not None else None
    ids = ws.calibration_ids().to(ws.device)
    teacher = torch.cat(float_out) if float_out else None
    float_out.clear()
    if None in (decoder, head, norm) or teacher is None or teacher.shape[0] != ids.shape[0]:
        log.warning("signround: no end-to-end tuning (the model's head after its decoder layers, or the float "
                    "model's outputs, are not at hand)")
        return {}
    with torch.no_grad():
        x = ids[:1, :16]
        tail = head(decoder(input_ids=x, use_cache=False).last_hidden_state)
        if not torch.allclose(tail.float(), model(input_ids=x, use_cache=False).logits.float(), atol=1e-3, rtol=1e-3):
            log.warning("signround: no end-to-end tuning (the logits are not the head of the last hidden state)")
            return {}
    t0 = time.perf_counter()
    thetas, modules = {}, {}
    for n in names:
        p = ws.qparams[n]
        thetas[n] = torch.nn.Parameter(torch.zeros(p.scale.shape, dtype=torch.float32, device=p.scale.device))
        modules[n] = model.get_submodule(n)
        # unsafe: the parametrization keeps the weight's shape and dtype, and the check it skips
        # computes it once per Linear, temporaries left in the heap's fragments (200 MB on the
        # default model, at the start of the phase, the peak of a whole run).
        parametrize.register_parametrization(
            modules[n], "weight", _group_scales(thetas[n], p.scheme.group_size, isinstance(modules[n], Conv1D)),
            unsafe=True)
    opt = torch.optim.Adam(list(thetas.values()), lr=cfg.e2e_lr)
    # Only the scale factors learn: the model's own parameters (the embedding and the tied head,
    # the norms, every Linear's fixed weight) would otherwise each take a gradient the size of
    # the weights, kept between steps since no optimizer clears them, and the head's the most
    # expensive weight gradient of the backward.
    learnt = {id(th) for th in thetas.values()}  # the parametrizations made them the model's too
    gen = torch.Generator().manual_seed(cfg.seed)
    samples, steps, batch = ids.shape[0], cfg.e2e_steps, min(cfg.e2e_batch, ids.shape[0])
    amp = torch.autocast(ids.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    model.train()
    losses: list[float] = []
    try:
        # The layers' activations for the backward are recomputed from each layer's input: a forward
        # more, and a whole model's activations (and its weights' low-precision copies) not held.
        with frozen_parameters(q for q in model.parameters() if id(q) not in learnt), activation_checkpointing(model):
            for t in range(steps):
                for group in opt.param_groups:
                    group["lr"] = cfg.e2e_lr * (1 - t / steps)
                total = 0.0
                pick = torch.randperm(samples, generator=gen)[:batch]
                for c0 in range(0, batch, E2E_PASS):
                    j = pick[c0 : c0 + E2E_PASS]
                    with torch.enable_grad():
                        with amp:
                            h = decoder(input_ids=ids[j], use_cache=False).last_hidden_state
                        hd = h.detach().requires_grad_(True)
                        rows, t_rows = hd.flatten(0, 1), teacher[j].flatten(0, 1)
                        for c in range(0, rows.shape[0], E2E_CHUNK):
                            with amp:
                                s_logits = head(rows[c : c + E2E_CHUNK])
                                with torch.no_grad():
                                    t_logits = head(norm(t_rows[c : c + E2E_CHUNK].to(h.dtype)))
                            kl, grad = kl_and_grad(s_logits, t_logits)
                            del t_logits
                            s_logits.backward(grad.div_(h.shape[1] * batch).to(s_logits.dtype))
                            total += kl / (h.shape[1] * batch)
                        h.backward(hd.grad)
                        # A pass's few-MB temporaries (weights, their gradients) stay in the heap's
                        # fragments otherwise: 300 MB more stayed resident between passes on the default model.
                        trim()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(total)
                log.debug("signround end-to-end step %d: KL %.5g", t, total)
    finally:
        model.eval()
        with torch.no_grad():
            for n, m in modules.items():
                # Removing with the parametrized value left in place kept a second copy of every
                # weight resident (400 MB on the default model): the original codes are taken instead.
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
                start = ws.qparams[n]
                p = ws.qparams[n] = sr.scaled_params(start, thetas[n])
                # The codes times the new scales, bit for bit as every reader computes them.
                w = weight_2d(m).detach()
                set_weight_2d(m, dequantize(quantize(w, start), p, w.dtype))
                m.weight.requires_grad_(False)
    seconds = time.perf_counter() - t0
    moved = float(torch.cat([th.detach().abs().flatten() for th in thetas.values()]).mean())
    log.info("signround: end-to-end scale tuning, %d steps in %.1f s: KL %.4g -> %.4g (per token, training "
             "batches), mean |scale change| %.2e", steps, seconds, losses[0], losses[-1], moved)
    return {"e2e_steps": steps, "e2e_seconds": round(seconds, 2),
            "e2e_kl": [round(losses[0], 6), round(losses[-1], 6)],
            "e2e_mean_scale_change": round(moved, 6)}


def run_signround(ws: Workspace, cfg: SignRoundStage) -> dict:
    import torch
    from transformers.pytorch_utils import Conv1D

    from optc.calibrate.hessian import HessianAccumulator
    from optc.compress import signround as sr
    from optc.compress.gptq import refit_scales
    from optc.compress.quant import choose_qparams, group_view, quantize
    from optc.errors import OptcError
    from optc.memory import limit_fragmentation
    from optc.methods.common import frozen_parameters, record_quantized, run_calibration, training_dtype
    from optc.methods.gptq import solve_gptq
    from optc.model.anatomy import find_decoder_layers, weight_2d

    # Each step allocates and frees the same large activations and gradients; from glibc's heap
    # they fragment it, and resident memory grew layer by layer (2.2 GiB peak on the default model).
    # From 8 MiB they get their own pages: with passes of four samples of 512 tokens (the MLP's
    # activations and gradients above it) the peak over the first four layers of the default model
    # fell by 39 MB at the same step time; a 4 MiB threshold put the hidden-size tensors there too,
    # and their page faults made every step a quarter slower. With passes of two the step's tensors
    # stay below it, and a full run's per-layer peaks stayed as far below the four-sample run's from
    # the first layer to the last (no fragmentation building up).
    limit_fragmentation(8 << 20)
    iters, lr = cfg.schedule()
    dtype = training_dtype(cfg.autocast, ws.device)
    steps = iters * len(find_decoder_layers(ws.model)[1])
    compiled = [cfg.compile == "on" or (cfg.compile == "auto" and dtype is not None and steps >= COMPILE_MIN_STEPS)]
    log.info("signround: %d steps per layer in %s, training forward %s", iters, dtype or torch.float32,
             "compiled" if compiled[0] else "eager")
    per_module: dict[str, dict] = {}
    # The float model's inputs of the current layer, stored in bfloat16 (the layer runs in its own
    # dtype on them): a second copy of the calibration activations, at half the memory of float32,
    # and bfloat16's rounding of the targets is far below the quantization error they measure.
    float_hidden: list[torch.Tensor] = []
    expected = [-1]  # the layer whose float inputs float_hidden holds
    solved = [0]  # layers solved by this run: all of them, and float_hidden is the float model's own stream

    def solve(step: LayerStep) -> dict:
        t0 = time.perf_counter()
        names = [n for n in step.linears if cfg.scheme_for(n) is not None]
        if step.index != expected[0]:
            # The first layer, where both models agree; or one after a layer nothing was quantized
            # in (solvers only see layers with targets): its quantized inputs stand in for the float ones.
            if float_hidden:
                log.warning("signround: %s follows a skipped layer; its targets are the float layer on the "
                            "quantized model's inputs", step.name)
            float_hidden[:] = [b.hidden.to(torch.bfloat16, copy=True) for b in step.batches]
        expected[0] = step.index + 1
        solved[0] += 1
        check_trainable(step, names)
        # The float layer's outputs: the targets, and the next layer's float inputs.
        inputs = [h.clone() for h in float_hidden] if cfg.inputs == "float" else None
        need_h = cfg.start == "gptq" or cfg.refit_scales or cfg.observer == "mse"
        hessians: dict = {}

        def make_h(_n: str, m: torch.nn.Module) -> HessianAccumulator:
            # The start's statistics in the training's dtype too: float32 products of down_proj's
            # 1536-wide inputs cost as much as the collecting forward itself.
            return HessianAccumulator(weight_2d(m).shape[1], matmul_dtype=dtype or ws.calibration.autocast_dtype(),
                                      fold=step.fold)

        if need_h and cfg.hessian_inputs == "float":
            hessians = step.collect(names, make_h, samples=cfg.hessian_samples, stream=float_hidden)
        else:
            step.advance_other(float_hidden)
            if need_h:
                hessians = step.collect(names, make_h, samples=cfg.hessian_samples)
        targets = list(float_hidden)
        # The module's own float32 weight where it is one (no copy): nothing writes into it before
        # record_quantized, after this Linear's last use.
        weights = {n: weight_2d(step.linears[n]).detach().float() for n in names}
        H = {n: hessians[n].H for n in names} if need_h else {}
        states: dict[str, sr.Rounding] = {}
        if cfg.start == "gptq":
            for name, res in solve_gptq(step, names, dict(hessians), cfg.scheme_for, ws.masks,
                                        dampening=cfg.dampening, actorder=True, groups="lazy",
                                        observer=cfg.observer, refit=True):
                states[name] = sr.init_rounding(weights[name], cfg.scheme_for(name), res.params,
                                                quantize(res.weight, res.params))
        elif cfg.observer == "mse":
            for name in names:
                p = choose_qparams(weights[name], cfg.scheme_for(name), "mse", importance=H[name].diagonal())
                states[name] = sr.init_rounding(weights[name], cfg.scheme_for(name), p, quantize(weights[name], p))
        else:
            for name in names:
                states[name] = sr.init_rounding(weights[name], cfg.scheme_for(name))
        del hessians
        for st in states.values():
            sr.requires_grad_(st, cfg.learns_clip())
        w3 = {n: group_view(weights[n], cfg.scheme_for(n).group_size) for n in names}
        masks = {n: group_view(ws.masks[n].float(), cfg.scheme_for(n).group_size) for n in names if n in ws.masks}

        rel = {n: n[len(step.name) + 1:] + ".weight" for n in names}
        conv = {n for n in names if isinstance(step.linears[n], Conv1D)}
        # The layer's own parameters take no gradient while it trains (released after the loop).
        frozen = contextlib.ExitStack()
        frozen.enter_context(frozen_parameters(step.layer.parameters()))
        shared: dict = {}
        args = [_plain((b.args, b.kwargs), shared) for b in step.batches]
        del shared
        sizes = [b.hidden.shape[0] for b in step.batches]
        samples = sum(sizes)
        per_step = min(samples, cfg.batch)
        # Sample -> (batch, row): each step draws cfg.batch samples and runs them as one batch
        # (one [batch x seqlen, hidden] matmul per Linear: fewer, larger GEMMs than the engine's
        # batches give, and one backward).
        where = [(i, r) for i, n in enumerate(sizes) for r in range(n)]
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step.index)
        device_type = step.batches[0].hidden.device.type
        layer_dtype = weight_2d(step.linears[names[0]]).dtype  # the float stream may be in bfloat16
        amp = torch.autocast(device_type, dtype=dtype) if dtype is not None else None

        # Frozen clip factors (GPTQ's start): the grid is fixed, so each step rounds without an
        # autograd graph and takes V's gradient by the straight-through rule directly; the graph
        # through the rounding cost a fifth of every step.
        grids = None if cfg.learns_clip() else {n: sr.fixed_grid(w3[n], states[n], cfg.scheme_for(n)) for n in names}
        if grids is not None:
            # The grid holds the start offsets now: freed, a float32 copy of the layer's weights less.
            for st in states.values():
                st.offset = None

        def snapshot() -> dict:
            """The state to finish from: on a fixed grid its codes (uint8, a quarter of V)."""
            if grids is None:
                return {n: st.snapshot() for n, st in states.items()}
            return {n: sr.codes_fixed(grids[n], states[n].V, cfg.scheme_for(n)) for n in names}

        def quantized() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
            """Every weight's ``W~`` ([N, G, g]) and, on a fixed grid, where V has a gradient."""
            w_hat, support = {}, {}
            for n in names:
                if grids is None:
                    w = sr.quantize_dequantize(w3[n], states[n], cfg.scheme_for(n))
                else:
                    w, inside = sr.dequantize_fixed(grids[n], states[n].V, cfg.scheme_for(n))
                    support[n] = inside * masks[n] if n in masks else inside
                w_hat[n] = w * masks[n] if n in masks else w
            return w_hat, support

        def overrides_of(w2d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            """The layer's parameters to replace by ``[N, K]`` weights (a Conv1D stores ``[K, N]``)."""
            return {rel[n]: (w.t() if n in conv else w) for n, w in w2d.items()}

        def forward(backward: bool, overrides: dict, a: tuple, kw: dict):
            # The checks' forwards stay eager: without a backward, compiling them would not pay.
            if not (backward and compiled[0]):
                return _layer_forward(step.layer, overrides, a, kw)
            from torch._dynamo.exc import BackendCompilerFailed

            try:
                return _compiled_forward()(step.layer, overrides, a, kw)
            except BackendCompilerFailed as e:
                if cfg.compile == "on":
                    raise OptcError(f"signround: torch.compile failed: {str(e).splitlines()[0]}") from e
                log.warning("signround: torch.compile failed (%s); training in eager mode", str(e).splitlines()[0])
                compiled[0] = False
                return _layer_forward(step.layer, overrides, a, kw)

        def loss_on(pick, overrides, backward: bool) -> float:
            total = 0.0
            # At most PASS_SAMPLES samples per forward: the activations a backward keeps grow with
            # the tokens of one pass, and gradients accumulate across passes. The checks (no
            # backward) run in passes of two as well: passes of eight took 40% longer on an AMX CPU.
            for c in range(0, len(pick), PASS_SAMPLES):
                chunk = pick[c : c + PASS_SAMPLES]
                for x, a, kw, target, share in _step_batches(chunk, step.batches, inputs, targets, args):
                    with amp if amp is not None else contextlib.nullcontext():
                        out = forward(backward, overrides, (x.to(layer_dtype), *a), kw)
                    out = out[0] if isinstance(out, tuple) else out
                    loss = sr.output_error(out, target, cfg.loss) * (share * len(chunk) / len(pick))
                    if backward:
                        loss.backward()
                    total += loss.detach().item()
            return total

        # The best iterate is chosen on fixed samples, every few steps: each step's own loss is on
        # other samples, whose spread (about 10% on the default model) exceeds what a step gains.
        fixed = [where[j] for j in torch.linspace(0, samples - 1, min(samples, 2 * cfg.batch)).round().long().unique()]
        checks = check_steps(iters)

        def check(t: int) -> None:
            nonlocal best, best_state
            with torch.no_grad():
                w_hat, _ = quantized()
                overrides = overrides_of({n: sr.as_weight(w_hat[n], weights[n].shape[1]) for n in names})
                value = loss_on(fixed, overrides, backward=False)
            log.debug("signround %s step %d: loss on the fixed samples %.5g", step.name, t, value)
            if value < best:
                best, best_state = value, None  # the old snapshot freed before the new one is taken
                best_state = snapshot()

        best, best_state = math.inf, None
        t_train = time.perf_counter()
        try:
            check(0)
            first = best
            for t in range(iters):
                w_hat, support = quantized()
                leaves = {n: sr.as_weight(w_hat[n], weights[n].shape[1]).detach().requires_grad_(True) for n in names}
                overrides = overrides_of(leaves)
                pick = [where[j] for j in torch.randperm(samples, generator=gen)[:per_step].tolist()]
                with torch.enable_grad():
                    loss_on(pick, overrides, backward=True)
                grads = [leaves[n].grad.reshape(weights[n].shape[0], -1) for n in names]
                padded = [torch.nn.functional.pad(g, (0, w_hat[n].shape[1] * w_hat[n].shape[2] - g.shape[1]))
                          .view_as(w_hat[n]) for n, g in zip(names, grads)]
                if grids is None:
                    torch.autograd.backward([w_hat[n] for n in names], padded)
                else:
                    for n, g in zip(names, padded):
                        sr.set_v_grad_(states[n], grids[n], g, support[n])
                step_lr = lr * (1 - t / iters)
                for st in states.values():
                    sr.sign_step_(st, step_lr, cfg.learns_clip())
                if t + 1 in checks:
                    check(t + 1)
        finally:
            frozen.close()
        train_seconds = time.perf_counter() - t_train
        if grids is None:
            for n, st in states.items():
                st.restore(best_state[n])
        for name in names:
            scheme = cfg.scheme_for(name)
            if grids is None:
                w_hat, p = sr.finish(weights[name], states[name], scheme)
            else:
                w_hat, p = sr.finish_fixed(grids[name], best_state[name], scheme, weights[name].shape[1])
            if name in ws.masks:
                w_hat = w_hat * ws.masks[name].float()
            if cfg.refit_scales:
                w_hat, p = refit_scales(weights[name], H[name], w_hat, p)
            module = step.linears[name]
            per_module[name] = record_quantized(ws, name, module, w_hat.to(weight_2d(module).dtype), p)
        del targets
        seconds = time.perf_counter() - t0
        log.info("signround %s: loss %.4g -> %.4g (fixed samples) in %.1f s (%.1f s of %d steps)", step.name, first,
                 best, seconds, train_seconds, iters)
        return {"signround_loss": [round(first, 8), round(best, 8)], "signround_seconds": round(seconds, 2),
                "signround_train_seconds": round(train_seconds, 2)}

    # The layer forwards (targets, GPTQ's statistics, the next layer's inputs) in the training's
    # dtype too: in float32 they were a third of a layer's time on an AMX CPU.
    layers = run_calibration(ws, cfg, solve, "signround", records=per_module, autocast=dtype)
    out = {"modules": per_module, "layers": layers}
    if cfg.e2e_steps and per_module:
        if ws.store is not None and ws.store.streaming:
            log.warning("signround: no end-to-end tuning when streaming (the model is never whole in memory)")
        elif solved[0] != len(find_decoder_layers(ws.model)[1]):
            log.warning("signround: no end-to-end tuning (the float model's outputs after the last layer are not "
                        "at hand: a resumed or partial run)")
        else:
            out.update(tune_scales(ws, cfg, list(per_module), float_hidden, dtype))
    return out


METHOD = register(Method(
    name="signround", config=SignRoundStage, run=run_signround, kind="quantize", streams=True,
    accumulators=("hessian",),
))
