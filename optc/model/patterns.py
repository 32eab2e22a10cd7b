"""Name patterns without torch: regex checks for recipe fields (the recipe schema validates with
them) and the Linears runtimes fuse (the export formats' registry reads them)."""

from __future__ import annotations

import re
from collections.abc import Iterable

# Linears vLLM loads as one fused module (its packed_modules_mapping for Llama-family models), so
# the shards of each need one quantization scheme and are looked up under the fused name.
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def check_patterns(patterns: list[str], what: str) -> None:
    """Raise ValueError naming the first pattern that is not a valid regex."""
    for p in patterns:
        try:
            re.compile(p)
        except re.error as exc:
            raise ValueError(f"{what} pattern {p!r} is not a valid regex: {exc}") from exc


def fused_module(name: str) -> str | None:
    """The module vLLM fuses Linear ``name`` into (``qkv_proj`` for a ``q_proj``), or None."""
    leaf = name.rpartition(".")[2]
    return next((fused for fused, shards in FUSED_SHARDS.items() if leaf in shards), None)


def fused_groups(names: Iterable[str]) -> list[list[str]]:
    """``names`` grouped as vLLM fuses them (:data:`FUSED_SHARDS`: the shards of one module in one
    parent, those present), every other name alone; groups in order of their first name."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name in names:
        fused = fused_module(name)
        groups.setdefault((name.rpartition(".")[0], fused) if fused else (name, ""), []).append(name)
    return list(groups.values())
