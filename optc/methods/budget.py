"""Compress to a budget: the scheme of every Linear a quantizing stage touches, chosen among the
budget's candidates to meet a bits-per-weight or size target with the least estimated error.

Any method of kind ``quantize`` takes a ``budget``: before the method runs, one float pass over the
first calibration sequences collects each Linear's input second moment ``H``; every candidate's
round-to-nearest error ``tr(dW H dW^T)`` on the grid the method's observer picks (weighted per
output by the loss's squared gradient there) and its exact stored size in the export format feed the
knapsack of :func:`optc.compress.allocate.allocate`; the method then runs with one exact-name
override per Linear, so GPTQ, AWQ and the others solve each Linear on the scheme it was given.

Imports torch (the pipeline imports it when a stage has a budget).
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter
from dataclasses import dataclass

import torch

from optc.calibrate.fisher import output_fisher
from optc.calibrate.hessian import HessianAccumulator
from optc.calibrate.sequential import LayerStep, run_sequential
from optc.compress.allocate import allocate, output_error
from optc.compress.quant import choose_qparams, fake_quantize
from optc.errors import OptcError
from optc.export.formats import FORMATS
from optc.export.registry import Format
from optc.methods.base import Override, WeightQuantConfig, scheme_label
from optc.methods.common import training_dtype
from optc.methods.workspace import Workspace
from optc.model.anatomy import select_linears, weight_2d
from optc.model.patterns import fused_groups

log = logging.getLogger(__name__)

# Rows of a weight whose candidate errors are measured (every stride-th; see candidate_errors).
ROWS = 128
# Step of the estimate's mse range search, 1/GRID of the range: a fifth of the methods' resolution
# tries a third fewer shrinks, and ranking candidates does not need the last percent of range.
GRID = 20


@dataclass(frozen=True)
class BudgetPlan:
    """What the target leaves for the Linears the allocation chooses for (resolved on the loaded
    model, before any calibration)."""

    free: list[str]  # Linears whose scheme the allocation chooses
    sizes: list[list[int | None]]  # bits of each candidate, per free Linear (None: the format cannot store it so)
    spare_bits: int  # bits the target leaves for the free Linears
    fixed_bits: int  # bits of everything else the target counts
    weights: int  # decoder-Linear weights the average runs over (bits-per-weight targets)
    # Sets of free Linears (indices into free) that get one scheme together: with the budget's
    # fused, the shards vLLM fuses into one module; else each Linear alone.
    groups: list[list[int]]


def _format_bits(fmt: Format, stage: str):
    if fmt.stored_bits is None:
        able = ", ".join(name for name, f in FORMATS.items() if f.stored_bits is not None)
        why = "it holds one scheme per checkpoint" if fmt.one_scheme else "it has no per-Linear size for a mix of schemes"
        raise OptcError(f"{stage}: a budget needs an export format that stores each Linear on its own scheme; "
                        f"{fmt.name} cannot ({why}): use {able}")
    return fmt.stored_bits


def plan_budget(model: torch.nn.Module, cfg: WeightQuantConfig, fmt: Format, float_bits: int,
                earlier: dict, stage: str = "budget") -> BudgetPlan:
    """Check ``cfg.budget`` against the model and ``fmt`` (one line naming the problem) and resolve
    what it leaves to allocate. ``earlier``: Linear name -> QuantParams of earlier stages (their
    schemes stay); ``float_bits``: the stored dtype's bits for tensors kept in float."""
    budget = cfg.budget
    assert budget is not None
    stored = _format_bits(fmt, stage)
    permuted = cfg.permuted_groups()
    chosen = select_linears(model, cfg.targets, cfg.ignore)
    decoder = select_linears(model, [".*"], [])
    fixed = {n: cfg.scheme_for(n) for n in chosen if any(re.search(o.pattern, n) for o in cfg.overrides)}
    free = [n for n in chosen if n not in fixed]
    if not free:
        raise OptcError(f"{stage}: every Linear the stage quantizes has an explicit override: the budget has nothing to choose")

    def bits_of(name: str, module: torch.nn.Module, scheme) -> int:
        n, k = weight_2d(module).shape
        return stored(scheme, n, k, float_bits, permuted and scheme is not None)

    def kept(name: str, module: torch.nn.Module) -> int:
        if name in fixed:
            return bits_of(name, module, fixed[name])
        scheme = earlier[name].scheme if name in earlier else None
        return bits_of(name, module, scheme)

    sizes = [[bits_of(n, chosen[n], c) for c in budget.candidates] for n in free]
    for n, row in zip(free, sizes):
        if all(b is None for b in row):
            raise OptcError(f"{stage}: {fmt.name} stores {n} ({weight_2d(chosen[n]).shape[1]} input columns) on none of "
                            f"the candidates ({', '.join(scheme_label(c) for c in budget.candidates)})")
    weights = sum(weight_2d(m).numel() for m in decoder.values())
    if budget.bits_per_weight is not None:
        target = math.floor(budget.bits_per_weight * weights)
        fixed_bits = sum(kept(n, m) for n, m in decoder.items() if n not in free)
        unit = f"{budget.bits_per_weight:g} bits per decoder-Linear weight"

        def show(bits: int) -> str:
            return f"{bits / weights:.4f} bits per weight"
    else:
        target = 8 * budget.target_bytes()
        fixed_bits = _other_tensor_bits(model, {n: chosen[n] for n in free}, decoder, kept, float_bits)
        unit = f"{budget.size} of weights"

        def show(bits: int) -> str:
            return f"{bits / 8 / 2**20:.2f} MiB"
    low = fixed_bits + sum(min(b for b in s if b is not None) for s in sizes)
    high = fixed_bits + sum(max(b for b in s if b is not None) for s in sizes)
    labels = ", ".join(scheme_label(c) for c in budget.candidates)
    if target < low:
        raise OptcError(f"{stage}: budget {unit} is below the cheapest candidates' {show(low)} ({labels})")
    if target > high:
        raise OptcError(f"{stage}: budget {unit} is above the costliest candidates' {show(high)} ({labels}): "
                        "every Linear fits on the largest; lower the target or add a larger candidate")
    index = {n: i for i, n in enumerate(free)}
    groups = [[index[n] for n in g] for g in fused_groups(free)] if budget.fused else [[i] for i in range(len(free))]
    for g in groups:
        if not any(all(sizes[i][c] is not None for i in g) for c in range(len(budget.candidates))):
            raise OptcError(f"{stage}: {fmt.name} stores {', '.join(free[i] for i in g)} (fused: one scheme for "
                            "them) on no one candidate")
    return BudgetPlan(free, sizes, target - fixed_bits, fixed_bits, weights, groups)


