"""The method registry: recipe stage ``type`` -> :class:`Method`.

Everything that needs "all methods" (the recipe schema, the command line's flags, the
streaming and resume decisions, the size estimate, the export-format check) asks
:data:`METHODS` for what a method *is* (its kind and abilities), never for its name. Importing
this module, and every built-in method module, does not import torch: a method's ``run``
imports the heavy pieces when it is called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import BaseModel

if TYPE_CHECKING:
    from optc.methods.workspace import Workspace

Kind = Literal["quantize", "prune", "transform", "recover", "cache"]
KINDS: tuple[str, ...] = get_args(Kind)


@dataclass(frozen=True)
class Method:
    """One compression method, as a recipe stage names it.

    ``kind`` is what the command line's flags address: ``quantize`` (``--bits``,
    ``--group-size``, ``--method`` of ``optc quantize``; its config has ``scheme``,
    ``scheme_for(name)`` and ``planned_schemes()``), ``prune``, ``transform`` (changes the float
    model without compressing it, e.g. SmoothQuant), ``recover`` or ``cache`` (quantizes the
    attention's key/value cache at run time). ``streams``: can run on a
    streamed model, one decoder layer in memory at a time. ``saves_layers``: its finished layers
    are saved as it goes, so an interrupted run resumes after the last one saved.
    ``accumulators``: the calibration statistics it collects (documentation and inspection).
    ``check(model, config)``: refuses, before any stage runs, a model the method cannot work on
    (raises :class:`~optc.errors.OptcError` with the reason).
    """

    name: str
    config: type[BaseModel]
    run: Callable[[Workspace, Any], dict]
    kind: Kind
    streams: bool = False
    saves_layers: bool = False
    accumulators: tuple[str, ...] = ()
    check: Callable[[Any, Any], None] | None = None


# In registration order: the built-ins in optc.methods' order, then any registered later.
METHODS: dict[str, Method] = {}


def register(method: Method, *, replace: bool = False) -> Method:
    """Add ``method`` to :data:`METHODS` (built-ins, plugins and tests alike); returns it.

    Its config must be a pydantic model with ``extra="forbid"`` and a ``type`` field (the
    recipe's stage type), so recipes naming it validate like the built-in ones.
    """
    if method.kind not in KINDS:
        raise ValueError(f"method {method.name!r}: kind {method.kind!r} is not one of {', '.join(KINDS)}")
    if not (isinstance(method.config, type) and issubclass(method.config, BaseModel)):
        raise ValueError(f"method {method.name!r}: config must be a pydantic model class")
    if "type" not in method.config.model_fields:
        raise ValueError(f"method {method.name!r}: config {method.config.__name__} has no 'type' field")
    if method.config.model_config.get("extra") != "forbid":
        raise ValueError(f"method {method.name!r}: config {method.config.__name__} must set extra='forbid'")
    if method.name in METHODS and not replace and METHODS[method.name] is not method:
        raise ValueError(f"method {method.name!r} is already registered (pass replace=True to replace it)")
    METHODS[method.name] = method
    return method


def unregister(name: str) -> Method | None:
    """Remove a registered method (tests registering a throwaway one clean up with this)."""
    return METHODS.pop(name, None)


def methods_of_kind(kind: str) -> list[str]:
    """Names of the registered methods of ``kind``, in registration order."""
    return [name for name, m in METHODS.items() if m.kind == kind]
