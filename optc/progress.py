"""Progress reporting without a UI dependency: the CLI passes a rich-backed implementation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol


class Progress(Protocol):
    def task(self, description: str, total: int) -> AbstractContextManager[Callable[[], None]]:
        """A context manager yielding ``advance()``, called once per finished unit."""
        ...


class NullProgress:
    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Callable[[], None]]:
        yield lambda: None
