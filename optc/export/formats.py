"""The export format registry: every ``--format`` value / recipe ``export.format``, with what it
can hold, how it is written, read, recognised and described.

Importing this module registers the built-in formats and imports neither torch nor
transformers (the recipe schema validates ``export.format`` against :data:`FORMATS`). A new
format is one module that builds a :class:`Format` and calls :func:`register`; nothing else in
optc names formats.
"""

from __future__ import annotations

from pathlib import Path

from optc.errors import OptcError
from optc.export import awq_format, compressed_tensors, dense, gguf_format, gptq_format
from optc.export.registry import FORMATS, Format, register

__all__ = ["FORMATS", "Format", "check_schemes", "detect_format", "format_help", "get_format", "register"]

# Registration order is the order --help, errors and detection list them.
for _fmt in (dense.DENSE, compressed_tensors.COMPRESSED_TENSORS, gptq_format.GPTQ, awq_format.AWQ,
             *gguf_format.GGUF_FORMATS):
    register(_fmt)


def get_format(name: str) -> Format:
    """The registered format ``name``; an error naming the known ones otherwise."""
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise OptcError(f"unknown export format {name!r} (expected one of {', '.join(FORMATS)})")
    return fmt


def detect_format(path: Path) -> Format | None:
    """The first registered format whose ``detect`` claims ``path``, or None."""
    path = Path(path).expanduser()
    return next((fmt for fmt in FORMATS.values() if fmt.detect(path)), None)


def format_help(descriptions: bool = False) -> str:
    """The formats for ``--help``: names, or one ``name: description`` per format."""
    if descriptions:
        return "; ".join(f"{fmt.name}: {fmt.description}" for fmt in FORMATS.values())
    return ", ".join(FORMATS)


def check_schemes(fmt: str, schemes: list[tuple[str, object, bool]]) -> None:
    """Refuse, before any calibration, weight schemes that format ``fmt`` can never hold.

    ``schemes`` lists ``(where, scheme, permuted)``: where the scheme comes from (for the message,
    e.g. ``"stage 0 (gptq) scheme"``), the :class:`~optc.compress.quant.QuantScheme`, and whether
    its groups are act-order permuted.
    """
    target = get_format(fmt)
    for where, scheme, permuted in schemes:
        reason = target.fits(scheme, permuted)
        if reason is not None:
            raise OptcError(f"export format {fmt}: {where}: {reason}")
    if target.one_scheme:
        kinds = {(s.bits, s.symmetric) for _, s, _ in schemes}
        if len(kinds) > 1:
            raise OptcError(
                f"export format {fmt} holds one scheme per checkpoint; the recipe mixes "
                f"{', '.join(sorted({s.label() for _, s, _ in schemes}))} (use compressed-tensors)"
            )
