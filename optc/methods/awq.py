"""AWQ (Lin et al. 2023): activation-aware per-channel scales, then quantization."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from optc.methods.base import WeightQuantConfig
from optc.methods.registry import Method, register

if TYPE_CHECKING:
    import torch

    from optc.calibrate.sequential import LayerStep
    from optc.methods.workspace import Workspace


class AWQStage(WeightQuantConfig):
    """AWQ (Lin et al. 2023): activation-aware per-channel scales, then quantization."""

    type: Literal["awq"]
    grid: int = Field(20, gt=0, description="alpha values tried in [0, 1)")
    duo_scaling: bool = True
    clip: bool = Field(True, description="search a weight clipping ratio per group")
    refit_scales: bool = Field(True, description="least-squares scales for the final codes")
    observer: Literal["minmax", "mse"] = Field(
        "minmax", description="grids of the Linears that get no clip search (q/k, or clip: false)"
    )


def run_awq(ws: Workspace, cfg: AWQStage) -> dict:
    from optc.calibrate.stats import GramAccumulator
    from optc.compress.awq import apply_scale, awq_search_clip, awq_search_scale, resolve_mappings, scaled_gram
    from optc.compress.gptq import refit_scales
    from optc.compress.quant import choose_qparams, compute_qparams, fake_quantize
    from optc.methods.common import record_quantized, run_calibration
    from optc.model.anatomy import weight_2d

    per_module: dict[str, dict] = {}

    def solve(step: LayerStep) -> dict:
        mappings = resolve_mappings(step.layer)
        full = {m.prev_name: [f"{step.name}.{n}" for n in m.linear_names] for m in mappings}
        names = sorted({n for group in full.values() for n in group} | set(step.linears))
        names = [n for n in names if n in step.linears and cfg.scheme_for(n) is not None]
        dtype = ws.calibration.autocast_dtype()
        accs = step.collect(names, lambda n, m: GramAccumulator(weight_2d(m).shape[1], matmul_dtype=dtype, fold=step.fold))
        # One Gram matrix per distinct input (q/k/v share one accumulator, gate/up another).
        grams = {key: a.gram for key, a in {id(a): a for a in accs.values()}.items()}

        def clipped(name: str) -> bool:
            # Clipping q/k distorts attention logits more than it saves (as in AutoAWQ).
            return cfg.clip and not re.search(r"(q_proj|k_proj|c_attn)$", name)

        scales: dict[str, torch.Tensor] = {}
        ranges: dict[str, torch.Tensor] = {}
        for m in mappings:
            group = [n for n in full[m.prev_name] if n in accs]
            if len(group) != len(m.linears):
                continue  # some of these Linears stay float: scaling would not pay off
            scheme = cfg.scheme_for(group[0])
            if any(cfg.scheme_for(n) != scheme for n in group):
                continue
            acc = accs[group[0]]
            res = awq_search_scale(
                grams[id(acc)], acc.mean_abs, [weight_2d(step.linears[n]).detach() for n in group], scheme,
                grid=cfg.grid, duo_scaling=cfg.duo_scaling, clip=[clipped(n) for n in group],
            )
            apply_scale(m.prev, m.linears, res.scale)
            ranges.pop(f"{step.name}.{m.prev_name}", None)  # prev's rows just changed (up_proj)
            for n, rng in zip(group, res.clip):
                scales[n] = res.scale
                if rng is not None:  # already searched for exactly these weights and input
                    ranges[n] = rng
        for name in names:
            module = step.linears[name]
            scheme = cfg.scheme_for(name)
            w = weight_2d(module).detach()
            G = grams[id(accs[name])]
            if name in scales:  # the scaled weights see the input divided by s
                G = scaled_gram(G, scales[name])
            if clipped(name):
                rng = ranges[name] if name in ranges else awq_search_clip(G, w, scheme)
                p = compute_qparams(w, scheme, clip=rng)
            else:
                p = choose_qparams(w, scheme, cfg.observer)
            w_hat = fake_quantize(w, p)
            if cfg.refit_scales:
                w_hat, p = refit_scales(w.float(), G, w_hat, p)
            per_module[name] = record_quantized(ws, name, module, w_hat.to(w.dtype), p)
        return {}

    layers = run_calibration(ws, cfg, solve, "awq", records=per_module)
    return {"modules": per_module, "layers": layers}


METHOD = register(Method(
    name="awq", config=AWQStage, run=run_awq, kind="quantize", streams=True, saves_layers=True,
    accumulators=("gram", "mean_abs"),
))
