"""Magnitude pruning: the smallest |W|, unstructured or N:M (no data)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from optc.compress.schemes import parse_pattern
from optc.methods.base import LinearsConfig
from optc.methods.registry import Method, register

if TYPE_CHECKING:
    from optc.methods.workspace import Workspace


class MagnitudeStage(LinearsConfig):
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


def run_magnitude(ws: Workspace, cfg: MagnitudeStage) -> dict:
    import torch

    from optc.compress.masks import nm_mask, unstructured_mask
    from optc.errors import OptcError
    from optc.methods.common import apply_mask, sparsity_summary
    from optc.model.anatomy import select_linears, weight_2d

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


METHOD = register(Method(name="magnitude", config=MagnitudeStage, run=run_magnitude, kind="prune"))
