"""Errors that reach the user."""


class OptcError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run whose finished layers are saved: ``--resume`` continues it."""

    def __init__(self, state_dir: object, where: str) -> None:
        super().__init__(f"{where}; progress saved in {state_dir}")
        self.state_dir = state_dir
        self.where = where
