"""Which recipe stage a command-line flag of ``optc quantize`` / ``optc prune`` sets.

Flags address a stage by what it is, not by its position: the first stage of the flag's kind
whose config takes the field the flag sets (``--bits`` the first quantize stage, ``--pattern``
the first prune stage taking pattern/sparsity), so ``optc quantize --recipe sparse-2of4-w4a16
--bits 3`` sets the gptq stage, not the sparsegpt one before it.
"""

from __future__ import annotations

from typing import Any

from optc.errors import OptcError
from optc.methods import METHODS, methods_of_kind

PRUNE_FIELDS = ("pattern", "sparsity")  # --method/--pattern/--sparsity of optc prune
STRUCTURED_FIELDS = ("heads", "kv_heads", "mlp")  # --structured of optc prune


def takes(method: str, fields: tuple[str, ...]) -> bool:
    return set(fields) <= set(METHODS[method].config.model_fields)


def prune_methods() -> list[str]:
    """Pruning methods --method chooses among: those taking --pattern / --sparsity."""
    return [m for m in methods_of_kind("prune") if takes(m, PRUNE_FIELDS)]


def first_stage(recipe: str, kind: str, flags: dict[str, Any], fields: tuple[str, ...] = ()) -> int | None:
    """Index of the recipe's first ``kind`` stage whose config takes ``fields``: where the given
    ``flags`` go (None when none of them is given). A recipe without one is refused."""
    given = [flag for flag, value in flags.items() if value is not None]
    if not given:
        return None
    from optc.recipe import read_recipe_data, resolve_recipe

    data = read_recipe_data(resolve_recipe(recipe))
    if not isinstance(data, dict):
        return None  # refused as a whole when the run parses it
    stages = data.get("stages") or []
    types = [st.get("type") if isinstance(st, dict) else None for st in stages] if isinstance(stages, list) else []
    for i, t in enumerate(types):
        if isinstance(t, str) and t in METHODS and METHODS[t].kind == kind and takes(t, fields):
            return i
    what = f"{kind} stage" + (f" taking {'/'.join(fields)}" if fields else "")
    have = " -> ".join(str(t) for t in types) or "none"
    raise OptcError(f"cannot set {', '.join(given)}: the recipe has no such entry (no {what} in {recipe}; its stages: {have})")
