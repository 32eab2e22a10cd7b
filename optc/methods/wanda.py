"""Wanda (Sun et al. 2023): prune by |W| times input feature norm, per output row."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from optc.methods._calibrated_prune import CalibratedPruneConfig
from optc.methods.registry import Method, register

if TYPE_CHECKING:
    from optc.methods.workspace import Workspace


class WandaStage(CalibratedPruneConfig):
    """Wanda (Sun et al. 2023): prune by |W| times input feature norm, per output row."""

    type: Literal["wanda"]


def run_wanda(ws: Workspace, cfg: WandaStage) -> dict:
    from optc.calibrate.stats import FeatureNormAccumulator
    from optc.compress.wanda import wanda_mask
    from optc.methods._calibrated_prune import run_calibrated_prune

    def prune(_name, _module, w, acc, sparsity, nm, keep):
        return wanda_mask(w, acc.sq_norm, sparsity=sparsity, nm=nm, keep=keep), {}

    return run_calibrated_prune(ws, cfg, lambda k, _step: FeatureNormAccumulator(k), prune)


METHOD = register(Method(
    name="wanda", config=WandaStage, run=run_wanda, kind="prune", accumulators=("feature_norm",),
))
