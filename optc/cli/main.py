"""The ``optc`` command line: parse, call one library function, print with rich.

Importing the command modules registers their commands on :data:`app`."""

from __future__ import annotations

from optc.cli import compress, measure  # noqa: F401 - registers the commands
from optc.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    app()


if __name__ == "__main__":
    main()
