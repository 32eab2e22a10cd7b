"""Recipe stages: each stage type maps to (config model, function) in :data:`STAGES`.

A stage function takes the :class:`Workspace` (the model being compressed plus what earlier
stages recorded) and its validated config, changes the model in place, and returns statistics
for the report. The kernels themselves live in ``optc.compress`` as pure tensor functions.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from optc.calibrate.hessian import HessianAccumulator
from optc.run.state import LayerStore
from optc.model.anatomy import check_patterns, select_linears, set_weight_2d, weight_2d
from optc.model.anatomy import find_decoder_layers
from optc.calibrate.observers import ActivationStats, MinMaxObserver
from optc.calibrate.sequential import LayerStep, run_sequential
from optc.calibrate.stats import Discard, FeatureNormAccumulator, GramAccumulator
from optc.compress.actquant import (
    ActivationScheme,
    attach_input_quant,
    calibration_summary,
    observer_ranges,
    solve_input_quant,
)
from optc.compress.awq import apply_scale, awq_search_clip, awq_search_scale, resolve_mappings, scaled_gram
from optc.compress.gptq import GPTQResult, gptq_quantize, refit_scales
from optc.compress.masks import nm_mask, nm_violations, parse_pattern, unstructured_mask
from optc.compress.owl import outlier_ratio, owl_sparsities
from optc.compress.quant import (
    QuantParams,
    QuantScheme,
    choose_qparams,
    compute_qparams,
    fake_quantize,
)
from optc.compress.smoothquant import fold_smoothing, smoothing_mappings, smoothquant_scale
from optc.compress.sparsegpt import masked_least_squares, sparsegpt_prune
from optc.compress.structured import (
    apply_plan_to_config,
    channel_importance,
    forward_latency,
    head_importance,
    keep_lowest_removed,
    plan_structured,
    prune_attention_heads,
    prune_mlp_channels,
    reconstruct,
    select_heads,
)
from optc.compress.wanda import wanda_mask, wanda_scores
from optc.data import CalibrationConfig, calibration_chunks
from optc.errors import OptcError
from optc.memory import trim
from optc.progress import NullProgress, Progress
from optc.methods.recover_training import (
    Adapter,
    attach_adapters,
    check_recoverable,
    check_resumable,
    float_latents,
    merge_adapters,
    pattern_violations,
    total_steps,
    train_adapters,
)

log = logging.getLogger(__name__)


@dataclass
class Workspace:
    """The model being compressed and what the stages so far have recorded about it."""

    model: torch.nn.Module
    tokenizer: object
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    device: str = "cpu"
    progress: Progress = field(default_factory=NullProgress)
    qparams: dict[str, QuantParams] = field(default_factory=dict)
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    nm: tuple[int, int] | None = None  # the N:M pattern the masks follow, if any
    teacher: torch.nn.Module | None = None  # the uncompressed model, for distillation
    evaluate: Callable[[torch.nn.Module], dict] | None = None  # the recipe's evaluation
    state_dir: Path | None = None  # where a recovery keeps its resumable state
    adapter: Adapter | None = None  # a recovery adapter to write beside the checkpoint
    store: LayerStore | None = None  # saves finished layers (resume); streams them when streaming
    _ids: torch.Tensor | None = None

    def calibration_ids(self) -> torch.Tensor:
        if self._ids is None:
            self._ids = self.calibration.token_ids(self.tokenizer)
        return self._ids


class _Stage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    targets: list[str] = Field(
        [".*"], description="regexes (re.search) over Linear names inside decoder layers"
    )
    ignore: list[str] = Field(["lm_head"], description="regexes of Linears to leave alone")

    @field_validator("targets", "ignore")
    @classmethod
    def _valid_regex(cls, v: list[str]) -> list[str]:
        check_patterns(v, "target/ignore")
        return v


class Override(BaseModel):
    """Mixed precision: Linears matching ``pattern`` get ``scheme`` (null: left in float)."""

    model_config = ConfigDict(extra="forbid")

    pattern: str
    scheme: QuantScheme | None

    @field_validator("pattern")
    @classmethod
    def _valid_regex(cls, v: str) -> str:
        check_patterns([v], "override")
        return v


class _WeightQuantStage(_Stage):
    scheme: QuantScheme = QuantScheme()
    overrides: list[Override] = Field(default_factory=list)

    def scheme_for(self, name: str) -> QuantScheme | None:
        for o in self.overrides:
            if re.search(o.pattern, name):
                return o.scheme
        return self.scheme


def _relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float((w_hat.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12))


def _record_quantized(ws: Workspace, name: str, module: torch.nn.Module, w_hat, p) -> dict:
    w = weight_2d(module).detach()
    err = _relative_error(w, w_hat)
    set_weight_2d(module, w_hat)
    ws.qparams[name] = p
    return {"scheme": p.scheme.label(), "rel_error": round(err, 6)}


# --- RTN ---------------------------------------------------------------------------------


class RTNStage(_WeightQuantStage):
    """Round-to-nearest weight quantization (no data)."""

    type: Literal["rtn"]
    observer: Literal["minmax", "mse"] = "minmax"


def run_rtn(ws: Workspace, cfg: RTNStage) -> dict:
    per_module: dict[str, dict] = {}

    def solve(step: LayerStep) -> dict:
        with torch.no_grad():
            for name, module in step.linears.items():
                scheme = cfg.scheme_for(name)
                if scheme is not None:
                    w = weight_2d(module).detach()
                    p = choose_qparams(w, scheme, cfg.observer)
                    per_module[name] = _record_quantized(ws, name, module, fake_quantize(w, p), p)
        return {}

    # Layer by layer through the runner with no calibration samples (no forward runs), so a
    # streamed model is read one layer at a time like for the calibrated methods.
    run_sequential(
        ws.model, torch.zeros(0, 1, dtype=torch.long), solve, targets=cfg.targets, ignore=cfg.ignore,
        batch_size=1, device=ws.device, progress=ws.progress, description="rtn", store=ws.store,
        records=per_module,
    )
    return {"modules": per_module}


# --- GPTQ --------------------------------------------------------------------------------


class GPTQStage(_WeightQuantStage):
    """GPTQ (Frantar et al. 2022): Hessian-aware rounding with error propagation."""

    type: Literal["gptq"]
    block_size: int = Field(128, gt=0)
    dampening: float = Field(0.01, gt=0, description="fraction of mean diag(H) added to H")
    actorder: bool = Field(True, description="quantize columns by decreasing Hessian diagonal")
    groups: Literal["lazy", "static", "permuted"] = Field(
        "lazy",
        description="act-order group grids: lazy (contiguous groups, grid chosen on first touch), "
        "static (grids fixed up front) or permuted (AutoGPTQ desc_act; needs g_idx on disk)",
    )
    refit_scales: bool = Field(True, description="least-squares scales for the final codes")
    observer: Literal["minmax", "mse"] = "mse"
    sequential: bool = Field(
        False, description="true-sequential: quantize a layer's Linears in execution order, each "
        "calibrated on the outputs of the ones already quantized (one more layer forward per group)",
    )


def solve_gptq(
    step: LayerStep,
    names: list[str],
    hessians: dict[str, HessianAccumulator],
    scheme_for: Callable[[str], QuantScheme | None],
    masks: dict[str, torch.Tensor],
    **options,
) -> Iterator[tuple[str, GPTQResult]]:
    """GPTQ for the named Linears of one layer, each from its input's Hessian, yielded one
    by one (``hessians`` is consumed: each Hessian is dropped after its last Linear).

    Linears that read one input (one accumulator: q/k/v after one norm, gate/up) with one
    scheme are solved as one weight, their rows stacked: GPTQ treats rows independently given
    H, so each gets the codes of its own solve (scales to float rounding; the same checkpoint
    bit for bit on the default model), with one Cholesky factor, one sweep and one grid search
    per group for all of them (20% less time for those Linears).
    """
    groups: list[list[str]] = []
    for name in names:
        twin = next((g for g in groups if hessians[g[0]] is hessians[name]
                     and scheme_for(g[0]) == scheme_for(name) and (g[0] in masks) == (name in masks)), None)
        if twin is None:
            groups.append([name])
        else:
            twin.append(name)
    for group in groups:
        H = hessians[group[0]].H
        for name in group:
            hessians.pop(name)
        weights = [weight_2d(step.linears[n]).detach() for n in group]
        mask = torch.cat([masks[n] for n in group]) if group[0] in masks else None  # a pruned layer
        res = gptq_quantize(
            torch.cat(weights) if len(group) > 1 else weights[0], H, scheme_for(group[0]),
            mask=mask, name="+".join(group), **options,
        )
        del H
        if len(group) == 1:
            yield group[0], res
        else:
            r0 = 0
            for name, w in zip(group, weights):
                r1 = r0 + w.shape[0]
                p = res.params
                # Own copies: writers store a tensor's storage, not a view of the stacked one.
                part = QuantParams(p.scheme, p.scale[r0:r1].clone(), p.zero[r0:r1].clone(), p.g_idx.clone())
                row_loss = res.row_loss[r0:r1]
                yield name, GPTQResult(res.weight[r0:r1], part, float(row_loss.sum()),
                                       res.seconds * (r1 - r0) / res.weight.shape[0], row_loss)
                r0 = r1
        del res
        trim()  # each solve's temporaries, before the next one fragments the heap further


def _collect_in_order(step: LayerStep, names: list[str], make) -> Iterator[tuple[list[str], dict]]:
    """Groups of Linears sharing one input, in execution order, each collected only after the
    previous groups were compressed (true-sequential). The first pass also finds the order: the
    engine creates one accumulator per distinct input, in the order the inputs occur."""
    order: list[str] = []

    def first_only(name: str, module: torch.nn.Module):
        order.append(name)
        return make(name, module) if len(order) == 1 else Discard()

    accs = step.collect(names, first_only)
    groups = [[n for n in names if n in accs and accs[n] is accs[o]] for o in order]
    yield groups[0], {n: accs[n] for n in groups[0]}
    for group in groups[1:]:
        yield group, step.collect(group, make)


def run_gptq(ws: Workspace, cfg: GPTQStage) -> dict:
    per_module: dict[str, dict] = {}

    def solve(step: LayerStep) -> dict:
        names = [n for n in step.linears if cfg.scheme_for(n) is not None]
        dtype = ws.calibration.autocast_dtype()

        def make(_name: str, module: torch.nn.Module) -> HessianAccumulator:
            return HessianAccumulator(weight_2d(module).shape[1], matmul_dtype=dtype, fold=step.fold)

        groups = _collect_in_order(step, names, make) if cfg.sequential else [(names, step.collect(names, make))]
        for group, accs in groups:
            # One result at a time, recorded before the next solve: the largest (down_proj,
            # last) then runs with no other layer's result or Hessian held.
            for name, res in solve_gptq(
                step, group, accs, cfg.scheme_for, ws.masks,
                block_size=cfg.block_size, dampening=cfg.dampening, actorder=cfg.actorder,
                groups=cfg.groups, observer=cfg.observer, refit=cfg.refit_scales,
            ):
                stats = _record_quantized(ws, name, step.linears[name], res.weight, res.params)
                per_module[name] = {**stats, "gptq_loss": round(res.loss, 6)}
                del res
        return {}

    layers = _run_calibration(ws, cfg, solve, "gptq", records=per_module)
    return {"modules": per_module, "layers": layers}


# --- AWQ ---------------------------------------------------------------------------------


class AWQStage(_WeightQuantStage):
    """AWQ (Lin et al. 2023): activation-aware per-channel scales, then quantization."""

    type: Literal["awq"]
    grid: int = Field(20, gt=0, description="alpha values tried in [0, 1)")
    duo_scaling: bool = True
    clip: bool = Field(True, description="search a weight clipping ratio per group")
    refit_scales: bool = Field(True, description="least-squares scales for the final codes")
    observer: Literal["minmax", "mse"] = Field(
        "minmax", description="grids of the Linears that get no clip search (q/k, or clip: false)"
    )


def run_awq(ws: Workspace, cfg: AWQStage) -> dict:
    per_module: dict[str, dict] = {}

    def solve(step: LayerStep) -> dict:
        mappings = resolve_mappings(step.layer)
        full = {m.prev_name: [f"{step.name}.{n}" for n in m.linear_names] for m in mappings}
        names = sorted({n for group in full.values() for n in group} | set(step.linears))
        names = [n for n in names if n in step.linears and cfg.scheme_for(n) is not None]
        dtype = ws.calibration.autocast_dtype()
        accs = step.collect(names, lambda n, m: GramAccumulator(weight_2d(m).shape[1], matmul_dtype=dtype, fold=step.fold))
        # One Gram matrix per distinct input (q/k/v share one accumulator, gate/up another).
        grams = {key: a.gram for key, a in {id(a): a for a in accs.values()}.items()}

        def clipped(name: str) -> bool:
            # Clipping q/k distorts attention logits more than it saves (as in AutoAWQ).
            return cfg.clip and not re.search(r"(q_proj|k_proj|c_attn)$", name)

        scales: dict[str, torch.Tensor] = {}
        ranges: dict[str, torch.Tensor] = {}
        for m in mappings:
            group = [n for n in full[m.prev_name] if n in accs]
            if len(group) != len(m.linears):
                continue  # some of these Linears stay float: scaling would not pay off
            scheme = cfg.scheme_for(group[0])
            if any(cfg.scheme_for(n) != scheme for n in group):
                continue
            acc = accs[group[0]]
            res = awq_search_scale(
                grams[id(acc)], acc.mean_abs, [weight_2d(step.linears[n]).detach() for n in group], scheme,
                grid=cfg.grid, duo_scaling=cfg.duo_scaling, clip=[clipped(n) for n in group],
            )
            apply_scale(m.prev, m.linears, res.scale)
            ranges.pop(f"{step.name}.{m.prev_name}", None)  # prev's rows just changed (up_proj)
            for n, rng in zip(group, res.clip):
                scales[n] = res.scale
                if rng is not None:  # already searched for exactly these weights and input
                    ranges[n] = rng
        for name in names:
            module = step.linears[name]
            scheme = cfg.scheme_for(name)
            w = weight_2d(module).detach()
            G = grams[id(accs[name])]
            if name in scales:  # the scaled weights see the input divided by s
                G = scaled_gram(G, scales[name])
            if clipped(name):
                rng = ranges[name] if name in ranges else awq_search_clip(G, w, scheme)
                p = compute_qparams(w, scheme, clip=rng)
            else:
                p = choose_qparams(w, scheme, cfg.observer)
            w_hat = fake_quantize(w, p)
            if cfg.refit_scales:
                w_hat, p = refit_scales(w.float(), G, w_hat, p)
            per_module[name] = _record_quantized(ws, name, module, w_hat.to(w.dtype), p)
        return {}

    layers = _run_calibration(ws, cfg, solve, "awq", records=per_module)
    return {"modules": per_module, "layers": layers}


def _run_calibration(ws: Workspace, cfg: _Stage, solve, description: str, records: dict | None = None) -> list[dict]:
    return run_sequential(
        ws.model, ws.calibration_ids(), solve,
        targets=cfg.targets, ignore=cfg.ignore,
        batch_size=ws.calibration.resolved_batch_size(ws.device), device=ws.device,
        autocast=ws.calibration.autocast_dtype(), progress=ws.progress, description=description,
        store=ws.store, records=records,
    )


# --- magnitude pruning -------------------------------------------------------------------


class MagnitudeStage(_Stage):
    """Prune the smallest |W|: unstructured at ``sparsity`` or an N:M ``pattern``."""

    type: Literal["magnitude"]
    sparsity: float = Field(0.5, ge=0, lt=1)
    pattern: str | None = Field(None, description="N:M, e.g. 2:4; overrides sparsity")
    scope: Literal["layer", "global"] = "layer"

    @field_validator("pattern")
    @classmethod
    def _valid_pattern(cls, v: str | None) -> str | None:
        if v is not None:
            parse_pattern(v)
        return v


def apply_mask(ws: Workspace, name: str, module: torch.nn.Module, mask: torch.Tensor) -> dict:
    """Zero pruned weights; a mask from an earlier stage is kept (masks never regrow)."""
    if name in ws.masks:
        mask = mask & ws.masks[name]
    w = weight_2d(module).detach()
    set_weight_2d(module, w * mask)
    ws.masks[name] = mask
    return {"sparsity": round(1 - float(mask.float().mean()), 6)}


def run_magnitude(ws: Workspace, cfg: MagnitudeStage) -> dict:
    linears = select_linears(ws.model, cfg.targets, cfg.ignore)
    scores = {n: weight_2d(m).detach().abs() for n, m in linears.items()}
    masks: dict[str, torch.Tensor] = {}
    if cfg.pattern:
        n, m = parse_pattern(cfg.pattern)
        for name, s in scores.items():
            try:
                masks[name] = nm_mask(s, n, m)
            except OptcError as exc:
                raise OptcError(f"{name}: {exc}") from exc
    elif cfg.scope == "global":
        flat = torch.cat([s.flatten() for s in scores.values()])
        k = int(flat.numel() * cfg.sparsity)
        threshold = flat.kthvalue(k).values if k else flat.min() - 1
        masks = {name: s > threshold for name, s in scores.items()}
    else:
        masks = {name: unstructured_mask(s, cfg.sparsity) for name, s in scores.items()}
    with torch.no_grad():
        per_module = {name: apply_mask(ws, name, linears[name], mk) for name, mk in masks.items()}
    nm = parse_pattern(cfg.pattern) if cfg.pattern else None
    ws.nm = nm or ws.nm
    return {"modules": per_module, **sparsity_summary(ws.model, linears, nm)}


# --- SmoothQuant and W8A8 ------------------------------------------------------------------


class SmoothQuantStage(_Stage):
    """SmoothQuant (Xiao et al. 2022): migrate activation outliers into the weights, folded
    into the preceding norm so the float model is unchanged."""

    type: Literal["smoothquant"]
    alpha: float = Field(0.5, ge=0, le=1, description="migration strength, in [0, 1]")
    scope: Literal["norms", "all"] = Field(
        "norms", description="norms: fold into the norms before q/k/v and the MLP (the paper); "
        "all: also v -> o and up -> down"
    )


def run_smoothquant(ws: Workspace, cfg: SmoothQuantStage) -> dict:
    per_module: dict[str, dict] = {}

    def solve(step: LayerStep) -> dict:
        mappings = smoothing_mappings(step.layer, step.name, cfg.scope)
        groups = [[f"{step.name}.{n}" for n in m.linear_names] for m in mappings]
        # Only pairs whose Linears are all targeted: scaling an untouched Linear gains nothing.
        chosen = [(m, g) for m, g in zip(mappings, groups) if all(n in step.linears for n in g)]
        names = sorted({n for _, g in chosen for n in g})
        accs = step.collect(names, lambda n, m: MinMaxObserver(weight_2d(m).shape[1]))
        for m, group in chosen:
            act = accs[group[0]].absmax
            s = smoothquant_scale(act, [weight_2d(lin) for lin in m.linears], cfg.alpha)
            fold_smoothing(step.name, m, s)
            after = float((act / s).max())
            for n in group:
                per_module[n] = {
                    "smoothed_by": f"{step.name}.{m.prev_name}",
                    "act_absmax": round(float(act.max()), 6),
                    "act_absmax_smoothed": round(after, 6),
                }
        return {}

    layers = _run_calibration(ws, cfg, solve, "smoothquant")
    notes = []
    if per_module:
        ratio = [v["act_absmax"] / max(v["act_absmax_smoothed"], 1e-12) for v in per_module.values()]
        notes.append(f"alpha {cfg.alpha:g}; input abs-max shrunk {min(ratio):.1f}x to {max(ratio):.1f}x")
    return {"modules": per_module, "layers": layers, "notes": notes}


class ActivationOverride(BaseModel):
    """Mixed precision for activations: Linears matching ``pattern`` get ``activations``
    (null: their inputs stay 16-bit, the weights are still quantized)."""

    model_config = ConfigDict(extra="forbid")

    pattern: str
    activations: ActivationScheme | None

    @field_validator("pattern")
    @classmethod
    def _valid_regex(cls, v: str) -> str:
        check_patterns([v], "activation override")
        return v


class W8A8Stage(_WeightQuantStage):
    """Int8 weights (GPTQ or RTN, per channel) and int8 activations (static calibrated or
    dynamic scales), with activations really fake-quantized from then on."""

    type: Literal["w8a8"]
    scheme: QuantScheme = QuantScheme(bits=8, symmetric=True, group_size=None)
    method: Literal["gptq", "rtn"] = Field("gptq", description="weight rounding")
    weight_observer: Literal["minmax", "mse"] = "mse"
    dampening: float = Field(0.01, gt=0, description="GPTQ: fraction of mean diag(H) added to H")
    actorder: bool = Field(True, description="GPTQ: quantize columns by decreasing Hessian diagonal")
    activations: ActivationScheme = ActivationScheme()
    activation_overrides: list[ActivationOverride] = Field(default_factory=list)
    sample_tokens: int = Field(2048, gt=0, description="token rows kept per input to measure SQNR")

    def activations_for(self, name: str) -> ActivationScheme | None:
        for o in self.activation_overrides:
            if re.search(o.pattern, name):
                return o.activations
        return self.activations


def run_w8a8(ws: Workspace, cfg: W8A8Stage) -> dict:
    per_module: dict[str, dict] = {}
    gptq = cfg.method == "gptq"

    def solve(step: LayerStep) -> dict:
        names = [n for n in step.linears if cfg.scheme_for(n) is not None]

        def make(_name: str, module: torch.nn.Module) -> ActivationStats:
            k = weight_2d(module).shape[1]
            extra = (HessianAccumulator(k, fold=step.fold),) if gptq else ()
            return ActivationStats(
                k, step.tokens, averaging_constant=cfg.activations.averaging_constant,
                sample_tokens=cfg.sample_tokens, seed=ws.calibration.seed, first_row=step.row_offset,
                extra=extra,
            )

        accs = step.collect(names, make)
        solved = dict(solve_gptq(
            step, names, {n: accs[n].extra[0] for n in names}, cfg.scheme_for, ws.masks,
            dampening=cfg.dampening, actorder=cfg.actorder, observer=cfg.weight_observer,
        )) if gptq else {}
        ranges: dict[tuple[int, ActivationScheme], dict] = {}  # shared inputs: solved once
        for name in names:
            module, acc, scheme = step.linears[name], accs[name], cfg.scheme_for(name)
            w = weight_2d(module).detach().clone()
            if gptq:
                w_hat, p = solved[name].weight, solved[name].params
            else:
                p = choose_qparams(w, scheme, cfg.weight_observer)
                w_hat = fake_quantize(w, p)
            stats = _record_quantized(ws, name, module, w_hat, p)
            act = cfg.activations_for(name)
            if act is not None:
                iq = solve_input_quant(act, acc)
                attach_input_quant(module, iq)
                stats.update(calibration_summary(iq, acc, w, w_hat))
                if not act.dynamic:
                    key = (id(acc), act)
                    if key not in ranges:
                        ranges[key] = observer_ranges(acc, act)
                    stats["ranges"] = ranges[key]
            else:
                stats["activations"] = "16-bit"
            per_module[name] = stats
        return {}

    layers = _run_calibration(ws, cfg, solve, "w8a8")
    return {"modules": per_module, "layers": layers, "notes": _w8a8_notes(per_module)}


def _w8a8_notes(per_module: dict[str, dict]) -> list[str]:
    """One line per activation scheme used, and the Linear that loses most."""
    schemes: dict[str, int] = {}
    for m in per_module.values():
        schemes[m["activations"]] = schemes.get(m["activations"], 0) + 1
    notes = [f"activations {label} on {count} Linears" for label, count in schemes.items()]
    sqnr = {n: m["output_sqnr_db"] for n, m in per_module.items() if m.get("output_sqnr_db") is not None}
    if sqnr:
        worst = min(sqnr, key=sqnr.get)
        notes.append(
            f"output SQNR mean {sum(sqnr.values()) / len(sqnr):.1f} dB, "
            f"worst {worst} {sqnr[worst]:.1f} dB"
        )
    return notes


# --- Wanda and SparseGPT pruning ---------------------------------------------------------


class LayerSparsity(BaseModel):
    """Per-layer sparsity: Linears whose name matches ``pattern`` are pruned to ``sparsity``."""

    model_config = ConfigDict(extra="forbid")

    pattern: str
    sparsity: float = Field(ge=0, lt=1)

    @field_validator("pattern")
    @classmethod
    def _valid_regex(cls, v: str) -> str:
        check_patterns([v], "sparsity override")
        return v


class _CalibratedPruneStage(_Stage):
    sparsity: float = Field(0.5, ge=0, lt=1, description="unstructured sparsity of each Linear")
    pattern: str | None = Field(None, description="N:M along the input dimension, e.g. 2:4; overrides sparsity")
    allocation: Literal["uniform", "owl"] = Field(
        "uniform", description="unstructured: the same sparsity in every layer, or OWL's "
        "outlier-weighted per-layer sparsity with the same mean",
    )
    owl_lambda: float = Field(0.08, ge=0, lt=0.5, description="OWL: layers within sparsity +- lambda")
    owl_threshold: float = Field(5.0, gt=0, description="OWL: an outlier scores above this times the layer mean")
    overrides: list[LayerSparsity] = Field(
        default_factory=list, description="per-Linear sparsity, first matching pattern wins (e.g. lower in layers.0.)"
    )
    sequential: bool = Field(
        False, description="prune a layer's Linears in execution order, each calibrated on the "
        "outputs of the ones already pruned (one more layer forward per group)",
    )

    @field_validator("pattern")
    @classmethod
    def _valid_pattern(cls, v: str | None) -> str | None:
        if v is not None:
            parse_pattern(v)
        return v

    @model_validator(mode="after")
    def _pattern_is_exclusive(self):
        if self.pattern and (self.allocation != "uniform" or self.overrides):
            raise ValueError("pattern (N:M) fixes every group's sparsity: drop allocation/overrides")
        return self


class WandaStage(_CalibratedPruneStage):
    """Wanda (Sun et al. 2023): prune by |W| times input feature norm, per output row."""

    type: Literal["wanda"]


class SparseGPTStage(_CalibratedPruneStage):
    """SparseGPT (Frantar & Alistarh 2023): OBS mask selection with Hessian reconstruction."""

    type: Literal["sparsegpt"]
    block_size: int = Field(128, gt=0, description="columns whose mask is chosen together")
    dampening: float = Field(0.01, gt=0, description="fraction of mean diag(H) added to H")
    refit: bool = Field(
        False, description="after the sweep, re-solve the kept weights exactly (least squares "
        "on the layer's inputs) for the final mask",
    )


def sparsity_summary(
    model: torch.nn.Module, linears: dict[str, torch.nn.Module], nm: tuple[int, int] | None
) -> dict:
    """Sparsity of the pruned Linears overall and per decoder layer, and the N:M check."""
    prefix, _ = find_decoder_layers(model)
    zeros = total = violations = 0
    per_layer: dict[str, list[int]] = {}
    for name, module in linears.items():
        w = weight_2d(module).detach()
        z = int((w == 0).sum())
        zeros, total = zeros + z, total + w.numel()
        layer = f"{prefix}.{name[len(prefix) + 1:].split('.')[0]}"
        acc = per_layer.setdefault(layer, [0, 0])
        acc[0], acc[1] = acc[0] + z, acc[1] + w.numel()
        if nm is not None:
            violations += nm_violations(w, *nm)
    out = {
        "sparsity": round(zeros / max(1, total), 6),
        "layer_sparsity": {k: round(z / t, 6) for k, (z, t) in per_layer.items()},
    }
    note = f"overall sparsity {out['sparsity']:.4f}"
    if nm is not None:
        out.update(pattern=f"{nm[0]}:{nm[1]}", nm_violations=violations)
        note += (f"; exactly {nm[0]}:{nm[1]} in every group" if not violations
                 else f"; {violations} groups break {nm[0]}:{nm[1]}")
    out["notes"] = [note]
    return out


def _owl_allocation(ws: Workspace, cfg: _CalibratedPruneStage) -> dict[str, float]:
    """OWL per-layer sparsity from outlier ratios of the float model's Wanda scores."""
    ratios: dict[str, float] = {}

    def observe(step: LayerStep) -> dict:
        names = list(step.linears)
        accs = step.collect(names, lambda n, m: FeatureNormAccumulator(weight_2d(m).shape[1]))
        scores = [wanda_scores(weight_2d(step.linears[n]), accs[n].sq_norm) for n in names]
        ratios[step.name] = outlier_ratio(scores, cfg.owl_threshold)
        return {"outlier_ratio": round(ratios[step.name], 6)}

    run_sequential(
        ws.model, ws.calibration_ids(), observe, targets=cfg.targets, ignore=cfg.ignore,
        batch_size=ws.calibration.resolved_batch_size(ws.device), device=ws.device, propagate=False,
        autocast=ws.calibration.autocast_dtype(), progress=ws.progress, description="owl",
    )
    return dict(zip(ratios, owl_sparsities(list(ratios.values()), cfg.sparsity, cfg.owl_lambda)))


