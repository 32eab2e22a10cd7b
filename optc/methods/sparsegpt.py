"""SparseGPT (Frantar & Alistarh 2023): OBS mask selection with Hessian reconstruction."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from optc.methods._calibrated_prune import CalibratedPruneConfig
from optc.methods.registry import Method, register

if TYPE_CHECKING:
    from optc.methods.workspace import Workspace


class SparseGPTStage(CalibratedPruneConfig):
    """SparseGPT (Frantar & Alistarh 2023): OBS mask selection with Hessian reconstruction."""

    type: Literal["sparsegpt"]
    block_size: int = Field(128, gt=0, description="columns whose mask is chosen together")
    dampening: float = Field(0.01, gt=0, description="fraction of mean diag(H) added to H")
    shrinkage: float = Field(
        0.0, ge=0, le=1, description="shrink the input Hessian toward its diagonal, (1 - a) H + a diag(H), "
        "before the sweep and the refit: less reliance on the calibration text's correlations",
    )
    refit: bool = Field(
        False, description="after the sweep, re-solve the kept weights exactly (least squares "
        "on the layer's inputs) for the final mask",
    )


def run_sparsegpt(ws: Workspace, cfg: SparseGPTStage) -> dict:
    from optc.calibrate.hessian import HessianAccumulator
    from optc.compress.sparsegpt import masked_least_squares, shrink_hessian, sparsegpt_prune
    from optc.methods._calibrated_prune import run_calibrated_prune
    from optc.model.anatomy import set_weight_2d

    def make(k, step):
        return HessianAccumulator(k, matmul_dtype=ws.calibration.autocast_dtype(), fold=step.fold)

    def prune(name, module, w, acc, sparsity, nm, keep):
        H = shrink_hessian(acc.H, cfg.shrinkage)  # shrinkage 0: H's values exactly
        res = sparsegpt_prune(
            w, H, sparsity=sparsity, nm=nm, keep=keep, block_size=cfg.block_size,
            dampening=cfg.dampening, name=name,
        )
        new_w = res.weight
        if cfg.refit:
            new_w = masked_least_squares(
                w, H, res.mask, start=new_w, dampening=cfg.dampening)
        set_weight_2d(module, new_w)
        return res.mask, {"sparsegpt_loss": round(res.loss, 6)}

    return run_calibrated_prune(ws, cfg, make, prune)


METHOD = register(Method(
    name="sparsegpt", config=SparseGPTStage, run=run_sparsegpt, kind="prune", accumulators=("hessian",),
))
