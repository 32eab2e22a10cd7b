"""Calibrated unstructured / N:M pruning shared by Wanda and SparseGPT: the config fields both
take, OWL's per-layer allocation and the layer-by-layer run around a method's own mask choice."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from optc.compress.schemes import parse_pattern
from optc.methods.base import LinearsConfig
from optc.model.patterns import check_patterns

if TYPE_CHECKING:
    import torch

    from optc.calibrate.sequential import LayerStep
    from optc.methods.workspace import Workspace

# A method's mask choice: (Linear name, module, weight [N, K], its accumulator, sparsity, N:M or
# None, the mask kept from an earlier stage or None) -> (mask, extra per-Linear stats). It may
# rewrite the weight (SparseGPT's reconstruction); the mask is applied after it.
Prune = Callable[..., "tuple[torch.Tensor, dict]"]


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


class CalibratedPruneConfig(LinearsConfig):
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
        "outputs of the ones already pruned (a partial layer forward per group, up to its input)",
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


def _owl_allocation(ws: Workspace, cfg: CalibratedPruneConfig) -> dict[str, float]:
    """OWL per-layer sparsity from outlier ratios of the float model's Wanda scores."""
    from optc.calibrate.sequential import run_sequential
    from optc.calibrate.stats import FeatureNormAccumulator
    from optc.compress.owl import outlier_ratio, owl_sparsities
    from optc.compress.wanda import wanda_scores
    from optc.model.anatomy import weight_2d

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


def run_calibrated_prune(
    ws: Workspace, cfg: CalibratedPruneConfig, make: Callable[[int, LayerStep], Any], prune: Prune
) -> dict:
    """Prune layer by layer: ``make(in_features, step)`` builds a Linear's accumulator, ``prune``
    chooses its mask from it (the method's own part)."""
    from optc.errors import OptcError
    from optc.methods.common import apply_mask, collect_in_order, run_calibration, sparsity_summary
    from optc.model.anatomy import select_linears, weight_2d

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
        def accumulator(_name: str, module: torch.nn.Module):
            return make(weight_2d(module).shape[1], step)

        names = list(step.linears)
        groups = (collect_in_order(step, names, accumulator) if cfg.sequential
                  else [(names, step.collect(names, accumulator))])
        for group, accs in groups:
            for name in group:
                module = step.linears[name]
                w = weight_2d(module).detach()
                sp = sparsity_for(name, step.name)
                keep = ws.masks.get(name)
                mask, extra = prune(name, module, w, accs[name], sp, nm, keep)
                per_module[name] = {**apply_mask(ws, name, module, mask), **extra}
        return {"target_sparsity": None if nm else round(layer_sparsity.get(step.name, cfg.sparsity), 6)}

    layers = run_calibration(ws, cfg, solve, cfg.type)
    ws.nm = nm or ws.nm
    return {"modules": per_module, "layers": layers, **sparsity_summary(ws.model, linears, nm)}
