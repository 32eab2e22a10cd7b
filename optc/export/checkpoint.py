"""Writing checkpoint directories safely, and the dense (float) format.

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

from optc.model.anatomy import weight_2d
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


def write_dense(model: torch.nn.Module, tokenizer, directory: Path, max_shard_size: str = "2GB") -> None:
    """A plain float checkpoint any transformers version loads (weights as they are now)."""
    model.save_pretrained(directory, max_shard_size=max_shard_size, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


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
_GGUF_LINEAR_BITS = {"gguf-q4_0": 4.5, "gguf-q8_0": 8.5, "gguf-f16": 16.0}


def estimate_checkpoint_bytes(model: torch.nn.Module, schemes: Mapping[str, object], fmt: str) -> int:
    """An upper estimate of the checkpoint ``fmt`` writes for ``model``.

    ``schemes`` maps Linear names to their weight scheme (objects with ``bits`` and
    ``group_size``); those weights cost ``bits`` per value plus 8 bytes per group (scale and
    zero point), every other tensor its in-memory size. ``dense`` stores every weight as a
    float; GGUF block types fix the bits.
    """
    total = 0
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if param.data_ptr() in seen:  # tied weights are stored once
            continue
        seen.add(param.data_ptr())
        module, _, kind = name.rpartition(".")
        scheme = schemes.get(module) if kind == "weight" else None
        if scheme is None or fmt == "dense" or param.dim() != 2:
            total += param.numel() * param.element_size()
            continue
        bits = _GGUF_LINEAR_BITS.get(fmt, float(getattr(scheme, "bits", 16)))
        rows, cols = weight_2d(model.get_submodule(module)).shape  # [out, in] (GPT-2 stores [in, out])
        group = getattr(scheme, "group_size", None) or cols
        total += math.ceil(param.numel() * bits / 8) + 8 * rows * math.ceil(cols / group)
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
