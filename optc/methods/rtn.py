"""Round-to-nearest weight quantization (no data)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from optc.methods.base import WeightQuantConfig
from optc.methods.registry import Method, register

if TYPE_CHECKING:
    from optc.calibrate.sequential import LayerStep
    from optc.methods.workspace import Workspace


class RTNStage(WeightQuantConfig):
    """Round-to-nearest weight quantization (no data)."""

    type: Literal["rtn"]
    observer: Literal["minmax", "mse"] = "minmax"


def run_rtn(ws: Workspace, cfg: RTNStage) -> dict:
    import torch

    from optc.calibrate.sequential import run_sequential
    from optc.compress.quant import choose_qparams, fake_quantize
    from optc.methods.common import record_quantized
    from optc.model.anatomy import weight_2d

    per_module: dict[str, dict] = {}

    def solve(step: LayerStep) -> dict:
        with torch.no_grad():
            for name, module in step.linears.items():
                scheme = cfg.scheme_for(name)
                if scheme is not None:
                    w = weight_2d(module).detach()
                    p = choose_qparams(w, scheme, cfg.observer)
                    per_module[name] = record_quantized(ws, name, module, fake_quantize(w, p), p)
        return {}

    # Layer by layer through the runner with no calibration samples (no forward runs), so a
    # streamed model is read one layer at a time like for the calibrated methods.
    run_sequential(
        ws.model, torch.zeros(0, 1, dtype=torch.long), solve, targets=cfg.targets, ignore=cfg.ignore,
        batch_size=1, device=ws.device, progress=ws.progress, description="rtn", store=ws.store,
        records=per_module,
    )
    return {"modules": per_module}


METHOD = register(Method(name="rtn", config=RTNStage, run=run_rtn, kind="quantize", streams=True))
