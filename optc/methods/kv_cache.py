"""KV-cache quantization: one static FP8 (or int8) scale per decoder layer for the keys and
one for the values, calibrated on the model as the earlier stages left it, fake-quantized from
then on (compressed-tensors' ``kv_cache_scheme``; vLLM's ``k_scale`` / ``v_scale``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from optc.compress.schemes import KVCacheScheme
from optc.methods.registry import Method, register

if TYPE_CHECKING:
    import torch

    from optc.calibrate.sequential import LayerStep
    from optc.methods.workspace import Workspace


class KVCacheStage(BaseModel):
    """Quantize the attention's key/value cache with calibrated per-layer scales."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["kv_cache"]
    scheme: KVCacheScheme = KVCacheScheme()
    sample_tokens: int = Field(2048, gt=0, description="cached rows kept per layer to measure SQNR")


def check_kv_cache(model: torch.nn.Module, _cfg: KVCacheStage) -> None:
    """Refuse, before any work, a model whose attention optc cannot hook."""
    from optc.errors import OptcError
    from optc.model.anatomy import CACHE_ARGUMENTS, attention_modules, find_decoder_layers

    prefix, layers = find_decoder_layers(model)
    if not attention_modules(layers[0]):
        raise OptcError(
            f"kv_cache: no module of {type(layers[0]).__name__} ({prefix}.0) takes a KV cache argument "
            f"({', '.join(CACHE_ARGUMENTS)}), so optc cannot hook its keys and values on this architecture")


def run_kv_cache(ws: Workspace, cfg: KVCacheStage) -> dict:
    import math
    from contextlib import ExitStack

    from optc.calibrate.observers import ActivationStats, observer_ranges, solve_input_quant
    from optc.calibrate.sequential import run_sequential
    from optc.compress.actquant import sqnr_db
    from optc.compress.kvquant import KVQuant, attach_kv_quant, observe_kv, quantize_kv
    from optc.errors import OptcError
    from optc.model.anatomy import attention_modules
    from optc.model.forward import StopForward

    act = cfg.scheme.activation_scheme()
    per_layer: dict[str, dict] = {}

    def solve(step: LayerStep) -> dict:
        attns = attention_modules(step.layer, step.name)
        accs: dict[str, ActivationStats] = {}
        seen: set[str] = set()

        def feeder(name: str):
            def feed(k: torch.Tensor, v: torch.Tensor) -> None:
                for part, x in (("k", k), ("v", v)):
                    # [batch, kv_heads, tokens, head_dim] -> one row per token
                    rows = x.detach().transpose(1, 2).reshape(-1, x.shape[1] * x.shape[3])
                    acc = accs.get(f"{name}.{part}")
                    if acc is None:
                        acc = accs[f"{name}.{part}"] = ActivationStats(
                            rows.shape[1], step.tokens, averaging_constant=act.averaging_constant,
                            sample_tokens=cfg.sample_tokens, seed=ws.calibration.seed, first_row=step.row_offset)
                    acc.add(rows)
                seen.add(name)
                if len(seen) == len(attns):  # what follows the last cache write is not needed
                    seen.clear()
                    raise StopForward
            return feed

        with ExitStack() as stack:
            calls = {n: stack.enter_context(observe_kv(m, feeder(n))) for n, m in attns.items()}
            step.observe(accs)
        for name, module in attns.items():
            if not calls[name][0]:
                raise OptcError(f"{name} ({type(module).__name__}) never writes its KV cache through the cache "
                                "argument, so optc cannot hook its keys and values on this architecture")
            k_iq = solve_input_quant(act, accs[f"{name}.k"])
            v_iq = solve_input_quant(act, accs[f"{name}.v"])
            kq = KVQuant(cfg.scheme, k_iq.scale, v_iq.scale)
            attach_kv_quant(module, kq)
            stats: dict = {"cache": cfg.scheme.label()}
            for part, scale in (("k", kq.k_scale), ("v", kq.v_scale)):
                acc = accs[f"{name}.{part}"]
                x = acc.sampler.sample.float()
                stats[f"{part}_absmax"] = round(acc.absmax, 6)
                stats[f"{part}_scale"] = float(scale)
                db = sqnr_db(x, quantize_kv(x, scale, cfg.scheme))
                stats[f"{part}_sqnr_db"] = round(db, 3) if math.isfinite(db) else None
                stats[f"{part}_ranges"] = observer_ranges(acc, act)
            per_layer[name] = stats
        return {}

    run_sequential(
        ws.model, ws.calibration_ids(), solve, targets=[".*"], ignore=[],
        batch_size=ws.calibration.resolved_batch_size(ws.device), device=ws.device,
        autocast=ws.calibration.autocast_dtype(), progress=ws.progress, description="kv cache", store=ws.store,
    )
    return {"attention": per_layer, "notes": _notes(per_layer, cfg.scheme)}


def _notes(per_layer: dict[str, dict], scheme: KVCacheScheme) -> list[str]:
    if not per_layer:
        return []
    notes = [f"KV cache {scheme.label()} on {len(per_layer)} attention layers"]
    for part, what in (("k", "keys"), ("v", "values")):
        sqnr = {n: s[f"{part}_sqnr_db"] for n, s in per_layer.items() if s[f"{part}_sqnr_db"] is not None}
        if not sqnr:
            continue
        worst = min(sqnr, key=sqnr.get)
        notes.append(f"{what} SQNR mean {sum(sqnr.values()) / len(sqnr):.1f} dB, worst {worst} {sqnr[worst]:.1f} dB")
    return notes


METHOD = register(Method(
    name="kv_cache", config=KVCacheStage, run=run_kv_cache, kind="cache", check=check_kv_cache,
    accumulators=("activation_stats",),
))
