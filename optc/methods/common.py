"""Glue the methods share: recording a quantized Linear, the calibration run, masks and their
summary, the in-order collection of true-sequential runs.

Imports torch: the method modules import it inside their ``run`` functions, so the registry
and the recipe schema stay torch-free.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator

import torch

from optc.calibrate.sequential import LayerStep, run_sequential
from optc.compress.masks import nm_violations
from optc.methods.base import LinearsConfig
from optc.methods.workspace import Workspace
from optc.model.anatomy import find_decoder_layers, set_weight_2d, weight_2d

log = logging.getLogger(__name__)


@functools.cache
def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def training_dtype(choice: str, device: str) -> torch.dtype | None:
    """bfloat16 for matmuls whose rounding the result tolerates (a training loop's, an estimate's),
    or None (float32): decided from the hardware, never by timing. On CPUs without AMX bfloat16
    matmuls are no faster than float32 ones."""
    if choice == "bfloat16" or (choice == "auto" and (torch.device(device).type != "cpu" or _has_amx())):
        return torch.bfloat16
    return None


@contextlib.contextmanager
def activation_checkpointing(model: torch.nn.Module, enabled: bool = True) -> Iterator[bool]:
    """Within: the model's decoder layers recompute their activations in the backward from each
    layer's input (a forward more, a whole model's activations not held), where the model
    supports it. Yields whether it is on."""
    on = enabled and bool(getattr(model, "supports_gradient_checkpointing", False))
    if enabled and not on:
        log.warning("%s does not support activation checkpointing; training without it", type(model).__name__)
    # transformers 5 renamed the switch (the old name warns); the new one is non-reentrant by default.
    prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if on:
        if prefix == "activation":
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield on
    finally:
        if on:
            getattr(model, f"{prefix}_checkpointing_disable")()


@contextlib.contextmanager
def frozen_parameters(params: Iterable[torch.nn.Parameter]) -> Iterator[None]:
    """Within: those of ``params`` that take gradients do not (a backward neither computes nor
    keeps them); they take them again after."""
    frozen = [p for p in params if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float((w_hat.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12))


def record_quantized(ws: Workspace, name: str, module: torch.nn.Module, w_hat, p) -> dict:
    """Write the quantized weight into the model, keep its grid; per-Linear stats."""
    w = weight_2d(module).detach()
    err = relative_error(w, w_hat)
    set_weight_2d(module, w_hat)
    ws.qparams[name] = p
    return {"scheme": p.scheme.label(), "rel_error": round(err, 6)}


def run_calibration(ws: Workspace, cfg: LinearsConfig, solve, description: str, records: dict | None = None,
                    autocast: torch.dtype | None = None) -> list[dict]:
    """Layer by layer over the calibration samples, ``solve`` called on each layer's step; the
    layer forwards in ``autocast`` (default: the calibration's setting)."""
    return run_sequential(
        ws.model, ws.calibration_ids(), solve,
        targets=cfg.targets, ignore=cfg.ignore,
        batch_size=ws.calibration.resolved_batch_size(ws.device), device=ws.device,
        autocast=autocast or ws.calibration.autocast_dtype(), progress=ws.progress, description=description,
        store=ws.store, records=records,
    )


def collect_in_order(step: LayerStep, names: list[str], make) -> Iterator[tuple[list[str], dict]]:
    """Groups of Linears sharing one input, in execution order, each collected only after the
    previous groups were compressed (true-sequential). Each collect stops at its own group's
    input, so the first group costs little more than its statistics."""
    for group in step.input_groups(names):
        yield group, step.collect(group, make)


def apply_mask(ws: Workspace, name: str, module: torch.nn.Module, mask: torch.Tensor) -> dict:
    """Zero pruned weights; a mask from an earlier stage is kept (masks never regrow)."""
    if name in ws.masks:
        mask = mask & ws.masks[name]
    w = weight_2d(module).detach()
    set_weight_2d(module, w * mask)
    ws.masks[name] = mask
    return {"sparsity": round(1 - float(mask.float().mean()), 6)}


def sparsity_summary(
    model: torch.nn.Module, linears: dict[str, torch.nn.Module], nm: tuple[int, int] | None
) -> dict:
    """Sparsity of the pruned Linears overall and per decoder layer, and the N:M check."""
    prefix, _ = find_decoder_layers(model)
    zeros = total = violations = 0
    per_layer: dict[str, list[int]] = {}
    for name, module in linears.items():
        w = weight_2d(module).detach()
        z = int((w == 0).sum())
        zeros, total = zeros + z, total + w.numel()
        layer = f"{prefix}.{name[len(prefix) + 1:].split('.')[0]}"
        acc = per_layer.setdefault(layer, [0, 0])
        acc[0], acc[1] = acc[0] + z, acc[1] + w.numel()
        if nm is not None:
            violations += nm_violations(w, *nm)
    out = {
        "sparsity": round(zeros / max(1, total), 6),
        "layer_sparsity": {k: round(z / t, 6) for k, (z, t) in per_layer.items()},
    }
    note = f"overall sparsity {out['sparsity']:.4f}"
    if nm is not None:
        out.update(pattern=f"{nm[0]}:{nm[1]}", nm_violations=violations)
        note += (f"; exactly {nm[0]}:{nm[1]} in every group" if not violations
                 else f"; {violations} groups break {nm[0]}:{nm[1]}")
    out["notes"] = [note]
    return out
