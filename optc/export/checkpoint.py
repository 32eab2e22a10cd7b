"""Writing checkpoint directories safely, and the dense (float) format.

Every output is assembled in a temporary directory beside the target and renamed into place
only when complete, so a failure never leaves a half-written checkpoint; an existing target
is replaced only with ``overwrite``, and the input model's directory is never written to.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from optc.errors import OptcError

log = logging.getLogger(__name__)


def check_output(target: Path, overwrite: bool, protect: Path | None = None) -> None:
    """Refuse outputs that would clobber a file, an existing directory, or the input model."""
    target = target.expanduser()
    if target.exists() and not target.is_dir():
        raise OptcError(f"output path {target} exists and is a file")
    if target.exists() and not overwrite:
        raise OptcError(f"output directory {target} already exists (pass --overwrite to replace it)")
    if protect is not None and protect.exists():
        p, t = protect.resolve(), target.resolve()
        if p.is_dir() and (t == p or p in t.parents):
            raise OptcError(f"output {target} is inside the input model directory {protect}")


@contextmanager
def staged_output(target: Path, overwrite: bool, protect: Path | None = None) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``target`` when the block succeeds."""
    target = target.expanduser()
    check_output(target, overwrite, protect)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        target.rename(old / "x")
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)


def write_dense(model: torch.nn.Module, tokenizer, directory: Path, max_shard_size: str = "2GB") -> None:
    """A plain float checkpoint any transformers version loads (weights as they are now)."""
    model.save_pretrained(directory, max_shard_size=max_shard_size, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())