def _run_calibrated_prune(ws: Workspace, cfg: _CalibratedPruneStage, method: str) -> dict:
    nm = parse_pattern(cfg.pattern) if cfg.pattern else None
    linears = select_linears(ws.model, cfg.targets, cfg.ignore)
    if nm is not None:  # refuse bad shapes before any calibration work
        for name, module in linears.items():
            if weight_2d(module).shape[1] % nm[1]:
                raise OptcError(
                    f"{name}: N:M pattern {cfg.pattern} needs in_features divisible by {nm[1]}, "
                    f"got {weight_2d(module).shape[1]}"
                )
    layer_sparsity = _owl_allocation(ws, cfg) if cfg.allocation == "owl" else {}
    per_module: dict[str, dict] = {}

    def sparsity_for(name: str, layer: str) -> float:
        for o in cfg.overrides:
            if re.search(o.pattern, name):
                return o.sparsity
        return layer_sparsity.get(layer, cfg.sparsity)

    def solve(step: LayerStep) -> dict:
        def make(_name: str, module: torch.nn.Module):
            k = weight_2d(module).shape[1]
            if method == "wanda":
                return FeatureNormAccumulator(k)
            return HessianAccumulator(k, matmul_dtype=ws.calibration.autocast_dtype(), fold=step.fold)

        names = list(step.linears)
        groups = (_collect_in_order(step, names, make) if cfg.sequential
                  else [(names, step.collect(names, make))])
        for group, accs in groups:
            for name in group:
                module = step.linears[name]
                w = weight_2d(module).detach()
                sp = sparsity_for(name, step.name)
                keep = ws.masks.get(name)
                extra: dict = {}
                if method == "wanda":
                    mask = wanda_mask(w, accs[name].sq_norm, sparsity=sp, nm=nm, keep=keep)
                else:
                    res = sparsegpt_prune(
                        w, accs[name].H, sparsity=sp, nm=nm, keep=keep, block_size=cfg.block_size,
                        dampening=cfg.dampening, name=name,
                    )
                    new_w = res.weight
                    if cfg.refit:
                        new_w = masked_least_squares(w, accs[name].H, res.mask, dampening=cfg.dampening)
                    set_weight_2d(module, new_w)
                    mask, extra = res.mask, {"sparsegpt_loss": round(res.loss, 6)}
                per_module[name] = {**apply_mask(ws, name, module, mask), **extra}
        return {"target_sparsity": None if nm else round(layer_sparsity.get(step.name, cfg.sparsity), 6)}

    layers = _run_calibration(ws, cfg, solve, method)
    ws.nm = nm or ws.nm
    return {"modules": per_module, "layers": layers, **sparsity_summary(ws.model, linears, nm)}