def _other_tensor_bits(model: torch.nn.Module, free: dict, decoder: dict, kept, float_bits: int) -> int:
    """Stored bits of every tensor but the free Linears' weights (tied tensors once)."""
    weight_of = {id(m.weight): n for n, m in decoder.items()}
    free_weights = {id(m.weight) for m in free.values()}
    seen: set[int] = set()
    total = 0
    for _, param in model.named_parameters():
        if param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        if id(param) in free_weights:
            continue
        if id(param) in weight_of:
            name = weight_of[id(param)]
            total += kept(name, decoder[name])
        else:
            total += param.numel() * (float_bits if param.is_floating_point() else 8 * param.element_size())
    return total


def estimate_observer(cfg: WeightQuantConfig) -> str:
    """The grid the candidates' errors are estimated on: the budget's, else the stage's own."""
    assert cfg.budget is not None
    # The grid the method will choose (GPTQ's mse search, weighted by the input energy diag(H) as
    # GPTQ's own is): on the default model at 3.25 bits, min-max estimates overstated the cost of
    # 3 bits where a clipped range absorbs outlier weights, and their allocation scored 29.93
    # against 29.42 with this change alone (fixed protocol).
    return cfg.budget.observer or getattr(cfg, "observer", "minmax")


def candidate_errors(ws: Workspace, cfg: WeightQuantConfig, free: list[str],
                     stored: dict[str, list[bool]]) -> dict[str, list[float]]:
    """Each free Linear's round-to-nearest output error ``tr(dW H dW^T)`` on every candidate, ``H``
    from the float model's inputs on the budget's first calibration sequences (``stored``: per
    Linear, the candidates the format can store it on; the others are not evaluated: inf)."""
    assert cfg.budget is not None
    candidates = cfg.budget.candidates
    wanted = set(free)
    errors: dict[str, list[float]] = {}
    # The estimate only ranks candidates: bfloat16 matmuls where they are fast (AMX, accelerators)
    # left the Fisher weights' correlation with float32's above 0.998 on every Linear.
    dtype = ws.calibration.autocast_dtype() or training_dtype("auto", ws.device)
    observer = estimate_observer(cfg)

    def solve(step: LayerStep) -> dict:
        names = [n for n in step.linears if n in wanted]
        if not names:
            return {}
        accs = step.collect(names, lambda _n, m: HessianAccumulator(weight_2d(m).shape[1], matmul_dtype=dtype,
                                                                     fold=step.fold))
        hessians: dict[int, torch.Tensor] = {}  # Linears reading one input share an accumulator
        with torch.no_grad():
            for name in names:
                # float32: the error only ranks candidates, and float64 products cost several times more.
                H = hessians.setdefault(id(accs[name]), accs[name].H.float())
                w = weight_2d(step.linears[name]).detach().float()
                gamma = gammas.get(name)
                # Rows are quantized and weighed independently, so every stride-th row estimates the
                # sum over all of them (ROWS rows at most: the estimate moves by a few percent, the
                # cost falls with the row count).
                stride = max(1, w.shape[0] // ROWS)
                w = w[::stride]
                gamma = None if gamma is None else gamma[::stride]
                scale = weight_2d(step.linears[name]).shape[0] / w.shape[0]
                imp = torch.diagonal(H) if observer == "mse" else None
                errors[name] = [math.inf if not fits else 0.0 if c is None else scale * output_error(
                    fake_quantize(w, choose_qparams(w, c, observer, importance=imp, grid=GRID)) - w, H, gamma)
                    for c, fits in zip(candidates, stored[name])]
        return {}

    ids = ws.calibration_ids()[: cfg.budget.samples]
    gammas: dict[str, torch.Tensor] = {}
    if cfg.budget.sensitivity == "fisher":
        linears = select_linears(ws.model, cfg.targets, cfg.ignore)
        gammas = output_fisher(ws.model, ids, {n: linears[n] for n in free}, device=ws.device, autocast=dtype)
    # The weights stay as they are, so each layer's inputs are the float model's (propagate=False:
    # one forward per layer); no store: nothing of this pass is a finished layer.
    run_sequential(ws.model, ids, solve, targets=cfg.targets, ignore=cfg.ignore,
                   batch_size=ws.calibration.resolved_batch_size(ws.device), device=ws.device, propagate=False,
                   autocast=dtype, progress=ws.progress, description="budget")
    return errors


def allocate_budget(ws: Workspace, cfg: WeightQuantConfig, plan: BudgetPlan) -> tuple[WeightQuantConfig, dict]:
    """The stage's config with one exact-name override per free Linear (its allocated scheme), and
    what the allocation chose and reached."""
    assert cfg.budget is not None
    t0 = time.perf_counter()
    candidates = cfg.budget.candidates
    stored = {n: [b is not None for b in row] for n, row in zip(plan.free, plan.sizes)}
    errors = candidate_errors(ws, cfg, plan.free, stored)
    # A candidate the format cannot store a Linear on has an infinite error: the allocation never gives it.
    err = torch.tensor([errors[n] for n in plan.free], dtype=torch.float64)
    size = torch.tensor([[0 if b is None else b for b in row] for row in plan.sizes], dtype=torch.int64)
    # A set that takes one scheme is one knapsack item: its members' errors and sizes summed.
    members = [torch.tensor(g) for g in plan.groups]
    group_pick = allocate(torch.stack([err[m].sum(dim=0) for m in members]),
                          torch.stack([size[m].sum(dim=0) for m in members]), plan.spare_bits)
    pick = [0] * len(plan.free)
    for m, s in zip(plan.groups, group_pick.tolist()):
        for i in m:
            pick[i] = s
    chosen_bits = sum(plan.sizes[i][s] for i, s in enumerate(pick))
    overrides = [Override(pattern=f"^{re.escape(n)}$", scheme=candidates[s]) for n, s in zip(plan.free, pick)]
    total = plan.fixed_bits + chosen_bits
    stats: dict = {
        "candidates": [scheme_label(c) for c in candidates],
        "schemes": dict(Counter(scheme_label(candidates[s]) for s in pick)),
        "estimated_error": round(sum(errors[n][s] for n, s in zip(plan.free, pick)), 6),
        "observer": estimate_observer(cfg),
        "fused_sets": sum(len(g) > 1 for g in plan.groups),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if cfg.budget.bits_per_weight is not None:
        stats.update(target_bits_per_weight=cfg.budget.bits_per_weight,
                     bits_per_weight=round(total / plan.weights, 4))
        reached = f"{total / plan.weights:.4f} bits per decoder-Linear weight (target {cfg.budget.bits_per_weight:g})"
    else:
        stats.update(target_bytes=cfg.budget.target_bytes(), bytes=math.ceil(total / 8))
        reached = f"{total / 8 / 2**20:.2f} MiB of weights (target {cfg.budget.size})"
    mix = ", ".join(f"{k} x{v}" for k, v in sorted(stats["schemes"].items()))
    stats["note"] = f"budget: {reached}; {mix}"
    log.info("%s", stats["note"])
    return cfg.model_copy(update={"overrides": [*cfg.overrides, *overrides]}), stats
