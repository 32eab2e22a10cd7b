"""Magnitude pruning: the smallest |W|, unstructured or N:M (no data)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from optc.compress.schemes import parse_pattern
from optc.methods.base import LinearsConfig
from optc.methods.registry import Method, register

if TYPE_CHECKING:
    import torch

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
    nm = parse_pattern(cfg.pattern) if cfg.pattern else None
    threshold = _global_threshold(linears, cfg.sparsity) if cfg.scope == "global" and nm is None else None
    # One Linear's |W| at a time: scores for every Linear at once are a float copy of all the
    # decoder weights, which put the run's peak RSS above the calibrated methods'.
    per_module = {}
    for name, module in linears.items():
        s = weight_2d(module).detach().abs()
        if nm is not None:
            try:
                mask = nm_mask(s, *nm)
            except OptcError as exc:
                raise OptcError(f"{name}: {exc}") from exc
        elif threshold is not None:
            mask = s > threshold
        else:
            mask = unstructured_mask(s, cfg.sparsity)
        del s
        with torch.no_grad():
            per_module[name] = apply_mask(ws, name, module, mask)
    ws.nm = nm or ws.nm
    return {"modules": per_module, **sparsity_summary(ws.model, linears, nm)}


def _global_threshold(linears: dict, sparsity: float) -> torch.Tensor:
    """The |W| below which ``sparsity`` of all the Linears' weights fall (one threshold for all)."""
    import torch

    from optc.model.anatomy import weight_2d

    flat = torch.cat([weight_2d(m).detach().abs().flatten() for m in linears.values()])
    k = int(flat.numel() * sparsity)
    return flat.kthvalue(k).values if k else flat.min() - 1


METHOD = register(Method(name="magnitude", config=MagnitudeStage, run=run_magnitude, kind="prune"))
