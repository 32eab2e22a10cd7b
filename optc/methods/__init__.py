"""Compression methods: one module per method (its pydantic config and its glue), one registry.

:data:`METHODS` maps a recipe stage ``type`` to its :class:`Method`; a third-party method calls
:func:`register`. Importing this package (the registry and every built-in method) does not import
torch or transformers, so the recipe schema validates without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from optc.methods.registry import KINDS, METHODS, Method, methods_of_kind, register, unregister
from optc.methods.workspace import Workspace

# The built-in methods register themselves on import, in this order (the order error messages
# and --help list them in). A new method is one new module that calls register(), plus its
# import here (or wherever a plugin is loaded).
from optc.methods import rtn, gptq, awq, signround  # noqa: F401, I001 - registration order
from optc.methods import magnitude, wanda, sparsegpt, structured  # noqa: F401
from optc.methods import smoothquant, w8a8, kv_cache, recover  # noqa: F401

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

    from optc.compress.schemes import QuantScheme

__all__ = [
    "KINDS", "METHODS", "Method", "Workspace", "declared_schemes", "methods_of_kind", "planned_schemes",
    "register", "unregister",
]


def _quantizing(stages: list[BaseModel]) -> list[tuple[int, BaseModel]]:
    # Methods of kind "quantize" have a WeightQuantConfig (scheme_for, planned_schemes).
    return [(i, s) for i, s in enumerate(stages) if METHODS[s.type].kind == "quantize"]


def declared_schemes(stages: list[BaseModel]) -> list[tuple[str, QuantScheme, bool]]:
    """Every weight scheme the stages declare, without a model: ``(where, scheme, permuted
    act-order groups)`` with ``where`` like ``stage 0 (gptq) override 'down_proj'``; Linears
    left in float (an override's null scheme) are left out. For the export-format check."""
    out: list[tuple[str, QuantScheme, bool]] = []
    for i, stage in _quantizing(stages):
        for where, scheme, permuted in stage.planned_schemes():
            if scheme is not None:
                out.append((f"stage {i} ({stage.type}) {where}", scheme, permuted))
    return out


def planned_schemes(model: torch.nn.Module, stages: list[BaseModel]) -> dict[str, QuantScheme]:
    """Linear name -> weight scheme the quantizing stages will give it (the last stage touching
    a Linear wins), for estimating the checkpoint before any work."""
    from optc.model.anatomy import select_linears

    schemes: dict[str, QuantScheme] = {}
    for _, stage in _quantizing(stages):
        for name in select_linears(model, stage.targets, stage.ignore):
            scheme = stage.scheme_for(name)
            if scheme is not None:
                schemes[name] = scheme
    return schemes