def run_wanda(ws: Workspace, cfg: WandaStage) -> dict:
    return _run_calibrated_prune(ws, cfg, "wanda")


def run_sparsegpt(ws: Workspace, cfg: SparseGPTStage) -> dict:
    return _run_calibrated_prune(ws, cfg, "sparsegpt")


# --- structured pruning (heads, key/value groups, MLP channels) ---------------------------


class StructuredStage(BaseModel):
    """Remove whole attention heads and MLP channels; every layer loses the same number."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["structured"]
    heads: float = Field(0.0, ge=0, lt=1, description="fraction of query heads removed (under "
                         "GQA the same number from every key/value group)")
    kv_heads: float = Field(0.0, ge=0, lt=1, description="fraction of key/value groups removed "
                            "with all their query heads")
    mlp: float = Field(0.0, ge=0, lt=1, description="fraction of MLP intermediate channels removed")
    channel_multiple: int = Field(1, gt=0, description="round kept MLP channels down to a multiple of this")
    reconstruct: bool = Field(True, description="least-squares refit of the output projections")
    dampening: float = Field(0.01, gt=0, description="fraction of mean diag(H) added for the refit")
    latency_tokens: int = Field(256, ge=0, description="tokens of the before/after CPU latency check (0: skip)")

    @model_validator(mode="after")
    def _something_to_remove(self):
        if not (self.heads or self.kv_heads or self.mlp):
            raise ValueError("structured pruning needs heads, kv_heads or mlp above 0")
        return self


def run_structured(ws: Workspace, cfg: StructuredStage) -> dict:
    model = ws.model
    if ws.qparams:
        raise OptcError("structured pruning must come before quantization (it reshapes the Linears)")
    prefix, layers = find_decoder_layers(model)
    plan = plan_structured(model, layers[0], heads=cfg.heads, kv_heads=cfg.kv_heads, mlp=cfg.mlp,
                           channel_multiple=cfg.channel_multiple)
    before = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    latency_before = forward_latency(model, cfg.latency_tokens) if cfg.latency_tokens else None
    outputs = ([plan.attention.o] if plan.attention else []) + ([plan.mlp.down] if plan.mlp else [])

    def slice_masks(step: LayerStep, surgery) -> None:
        for rel, idx in [*((r, ("rows", i)) for r, i in surgery.rows.items()),
                         *((r, ("cols", i)) for r, i in surgery.cols.items())]:
            name = f"{step.name}.{rel}"
            if name in ws.masks:
                axis, keep = idx
                mask = ws.masks.pop(name)
                mask = mask[keep] if axis == "rows" else mask[:, keep]
                apply_mask(ws, name, step.layer.get_submodule(rel), mask)

    def solve(step: LayerStep) -> dict:
        stats: dict = {}
        layer = step.layer
        for rel in outputs:  # attention first: the MLP then calibrates on the pruned attention
            name = f"{step.name}.{rel}"
            dtype = ws.calibration.autocast_dtype()
            H = step.collect(
                [name], lambda n, m: HessianAccumulator(weight_2d(m).shape[1], matmul_dtype=dtype, fold=step.fold)
            )[name].H
            W = weight_2d(layer.get_submodule(rel)).detach()
            if plan.attention is not None and rel == plan.attention.o:
                imp = head_importance(W, H, plan.head_dim)
                keep_q, keep_kv = select_heads(imp, plan.kv_heads, plan.remove_per_group, plan.remove_groups)
                cols = keep_q[:, None] * plan.head_dim + torch.arange(plan.head_dim)[None, :]
                new_w = reconstruct(W, H, cols.flatten(), cfg.dampening) if cfg.reconstruct else None
                surgery = prune_attention_heads(layer, plan.attention, keep_q, keep_kv, new_w)
                stats["heads_kept"] = keep_q.tolist()
            else:
                imp = channel_importance(W, H)
                keep = keep_lowest_removed(imp, plan.remove_channels)
                new_w = reconstruct(W, H, keep, cfg.dampening) if cfg.reconstruct else None
                surgery = prune_mlp_channels(layer, plan.mlp, keep, new_w)
                stats["mlp_importance_removed"] = round(float(imp.sum() - imp[keep].sum()) / float(imp.sum().clamp_min(1e-12)), 6)
            slice_masks(step, surgery)
        return stats

    layer_stats = run_sequential(
        model, ws.calibration_ids(), solve, targets=[re.escape(o) + "$" for o in outputs], ignore=[],
        batch_size=ws.calibration.resolved_batch_size(ws.device), device=ws.device,
        autocast=ws.calibration.autocast_dtype(), progress=ws.progress, description="structured",
    )
    config = apply_plan_to_config(model.config, plan)
    after = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    out = {
        "config": config,
        "parameters_before": before,
        "parameters_after": after,
        "parameters_removed": before - after,
        "parameters_removed_fraction": round((before - after) / before, 6),
        "layers": layer_stats,
    }
    shapes = ", ".join(f"{k} {v}" for k, v in config.items() if k != "head_dim")
    note = f"removed {before - after:,} parameters ({100 * (before - after) / before:.1f}%): {shapes}"
    if latency_before is not None:
        latency_after = forward_latency(model, cfg.latency_tokens)
        out.update(latency_tokens=cfg.latency_tokens, latency_ms_before=round(1e3 * latency_before, 2),
                   latency_ms_after=round(1e3 * latency_after, 2),
                   speedup=round(latency_before / latency_after, 3))
        note += (f"; CPU forward of {cfg.latency_tokens} tokens {1e3 * latency_before:.0f} -> "
                 f"{1e3 * latency_after:.0f} ms ({out['speedup']:.2f}x)")
    out["notes"] = [note]
    return out


# --- recovery (LoRA fine-tuning with distillation) ----------------------------------------


class RecoverStage(_Stage):
    """LoRA fine-tuning of the compressed model (Hu et al. 2021) with next-token
    cross-entropy, distillation from the uncompressed model (Hinton et al. 2015), or a mix;
    pruning masks and quantization grids are kept (see optc.methods.recover_training)."""

    type: Literal["recover"]
    steps: int | None = Field(None, gt=0, description="optimizer steps (deterministic budget)")
    tokens: int | None = Field(None, gt=0, description="training tokens (steps = tokens / (batch_size * seqlen))")
    max_minutes: float | None = Field(None, gt=0, description="wall-clock budget; the schedule follows the clock")
    lr: float = Field(1e-3, gt=0, description="peak learning rate (AdamW)")
    warmup: float = Field(0.05, ge=0, lt=1, description="fraction of the run with a linear warm-up")
    rank: int = Field(16, gt=0, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (the update is scaled by alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout (unmasked float-grid adapters only)")
    loss: Literal["ce", "kd", "mix"] = Field("mix", description="cross-entropy, distillation KL, or a mix")
    kd_weight: float = Field(0.5, ge=0, le=1, description="mix: weight of the distillation term")
    temperature: float = Field(1.0, gt=0, description="distillation temperature T")
    teacher: str | None = Field(
        None, description="model to distil from; null: the recipe's model as loaded, before any stage"
    )
    teacher_cache: Literal["none", "topk"] = Field(
        "none", description="none: teacher logits on the fly; topk: its top-k logits cached on disk"
    )
    teacher_topk: int = Field(128, gt=0, description="logits kept per token by teacher_cache: topk")
    batch_size: int = Field(4, gt=0, description="sequences per step")
    seqlen: int | None = Field(None, gt=1, description="tokens per sequence (null: calibration.seqlen)")
    samples: int | None = Field(None, gt=0, description="training sequences (null: every chunk of the calibration text)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass (less memory, ~30% slower)")
    max_grad_norm: float = Field(1.0, ge=0, description="gradient clipping (0: off)")
    save_every: int = Field(25, ge=0, description="save resumable state every N steps (0: never)")
    state_dir: str | None = Field(None, description="resumable state (default: beside the output)")
    resume: bool = Field(False, description="continue from the state saved by an interrupted run")
    seed: int = 0
    export: Literal["merge", "adapter"] = Field(
        "merge", description="merge: fold the update into the weights (re-quantized onto the same "
        "grid); adapter: keep it separate as a peft adapter beside the checkpoint",
    )
    eval_before: bool = Field(True, description="evaluate the model just before recovery too")

    @model_validator(mode="after")
    def _has_budget(self):
        if self.steps is None and self.tokens is None and self.max_minutes is None:
            raise ValueError("recovery needs a budget: steps, tokens and/or max_minutes")
        return self


def run_recover(ws: Workspace, cfg: RecoverStage) -> dict:
    linears = check_recoverable(ws.model, cfg)
    if cfg.export == "adapter" and any(n in ws.masks for n in linears):
        raise OptcError(
            "export: adapter cannot keep the pruning masks (peft adds B A densely, so the pruned "
            "weights would move); use export: merge for a pruned model"
        )
    teacher = None
    if cfg.loss != "ce":
        if ws.teacher is None:
            raise OptcError("distillation (loss kd or mix) needs the uncompressed model as teacher")
        teacher = ws.teacher
    state_dir = Path(cfg.state_dir).expanduser() if cfg.state_dir else ws.state_dir
    if cfg.resume:
        check_resumable(state_dir)  # before any tokenizing, evaluating or training
    seqlen = cfg.seqlen or ws.calibration.seqlen
    chunks = calibration_chunks(ws.tokenizer, ws.calibration.dataset, seqlen, cfg.samples)[: cfg.samples]
    before = ws.evaluate(ws.model) if (cfg.eval_before and ws.evaluate is not None) else None
    latents = float_latents(ws.teacher, linears, ws.qparams) if cfg.export == "merge" else {}
    wrappers = attach_adapters(ws.model, linears, cfg, ws.masks, ws.qparams, latents)
    try:
        run = train_adapters(ws.model, wrappers, teacher, chunks, cfg, state_dir, ws.progress)
    finally:
        tensors = {n: (w.lora_A.detach().clone(), w.lora_B.detach().clone()) for n, w in wrappers.items()}
        per_module, base = merge_adapters(ws.model, wrappers, keep_base=cfg.export == "adapter")
    zeros_moved = sum(int((weight_2d(linears[n]).detach()[~m] != 0).sum()) for n, m in ws.masks.items() if n in linears)
    quantized = [n for n in linears if n in ws.qparams]
    if cfg.export == "adapter":
        ws.adapter = Adapter(
            tensors=tensors, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout,
            base_model=str(ws.model.config._name_or_path or ""),
            conv1d=any(not isinstance(m, torch.nn.Linear) for m in linears.values()), base_weights=base,
        )
        exported = "adapter kept separate: adapter_model.safetensors + adapter_config.json (peft LoRA) beside the checkpoint, whose weights are the pre-recovery ones"
    elif quantized:
        exported = (f"merged and re-quantized onto the same grid ({len(quantized)} quantized Linears, "
                    f"{len(latents)} from their float weights; trained through that grid, so the "
                    "merged weights are exactly the trained ones)")
    else:
        exported = "merged into the weights"
    notes = [
        f"LoRA r={cfg.rank} alpha={cfg.alpha:g} on {len(linears)} Linears; loss {cfg.loss}"
        + (f" (kd weight {cfg.kd_weight:g}, T={cfg.temperature:g})" if cfg.loss == "mix" else ""),
        f"{run['steps']} steps, {run['tokens']:,} tokens in {run['seconds']:.0f} s "
        f"(stopped by {run['stopped_by']}); loss {run['loss_start']} -> {run['loss_end']}",
        exported,
    ]
    out = {"modules": per_module, **run, "export": cfg.export, "exported": exported,
           "step_budget": total_steps(cfg, seqlen), "seqlen": seqlen, "train_sequences": int(chunks.shape[0])}
    if ws.masks:
        nmv = pattern_violations(ws.model, [n for n in linears if n in ws.masks], ws.nm)
        out.update(pruned_weights_moved=zeros_moved, nm_violations=nmv if ws.nm else None)
        notes.append(f"pruned weights moved: {zeros_moved}" + (f"; {ws.nm[0]}:{ws.nm[1]} groups broken: {nmv}" if ws.nm else ""))
    out["notes"] = notes
    if before is not None:
        out["perplexity_before"] = before
    return out


StageFn = Callable[[Workspace, BaseModel], dict]

# The one registry: recipe stage ``type`` -> (config model, function).
STAGES: dict[str, tuple[type[BaseModel], StageFn]] = {
    "rtn": (RTNStage, run_rtn),
    "gptq": (GPTQStage, run_gptq),
    "awq": (AWQStage, run_awq),
    "magnitude": (MagnitudeStage, run_magnitude),
    "wanda": (WandaStage, run_wanda),
    "sparsegpt": (SparseGPTStage, run_sparsegpt),
    "structured": (StructuredStage, run_structured),
    "smoothquant": (SmoothQuantStage, run_smoothquant),
    "w8a8": (W8A8Stage, run_w8a8),
    "recover": (RecoverStage, run_recover),
}

QUANT_STAGES = {"rtn", "gptq", "awq", "w8a8"}
PRUNE_STAGES = {"magnitude", "wanda", "sparsegpt", "structured"}
