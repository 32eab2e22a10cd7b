"""Weights and activations together (W8A8 int8 or FP8, W4A4 NVFP4): weights by GPTQ or RTN, Linear
inputs fake-quantized from then on."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from optc.compress.schemes import ActivationScheme, QuantScheme
from optc.methods.base import WeightQuantConfig
from optc.methods.registry import Method, register
from optc.model.patterns import check_patterns

if TYPE_CHECKING:
    import torch

    from optc.calibrate.sequential import LayerStep
    from optc.methods.workspace import Workspace


class ActivationOverride(BaseModel):
    """Mixed precision for activations: Linears matching ``pattern`` get ``activations``
    (null: their inputs stay 16-bit, the weights are still quantized)."""

    model_config = ConfigDict(extra="forbid")

    pattern: str
    activations: ActivationScheme | None

    @field_validator("pattern")
    @classmethod
    def _valid_regex(cls, v: str) -> str:
        check_patterns([v], "activation override")
        return v


class W8A8Stage(WeightQuantConfig):
    """Weights (GPTQ or RTN; int8, FP8 or NVFP4) and activations (int8 or FP8 with static
    calibrated or dynamic scales, NVFP4 with dynamic group scales under a calibrated tensor
    scale), with activations really fake-quantized from then on."""

    type: Literal["w8a8"]
    scheme: QuantScheme = QuantScheme(bits=8, symmetric=True, group_size=None)
    method: Literal["gptq", "rtn"] = Field("gptq", description="weight rounding")
    weight_observer: Literal["minmax", "mse"] = "mse"
    dampening: float = Field(0.01, gt=0, description="GPTQ: fraction of mean diag(H) added to H")
    actorder: bool = Field(True, description="GPTQ: quantize columns by decreasing Hessian diagonal")
    activations: ActivationScheme = ActivationScheme()
    activation_overrides: list[ActivationOverride] = Field(default_factory=list)
    sample_tokens: int = Field(2048, gt=0, description="token rows kept per input to measure SQNR")

    @model_validator(mode="after")
    def _nvfp4_pairs(self) -> W8A8Stage:
        acts = [self.activations, *(o.activations for o in self.activation_overrides if o.activations)]
        if any(a.tensor_group for a in acts):
            for where, scheme, _ in self.planned_schemes():
                if scheme is not None and scheme.scale_format != "e4m3":
                    raise ValueError(f"NVFP4 activations run in NVFP4 GEMMs, whose weights are NVFP4 too; "
                                     f"{where} is {scheme.label()} (set scheme: {{type: float, bits: 4, "
                                     "group_size: 16}})")
        return self

    def activations_for(self, name: str) -> ActivationScheme | None:
        for o in self.activation_overrides:
            if re.search(o.pattern, name):
                return o.activations
        return self.activations


def run_w8a8(ws: Workspace, cfg: W8A8Stage) -> dict:
    from optc.calibrate.hessian import HessianAccumulator
    from optc.calibrate.observers import ActivationStats
    from optc.calibrate.observers import calibration_summary, observer_ranges, solve_input_quant
    from optc.compress.actquant import attach_input_quant
    from optc.compress.quant import choose_qparams, fake_quantize
    from optc.methods.common import record_quantized, run_calibration
    from optc.methods.gptq import solve_gptq
    from optc.model.anatomy import weight_2d

    per_module: dict[str, dict] = {}
    gptq = cfg.method == "gptq"

    def solve(step: LayerStep) -> dict:
        names = [n for n in step.linears if cfg.scheme_for(n) is not None]

        def make(_name: str, module: torch.nn.Module) -> ActivationStats:
            k = weight_2d(module).shape[1]
            extra = (HessianAccumulator(k, fold=step.fold),) if gptq else ()
            return ActivationStats(
                k, step.tokens, averaging_constant=cfg.activations.averaging_constant,
                sample_tokens=cfg.sample_tokens, seed=ws.calibration.seed, first_row=step.row_offset,
                extra=extra,
            )

        accs = step.collect(names, make)
        solved = dict(solve_gptq(
            step, names, {n: accs[n].extra[0] for n in names}, cfg.scheme_for, ws.masks,
            dampening=cfg.dampening, actorder=cfg.actorder, observer=cfg.weight_observer,
        )) if gptq else {}
        ranges: dict[tuple[int, ActivationScheme], dict] = {}  # shared inputs: solved once
        for name in names:
            module, acc, scheme = step.linears[name], accs[name], cfg.scheme_for(name)
            w = weight_2d(module).detach().clone()
            if gptq:
                w_hat, p = solved[name].weight, solved[name].params
            else:
                p = choose_qparams(w, scheme, cfg.weight_observer)
                w_hat = fake_quantize(w, p)
            stats = record_quantized(ws, name, module, w_hat, p)
            act = cfg.activations_for(name)
            if act is not None:
                iq = solve_input_quant(act, acc)
                attach_input_quant(module, iq)
                stats.update(calibration_summary(iq, acc, w, w_hat))
                if not act.dynamic:
                    key = (id(acc), act)
                    if key not in ranges:
                        ranges[key] = observer_ranges(acc, act)
                    stats["ranges"] = ranges[key]
            else:
                stats["activations"] = "16-bit"
            per_module[name] = stats
        return {}

    layers = run_calibration(ws, cfg, solve, "w8a8")
    return {"modules": per_module, "layers": layers, "notes": _w8a8_notes(per_module)}


def _w8a8_notes(per_module: dict[str, dict]) -> list[str]:
    """One line per activation scheme used, and the Linear that loses most."""
    schemes: dict[str, int] = {}
    for m in per_module.values():
        schemes[m["activations"]] = schemes.get(m["activations"], 0) + 1
    notes = [f"activations {label} on {count} Linears" for label, count in schemes.items()]
    sqnr = {n: m["output_sqnr_db"] for n, m in per_module.items() if m.get("output_sqnr_db") is not None}
    if sqnr:
        worst = min(sqnr, key=sqnr.get)
        notes.append(
            f"output SQNR mean {sum(sqnr.values()) / len(sqnr):.1f} dB, "
            f"worst {worst} {sqnr[worst]:.1f} dB"
        )
    return notes


METHOD = register(Method(
    name="w8a8", config=W8A8Stage, run=run_w8a8, kind="quantize",
    accumulators=("activation_stats", "hessian"),
))
