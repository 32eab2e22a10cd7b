"""Recipe stages: each stage type maps to (config model, function) in :data:`STAGES`.

A stage function takes the :class:`Workspace` (the model being compressed plus what earlier
stages recorded) and its validated config, changes the model in place, and returns statistics
for the report. The kernels themselves live in ``optc.compress`` as pure tensor functions.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from optc.calibrate.hessian import HessianAccumulator
from optc.calibrate.modules import check_patterns, select_linears, set_weight_2d, weight_2d
from optc.calibrate.sequential import LayerStep, run_sequential
from optc.calibrate.stats import InputSampler
from optc.compress.awq import apply_scale, awq_search_clip, awq_search_scale, resolve_mappings
from optc.compress.gptq import gptq_quantize
from optc.compress.masks import nm_mask, parse_pattern, unstructured_mask
from optc.compress.quant import (
    QuantParams,
    QuantScheme,
    choose_qparams,
    compute_qparams,
    fake_quantize,
)
from optc.data import CalibrationConfig
from optc.errors import OptcError
from optc.progress import NullProgress, Progress

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
    linears = select_linears(ws.model, cfg.targets, cfg.ignore)
    per_module = {}
    with torch.no_grad(), ws.progress.task("rtn", total=len(linears)) as advance:
        for name, module in linears.items():
            scheme = cfg.scheme_for(name)
            if scheme is not None:
                w = weight_2d(module).detach()
                p = choose_qparams(w, scheme, cfg.observer)
                per_module[name] = _record_quantized(ws, name, module, fake_quantize(w, p), p)
            advance()
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


def run_gptq(ws: Workspace, cfg: GPTQStage) -> dict:
    per_module: dict[str, dict] = {}

    def solve(step: LayerStep) -> dict:
        names = [n for n in step.linears if cfg.scheme_for(n) is not None]
        accs = step.collect(names, lambda n, m: HessianAccumulator(weight_2d(m).shape[1]))
        for name in names:
            module = step.linears[name]
            res = gptq_quantize(
                weight_2d(module).detach(), accs[name].H, cfg.scheme_for(name),
                block_size=cfg.block_size, dampening=cfg.dampening, actorder=cfg.actorder,
                groups=cfg.groups, observer=cfg.observer, name=name, refit=cfg.refit_scales,
            )
            stats = _record_quantized(ws, name, module, res.weight, res.params)
            per_module[name] = {**stats, "gptq_loss": round(res.loss, 6)}
        return {}

    layers = _run_calibration(ws, cfg, solve, "gptq")
    return {"modules": per_module, "layers": layers}


# --- AWQ ---------------------------------------------------------------------------------


class AWQStage(_WeightQuantStage):
    """AWQ (Lin et al. 2023): activation-aware per-channel scales, then quantization."""

    type: Literal["awq"]
    grid: int = Field(20, gt=0, description="alpha values tried in [0, 1)")
    duo_scaling: bool = True
    clip: bool = Field(True, description="search a weight clipping ratio per group")
    sample_tokens: int = Field(8192, gt=0, description="token rows kept per input for the search")
    observer: Literal["minmax", "mse"] = "minmax"


def run_awq(ws: Workspace, cfg: AWQStage) -> dict:
    per_module: dict[str, dict] = {}

    def solve(step: LayerStep) -> dict:
        mappings = resolve_mappings(step.layer)
        full = {m.prev_name: [f"{step.name}.{n}" for n in m.linear_names] for m in mappings}
        names = sorted({n for group in full.values() for n in group} | set(step.linears))
        names = [n for n in names if n in step.linears and cfg.scheme_for(n) is not None]
        total = step.tokens
        accs = step.collect(
            names,
            lambda n, m: InputSampler(weight_2d(m).shape[1], total, cfg.sample_tokens, ws.calibration.seed),
        )
        scales: dict[str, torch.Tensor] = {}
        for m in mappings:
            group = [n for n in full[m.prev_name] if n in accs]
            if len(group) != len(m.linears):
                continue  # some of these Linears stay float: scaling would not pay off
            scheme = cfg.scheme_for(group[0])
            if any(cfg.scheme_for(n) != scheme for n in group):
                continue
            acc = accs[group[0]]
            res = awq_search_scale(
                acc.sample, [weight_2d(step.linears[n]).detach() for n in group], scheme,
                grid=cfg.grid, duo_scaling=cfg.duo_scaling, x_mean=acc.mean_abs,
            )
            apply_scale(m.prev, m.linears, res.scale)
            for n in group:
                scales[n] = res.scale
        for name in names:
            module = step.linears[name]
            scheme = cfg.scheme_for(name)
            w = weight_2d(module).detach()
            clip: torch.Tensor | float = 1.0
            # Clipping q/k distorts attention logits more than it saves (as in AutoAWQ).
            if cfg.clip and not re.search(r"(q_proj|k_proj|c_attn)$", name):
                x = accs[name].sample
                if name in scales:
                    x = x / scales[name]
                clip = awq_search_clip(x, w, scheme)
            p = compute_qparams(w, scheme, clip=clip)
            per_module[name] = _record_quantized(ws, name, module, fake_quantize(w, p), p)
        return {}

    layers = _run_calibration(ws, cfg, solve, "awq")
    return {"modules": per_module, "layers": layers}


def _run_calibration(ws: Workspace, cfg: _Stage, solve, description: str) -> list[dict]:
    return run_sequential(
        ws.model, ws.calibration_ids(), solve,
        targets=cfg.targets, ignore=cfg.ignore,
        batch_size=ws.calibration.resolved_batch_size(), device=ws.device,
        progress=ws.progress, description=description,
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
    return {"modules": per_module}


StageFn = Callable[[Workspace, BaseModel], dict]

# The one registry: recipe stage ``type`` -> (config model, function).
STAGES: dict[str, tuple[type[BaseModel], StageFn]] = {
    "rtn": (RTNStage, run_rtn),
    "gptq": (GPTQStage, run_gptq),
    "awq": (AWQStage, run_awq),
    "magnitude": (MagnitudeStage, run_magnitude),
}

QUANT_STAGES = {"rtn", "gptq", "awq"}
PRUNE_STAGES = {"magnitude"}
