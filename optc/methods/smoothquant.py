"""SmoothQuant (Xiao et al. 2022): activation outliers migrated into the weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from optc.methods.base import LinearsConfig
from optc.methods.registry import Method, register

if TYPE_CHECKING:
    from optc.calibrate.sequential import LayerStep
    from optc.methods.workspace import Workspace


class SmoothQuantStage(LinearsConfig):
    """SmoothQuant (Xiao et al. 2022): migrate activation outliers into the weights, folded
    into the preceding norm so the float model is unchanged."""

    type: Literal["smoothquant"]
    alpha: float = Field(0.5, ge=0, le=1, description="migration strength, in [0, 1]")
    scope: Literal["norms", "all"] = Field(
        "norms", description="norms: fold into the norms before q/k/v and the MLP (the paper); "
        "all: also v -> o and up -> down"
    )


def run_smoothquant(ws: Workspace, cfg: SmoothQuantStage) -> dict:
    from optc.calibrate.observers import MinMaxObserver
    from optc.compress.smoothquant import fold_smoothing, smoothing_mappings, smoothquant_scale
    from optc.methods.common import run_calibration
    from optc.model.anatomy import weight_2d

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

    layers = run_calibration(ws, cfg, solve, "smoothquant")
    notes = []
    if per_module:
        ratio = [v["act_absmax"] / max(v["act_absmax_smoothed"], 1e-12) for v in per_module.values()]
        notes.append(f"alpha {cfg.alpha:g}; input abs-max shrunk {min(ratio):.1f}x to {max(ratio):.1f}x")
    return {"modules": per_module, "layers": layers, "notes": notes}


METHOD = register(Method(
    name="smoothquant", config=SmoothQuantStage, run=run_smoothquant, kind="transform", accumulators=("minmax",),
))
