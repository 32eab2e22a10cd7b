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

from optc.calibrate.modules import check_patterns, select_linears, set_weight_2d, weight_2d
from optc.compress.masks import nm_mask, parse_pattern, unstructured_mask
from optc.compress.quant import QuantParams, QuantScheme, choose_qparams, fake_quantize
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
    w = weight_2d(module)
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
    "magnitude": (MagnitudeStage, run_magnitude),
}

QUANT_STAGES = {"rtn"}
PRUNE_STAGES = {"magnitude"}
