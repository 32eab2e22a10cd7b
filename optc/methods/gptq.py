"""GPTQ (Frantar et al. 2022): Hessian-aware rounding with error propagation."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from optc.methods.base import WeightQuantConfig
from optc.methods.registry import Method, register

if TYPE_CHECKING:
    import torch

    from optc.calibrate.hessian import HessianAccumulator
    from optc.calibrate.sequential import LayerStep
    from optc.compress.gptq import GPTQResult
    from optc.compress.schemes import QuantScheme
    from optc.methods.workspace import Workspace


class GPTQStage(WeightQuantConfig):
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
        "calibrated on the outputs of the ones already quantized (a partial layer forward per group, up to its input)",
    )

    def permuted_groups(self) -> bool:
        return self.groups == "permuted" and self.actorder


def solve_gptq(
    step: LayerStep,
    names: list[str],
    hessians: dict[str, HessianAccumulator],
    scheme_for: Callable[[str], QuantScheme | None],
    masks: Mapping[str, torch.Tensor],
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
    import torch

    from optc.compress.gptq import GPTQResult, gptq_quantize
    from optc.compress.quant import QuantParams
    from optc.memory import trim
    from optc.model.anatomy import weight_2d

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


def run_gptq(ws: Workspace, cfg: GPTQStage) -> dict:
    from optc.calibrate.hessian import HessianAccumulator
    from optc.methods.common import collect_in_order, record_quantized, run_calibration
    from optc.model.anatomy import weight_2d

    per_module: dict[str, dict] = {}

    def solve(step: LayerStep) -> dict:
        names = [n for n in step.linears if cfg.scheme_for(n) is not None]
        dtype = ws.calibration.autocast_dtype()

        def make(_name: str, module: torch.nn.Module) -> HessianAccumulator:
            return HessianAccumulator(weight_2d(module).shape[1], matmul_dtype=dtype, fold=step.fold)

        groups = collect_in_order(step, names, make) if cfg.sequential else [(names, step.collect(names, make))]
        for group, accs in groups:
            # One result at a time, recorded before the next solve: the largest (down_proj,
            # last) then runs with no other layer's result or Hessian held.
            for name, res in solve_gptq(
                step, group, accs, cfg.scheme_for, ws.masks,
                block_size=cfg.block_size, dampening=cfg.dampening, actorder=cfg.actorder,
                groups=cfg.groups, observer=cfg.observer, refit=cfg.refit_scales,
            ):
                stats = record_quantized(ws, name, step.linears[name], res.weight, res.params)
                per_module[name] = {**stats, "gptq_loss": round(res.loss, 6)}
                del res
        return {}

    layers = run_calibration(ws, cfg, solve, "gptq", records=per_module)
    return {"modules": per_module, "layers": layers}


METHOD = register(Method(
    name="gptq", config=GPTQStage, run=run_gptq, kind="quantize", streams=True, saves_layers=True,
    accumulators=("hessian",),
))
