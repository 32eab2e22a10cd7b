"""Sizes as people write them (``2GB``, ``500MiB``), for shard limits and size budgets."""

from __future__ import annotations

from optc.errors import OptcError

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str | int) -> int:
    """``"2GB"`` / ``"500MB"`` / ``"1GiB"`` (or a number of bytes) -> bytes."""
    if isinstance(text, int):
        return text
    t = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            try:
                return int(float(t[: -len(unit)]) * _UNITS[unit])
            except ValueError:
                break
    raise OptcError(f"cannot parse size {text!r} (e.g. 2GB, 500MB)")
