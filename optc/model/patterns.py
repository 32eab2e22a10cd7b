"""Regex checks for recipe fields, without torch (the recipe schema validates with them)."""

from __future__ import annotations

import re


def check_patterns(patterns: list[str], what: str) -> None:
    """Raise ValueError naming the first pattern that is not a valid regex."""
    for p in patterns:
        try:
            re.compile(p)
        except re.error as exc:
            raise ValueError(f"{what} pattern {p!r} is not a valid regex: {exc}") from exc
