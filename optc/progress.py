"""Progress reporting without a UI dependency: the CLI passes a rich-backed implementation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol


class Progress(Protocol):
    def task(self, description: str, total: int | None) -> AbstractContextManager[Callable[..., None]]:
        """A context manager yielding ``advance(info=None)``, called once per finished unit;
        ``info`` is a short status shown beside the bar (e.g. the current loss). ``total``
        None: the number of units is not known in advance."""
        ...


class NullProgress:
    @contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Callable[..., None]]:
        yield lambda info=None: None
