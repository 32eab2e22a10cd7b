"""Generic discovery of decoder layers and their Linears (no per-model lists).

Decoder layers are the longest ``nn.ModuleList`` whose children all share one class; Linears
are ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2), selected with regex ``targets`` /
``ignore`` matched (``re.search``) against the full module name.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from optc.errors import OptcError
from optc.model.patterns import check_patterns  # noqa: F401 - defined torch-free, re-exported

LINEAR_TYPES = (nn.Linear, Conv1D)
# The name of the KV-cache argument of an attention forward, newest transformers first.
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's stack of decoder layers, with its dotted name."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if len({type(m) for m in module}) == 1 and (best is None or len(module) > len(best[1])):
                best = (name, module)
    if best is None:
        raise OptcError(f"no decoder layers found in {type(model).__name__}")
    return best


def cache_argument(module: nn.Module) -> str | None:
    """The name under which ``module``'s forward takes the KV cache, or None."""
    params = inspect.signature(module.forward).parameters
    return next((n for n in CACHE_ARGUMENTS if n in params), None)


def attention_modules(layer: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """The attention modules of a decoder layer (full names with ``prefix``): the innermost
    modules whose forward takes the KV cache (the layer passes its own cache argument down)."""
    takes = {n: m for n, m in layer.named_modules() if cache_argument(m) is not None}
    inner = {n: m for n, m in takes.items()
             if not any(o != n and o.startswith(f"{n}." if n else "") for o in takes)}
    return {".".join(p for p in (prefix, n) if p): m for n, m in inner.items()}


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, LINEAR_TYPES)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(re.search(p, name) for p in patterns)


def select_linears(
    model: nn.Module, targets: list[str], ignore: list[str]
) -> dict[str, nn.Module]:
    """Linears inside the decoder layers whose names match ``targets`` and not ``ignore``."""
    prefix, _ = find_decoder_layers(model)
    candidates = {
        n: m for n, m in model.named_modules() if is_linear(m) and n.startswith(prefix + ".")
    }
    chosen = {
        n: m for n, m in candidates.items() if _matches(n, targets) and not _matches(n, ignore)
    }
    if not chosen:
        examples = ", ".join(sorted(candidates)[:8])
        raise OptcError(
            f"targets {targets} (ignore {ignore}) match no Linear; the Linears that exist "
            f"include: {examples}"
        )
    return chosen


def weight_2d(module: nn.Module) -> torch.Tensor:
    """The weight as ``[out_features, in_features]`` (Conv1D stores it transposed)."""
    return module.weight.t() if isinstance(module, Conv1D) else module.weight


def set_weight_2d(module: nn.Module, w: torch.Tensor) -> None:
    w = w.t() if isinstance(module, Conv1D) else w
    with torch.no_grad():
        module.weight.copy_(w.to(module.weight.dtype))
