"""Writing checkpoint directories safely, and estimating their size before writing.

Every output is assembled in a temporary directory beside the target and renamed into place
only when complete, so a failure never leaves a half-written checkpoint; an existing target
is replaced only with ``overwrite``, and the input model's directory is never written to.
"""

from __future__ import annotations

import errno
import logging
import math
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from optc.errors import OptcError
from optc.export.dense import write_dense  # noqa: F401 - its older home
from optc.export.files import directory_bytes  # noqa: F401 - its older home
from optc.export.formats import get_format
from optc.model.anatomy import weight_2d

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
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            raise OptcError(
                f"disk full while writing {target} ({_free_mib(target.parent)} MiB free): the partial "
                "checkpoint was removed, nothing was written"
            ) from None
        raise
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        target.rename(old / "x")
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC from Python's I/O, or the same error reported by safetensors' Rust writer
    (a ``SafetensorError`` whose text carries the OS error)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or "StorageFull" in text or "Disk quota exceeded" in text


def _existing_parent(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _free_mib(path: Path) -> int:
    return shutil.disk_usage(_existing_parent(path)).free // 2**20


# Tokenizer, config and report files beside the weights; generous for large vocabularies.
_SIDE_FILES_BYTES = 32 * 2**20


def estimate_checkpoint_bytes(model: torch.nn.Module, schemes: Mapping[str, object], fmt: str) -> int:
    """An upper estimate of the checkpoint ``fmt`` writes for ``model``.

    ``schemes`` maps Linear names to their weight scheme (objects with ``bits`` and
    ``group_size``); those weights cost what the format's ``bits_per_weight`` says (scales and
    zero points included), every other tensor its in-memory size.
    """
    bits_per_weight = get_format(fmt).bits_per_weight
    total = 0
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if param.data_ptr() in seen:  # tied weights are stored once
            continue
        seen.add(param.data_ptr())
        module, _, kind = name.rpartition(".")
        scheme = schemes.get(module) if kind == "weight" else None
        bits = None
        if scheme is not None and param.dim() == 2:
            cols = weight_2d(model.get_submodule(module)).shape[1]  # in_features (GPT-2 stores [in, out])
            bits = bits_per_weight(scheme, cols)
        if bits is None:
            total += param.numel() * param.element_size()
        else:
            # Built-in formats store whole or half bits per value: the rounding drops float noise only.
            total += math.ceil(round(param.numel() * bits, 1) / 8)
    return total


def check_free_space(target: Path, needed: int) -> None:
    """Refuse to start writing ``target`` when its file system has less than ``needed`` bytes
    (plus a margin for the side files) free."""
    needed = int(needed * 1.05) + _SIDE_FILES_BYTES
    where = _existing_parent(target.parent if target.name else target)
    free = shutil.disk_usage(where).free
    if free < needed:
        raise OptcError(
            f"not enough disk space for {target}: the checkpoint needs about {needed / 2**20:,.0f} MiB, "
            f"{where} has {free / 2**20:,.0f} MiB free"
        )
