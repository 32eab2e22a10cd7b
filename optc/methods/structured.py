"""Structured pruning: whole attention heads, key/value groups and MLP channels removed."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from optc.methods.registry import Method, register

if TYPE_CHECKING:
    from optc.calibrate.sequential import LayerStep
    from optc.methods.workspace import Workspace


class StructuredStage(BaseModel):
    """Remove whole attention heads and MLP channels; every layer loses the same number."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["structured"]
    heads: float = Field(0.0, ge=0, lt=1, description="fraction of query heads removed (under "
                         "GQA the same number from every key/value group)")
    kv_heads: float = Field(0.0, ge=0, lt=1, description="fraction of key/value groups removed "
                            "with all their query heads")
    mlp: float = Field(0.0, ge=0, lt=1, description="fraction of MLP intermediate channels removed")
    channel_multiple: int = Field(1, gt=0, description="round kept MLP channels down to a multiple of this")
    reconstruct: bool = Field(True, description="least-squares refit of the output projections")
    dampening: float = Field(0.01, gt=0, description="fraction of mean diag(H) added for the refit")
    latency_tokens: int = Field(256, ge=0, description="tokens of the before/after CPU latency check (0: skip)")

    @model_validator(mode="after")
    def _something_to_remove(self):
        if not (self.heads or self.kv_heads or self.mlp):
            raise ValueError("structured pruning needs heads, kv_heads or mlp above 0")
        return self


def run_structured(ws: Workspace, cfg: StructuredStage) -> dict:
    import torch

    from optc.calibrate.hessian import HessianAccumulator
    from optc.calibrate.sequential import run_sequential
    from optc.compress.structured import (
        apply_plan_to_config,
        channel_importance,
        forward_latency,
        head_importance,
        keep_lowest_removed,
        plan_structured,
        prune_attention_heads,
        prune_mlp_channels,
        reconstruct,
        select_heads,
    )
    from optc.errors import OptcError
    from optc.methods.common import apply_mask
    from optc.model.anatomy import find_decoder_layers, weight_2d

    model = ws.model
    if ws.qparams:
        raise OptcError("structured pruning must come before quantization (it reshapes the Linears)")
    prefix, layers = find_decoder_layers(model)
    plan = plan_structured(model, layers[0], heads=cfg.heads, kv_heads=cfg.kv_heads, mlp=cfg.mlp,
                           channel_multiple=cfg.channel_multiple)
    before = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    latency_before = forward_latency(model, cfg.latency_tokens) if cfg.latency_tokens else None
    outputs = ([plan.attention.o] if plan.attention else []) + ([plan.mlp.down] if plan.mlp else [])

    def slice_masks(step: LayerStep, surgery) -> None:
        for rel, idx in [*((r, ("rows", i)) for r, i in surgery.rows.items()),
                         *((r, ("cols", i)) for r, i in surgery.cols.items())]:
            name = f"{step.name}.{rel}"
            if name in ws.masks:
                axis, keep = idx
                mask = ws.masks.pop(name)
                mask = mask[keep] if axis == "rows" else mask[:, keep]
                apply_mask(ws, name, step.layer.get_submodule(rel), mask)

    def solve(step: LayerStep) -> dict:
        stats: dict = {}
        layer = step.layer
        for rel in outputs:  # attention first: the MLP then calibrates on the pruned attention
            name = f"{step.name}.{rel}"
            dtype = ws.calibration.autocast_dtype()
            H = step.collect(
                [name], lambda n, m: HessianAccumulator(weight_2d(m).shape[1], matmul_dtype=dtype, fold=step.fold)
            )[name].H
            W = weight_2d(layer.get_submodule(rel)).detach()
            if plan.attention is not None and rel == plan.attention.o:
                imp = head_importance(W, H, plan.head_dim)
                keep_q, keep_kv = select_heads(imp, plan.kv_heads, plan.remove_per_group, plan.remove_groups)
                cols = keep_q[:, None] * plan.head_dim + torch.arange(plan.head_dim)[None, :]
                new_w = reconstruct(W, H, cols.flatten(), cfg.dampening) if cfg.reconstruct else None
                surgery = prune_attention_heads(layer, plan.attention, keep_q, keep_kv, new_w)
                stats["heads_kept"] = keep_q.tolist()
            else:
                imp = channel_importance(W, H)
                keep = keep_lowest_removed(imp, plan.remove_channels)
                new_w = reconstruct(W, H, keep, cfg.dampening) if cfg.reconstruct else None
                surgery = prune_mlp_channels(layer, plan.mlp, keep, new_w)
                stats["mlp_importance_removed"] = round(float(imp.sum() - imp[keep].sum()) / float(imp.sum().clamp_min(1e-12)), 6)
            slice_masks(step, surgery)
        return stats

    layer_stats = run_sequential(
        model, ws.calibration_ids(), solve, targets=[re.escape(o) + "$" for o in outputs], ignore=[],
        batch_size=ws.calibration.resolved_batch_size(ws.device), device=ws.device,
        autocast=ws.calibration.autocast_dtype(), progress=ws.progress, description="structured",
    )
    config = apply_plan_to_config(model.config, plan)
    after = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    out = {
        "config": config,
        "parameters_before": before,
        "parameters_after": after,
        "parameters_removed": before - after,
        "parameters_removed_fraction": round((before - after) / before, 6),
        "layers": layer_stats,
    }
    shapes = ", ".join(f"{k} {v}" for k, v in config.items() if k != "head_dim")
    note = f"removed {before - after:,} parameters ({100 * (before - after) / before:.1f}%): {shapes}"
    if latency_before is not None:
        latency_after = forward_latency(model, cfg.latency_tokens)
        out.update(latency_tokens=cfg.latency_tokens, latency_ms_before=round(1e3 * latency_before, 2),
                   latency_ms_after=round(1e3 * latency_after, 2),
                   speedup=round(latency_before / latency_after, 3))
        note += (f"; CPU forward of {cfg.latency_tokens} tokens {1e3 * latency_before:.0f} -> "
                 f"{1e3 * latency_after:.0f} ms ({out['speedup']:.2f}x)")
    out["notes"] = [note]
    return out


METHOD = register(Method(
    name="structured", config=StructuredStage, run=run_structured, kind="prune", accumulators=("hessian",),
))
