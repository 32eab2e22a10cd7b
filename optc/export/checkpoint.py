"""Writing checkpoint directories safely, and estimating their size before writing.

Every output is assembled in a temporary directory beside the target and renamed into place
only when complete, so a failure never leaves a half-written checkpoint. An existing target is
replaced only with ``overwrite`` and only when optc wrote it (``force``: any directory); an
output is never an input, inside one or containing one, nor a root, the working or the home
directory. A command holds the output's lock (:func:`claimed_output`) from its first check to
the rename, so two runs never write one output (or its resume state), and directories that
killed runs left beside the output are cleaned by the next run to it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
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


# Files only optc writes into an output: an existing directory holding one of them is an
# earlier optc output, which ``overwrite`` may replace; any other directory may be someone's only
# copy of something, and is replaced only with ``force``.
OPTC_MARKERS = ("recipe.yaml", "report.json")

Protected = Path | Mapping[str, Path | None] | None


def _protected(protect: Protected) -> dict[str, Path]:
    if protect is None:
        return {}
    if isinstance(protect, Path):
        return {"model": protect}
    return {what: Path(p).expanduser() for what, p in protect.items() if p is not None}


def _is_within(path: Path, root: Path) -> bool:
    """``path`` is ``root`` or lies under it (both resolved)."""
    return path == root or root in path.parents


def _refuse_places(target: Path) -> None:
    """Directories no output may ever be: a file system root, the working directory or your home
    directory, or anything that contains one of them (replacing it would delete them)."""
    t = target.resolve()
    if t == Path(t.anchor):
        raise OptcError(f"output {target} is a file system root: choose a new directory for the output")
    places = [("the working directory", Path.cwd())]
    try:
        places.append(("your home directory", Path.home()))
    except (KeyError, RuntimeError):  # no HOME and no password entry: no home to protect
        pass
    for where, place in places:
        place = place.resolve()
        if _is_within(place, t):
            what = where if t == place else f"a directory containing {where} ({place})"
            raise OptcError(f"output {target} is {what}: choose a new directory for the output")


def _refuse_inputs(target: Path, protect: Protected) -> None:
    """The output may be neither an input, nor inside an input directory, nor contain an input."""
    t = target.resolve()
    for what, path in _protected(protect).items():
        if not path.exists():
            continue
        p = path.resolve()
        kind = "directory" if p.is_dir() else "file"
        if t == p:
            raise OptcError(f"output {target} is the input {what} {kind} {path}")
        if p.is_dir() and p in t.parents:
            raise OptcError(f"output {target} is inside the input {what} directory {path}")
        if t in p.parents:
            raise OptcError(f"output {target} contains the input {what} {kind} {path}: replacing it would delete the input")


def is_optc_output(directory: Path) -> bool:
    """An empty directory, or one holding a file only optc writes into its outputs."""
    try:
        entries = [p.name for p in directory.iterdir()]
    except OSError:
        return False
    return not entries or any(name in entries for name in OPTC_MARKERS)


def check_output(target: Path, overwrite: bool, protect: Protected = None, *, force: bool = False) -> None:
    """Refuse outputs that would clobber a file, a directory optc did not write, a place no output
    may be (a root, the working or home directory), or an input (the output is the input, lies
    inside it, or contains it). ``protect``: the input model's path, or inputs by what they are.
    ``overwrite`` replaces an earlier optc output; ``force`` any directory."""
    target = target.expanduser()
    _refuse_places(target)
    _refuse_inputs(target, protect)
    if not (target.exists() or target.is_symlink()):
        return
    if not target.is_dir():
        raise OptcError(f"output path {target} exists and is a file")
    if not (overwrite or force):
        raise OptcError(f"output directory {target} already exists (pass --overwrite to replace it)")
    if not force and not is_optc_output(target):
        raise OptcError(
            f"output directory {target} exists and optc did not write it (it holds no "
            f"{' or '.join(OPTC_MARKERS)}): --overwrite replaces only optc's own outputs; pass "
            "--force-overwrite to delete it and write the output there"
        )


def _cannot_write(target: Path, exc: OSError, where: Path | None = None) -> OptcError:
    where = where or target.absolute().parent
    reasons = {errno.EROFS: "is on a read-only file system", errno.EACCES: "is not writable (permission denied)",
               errno.EPERM: "is not writable (operation not permitted)", errno.ENOSPC: "is on a full disk",
               errno.EDQUOT: "is over its disk quota", errno.ENOTDIR: "is not a directory"}
    reason = reasons.get(exc.errno, f"cannot be written ({exc.strerror or exc})")
    return OptcError(f"cannot write the output {target}: {where} {reason}")


def _make_parents(target: Path) -> list[Path]:
    """Create the output's missing parent directories; returns those created (deepest last)."""
    missing = []
    parent = target.absolute().parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            pass
        except OSError as exc:
            _remove_if_empty(missing)
            raise _cannot_write(target, exc, path.parent) from None
    return list(reversed(missing))


def _remove_if_empty(dirs: list[Path]) -> None:
    for path in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        try:
            path.rmdir()
        except OSError:
            return  # not empty (the output is there) or already gone


def check_writable(target: Path) -> None:
    """Create and remove a file beside ``target``: a read-only file system or a directory without
    permission is found before any work, with its own message (not as a full disk)."""
    target = target.expanduser()
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.probe-", dir=target.absolute().parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise _cannot_write(target, exc) from None


def lock_path(target: Path) -> Path:
    """The lock file of an output (and of its resume state), beside it."""
    target = target.expanduser().absolute()
    return target.parent.resolve() / f".{target.name}.optc-lock"


@contextmanager
def output_lock(target: Path) -> Iterator[None]:
    """Hold ``target``'s lock: a second run writing the same output (or its resume state) is
    refused, naming the process that holds it. The kernel drops the lock when a process dies,
    even by SIGKILL, so a dead run never blocks the next one."""
    path = lock_path(target)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise _cannot_write(target, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OptcError(
                f"another optc run (PID {holder}) is writing {target}: wait for it to finish, or "
                "choose another --output"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        # The holder removed the file between our open and flock: that lock guards nothing.
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        # Removed while still held, so a run waiting on this file retries on a fresh one.
        path.unlink(missing_ok=True)
        os.close(fd)


def _leftovers(target: Path) -> list[Path]:
    """Staging (``.NAME.partial-*``) and moved-aside (``.NAME.old-*``) directories and probe files
    (``.NAME.probe-*``): names only optc gives, only to the paths of one output."""
    parent = target.absolute().parent
    if not parent.is_dir():
        return []
    dirs = [p for pattern in (f".{target.name}.partial-*", f".{target.name}.old-*")
            for p in parent.glob(pattern) if p.is_dir() and not p.is_symlink()]
    probes = [p for p in parent.glob(f".{target.name}.probe-*") if p.is_file()]
    return sorted(dirs + probes)


def clean_leftovers(target: Path) -> None:
    """Remove what runs to ``target`` that died left beside it; call with the lock held, when no
    live run can be writing them. A run killed between moving the old output aside and moving the
    new one in leaves the old one in ``.NAME.old-*/x``: it is put back, as if that run never ran."""
    for path in _leftovers(target):
        if path.is_file():
            path.unlink(missing_ok=True)
            continue
        kept = path / "x"
        if path.name.startswith(f".{target.name}.old-") and kept.is_dir() and not target.exists():
            kept.rename(target)
            log.warning("restored %s, which an interrupted run had moved to %s", target, path)
        log.info("removing %s, left by an interrupted run", path)
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def claimed_output(target: Path, overwrite: bool = False, protect: Protected = None, *,
                   force: bool = False) -> Iterator[None]:
    """What a command does before it works toward ``target``, held for the whole command: refuse a
    target it must not write, probe that the place is writable, take the output's lock and clean
    what dead runs left there. Parent directories it creates are removed again if left empty."""
    target = target.expanduser()
    check_output(target, overwrite, protect, force=force)
    created = _make_parents(target)
    try:
        check_writable(target)
        with output_lock(target):
            clean_leftovers(target)
            check_output(target, overwrite, protect, force=force)  # an output put back counts
            yield
    finally:
        _remove_if_empty(created)


@contextmanager
def staged_output(target: Path, overwrite: bool, protect: Protected = None, *,
                  force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``target`` when the block succeeds."""
    target = target.expanduser()
    check_output(target, overwrite, protect, force=force)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    except OSError as exc:
        raise _cannot_write(target, exc) from None
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
    try:
        # Something may have appeared at the target while this run worked (another program, or a
        # run without the lock): it is never replaced unless it may be.
        check_output(target, overwrite, protect, force=force)
    except OptcError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OptcError(f"{exc}; it appeared while this run was working, so nothing was written") from None
    _move_into_place(tmp, target)


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` to ``target``, moving an existing target aside first and
    deleting it only once the new one is in place. rename(2) never replaces a non-empty directory,
    so one that appears in between makes it fail instead of being lost."""
    old = None
    try:
        if target.exists() or target.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            target.rename(old / "x")
        tmp.rename(target)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = ""
        if old is not None and (old / "x").exists():
            try:
                (old / "x").rename(target)  # put the previous output back
                old.rmdir()
            except OSError:
                # Something took its place meanwhile: keep it under a name no cleanup touches.
                saved = Path(tempfile.mkdtemp(prefix=f".{target.name}.kept-", dir=target.parent))
                (old / "x").rename(saved / "x")
                shutil.rmtree(old, ignore_errors=True)
                kept = f"; the previous output is kept in {saved / 'x'}"
        raise OptcError(f"cannot move the finished output into place at {target} ({exc.strerror or exc}): "
                        f"nothing was written{kept}") from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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


# Bits per weight of float16, the format a compressed checkpoint must beat.
FLOAT16_BITS = 16


def check_stored_bits(model: torch.nn.Module, schemes: Mapping[str, object], fmt: str) -> None:
    """Refuse, before any calibration, a weight grid whose codes plus the scales and zero points its
    groups add in ``fmt`` take more bits per weight than float16 (a tiny or uneven group size:
    ``group_size: 7`` made an "int4" checkpoint of 36 bits per weight), naming the numbers.

    The groups' cost is what the format's ``bits_per_weight`` adds over one scale per row; formats
    that store their own block types (GGUF) add the same for both, so only the grid counts."""
    bits_per_weight = get_format(fmt).bits_per_weight
    worst = None
    for name, scheme in schemes.items():
        cols = weight_2d(model.get_submodule(name)).shape[1]
        grouped, per_row = bits_per_weight(scheme, cols), bits_per_weight(scheme.model_copy(update={"group_size": None}), cols)
        if grouped is None or per_row is None:
            continue
        stored = scheme.bits + grouped - per_row
        if stored > FLOAT16_BITS and (worst is None or stored > worst[0]):
            worst = (stored, name, scheme, cols)
    if worst is not None:
        stored, name, scheme, cols = worst
        raise OptcError(
            f"{scheme.label()} stored as {fmt} takes up to {stored:.1f} bits per weight in {name} ({cols} input "
            f"columns: the codes and each group's scale and zero point), more than float16's {FLOAT16_BITS}: "
            "choose a group size that divides the layers' widths (e.g. 32, 64 or 128), or group_size: null"
        )


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


def check_float_widths(model: torch.nn.Module, schemes: Mapping[str, object]) -> None:
    """Refuse, before any calibration, an NVFP4 or MXFP4 Linear whose input width is not a multiple
    of its group (16 or 32): the formats and their runtimes hold whole groups only. FP8 tiles
    (``block_rows``) may be short at the edges, as compressed-tensors pads them."""
    widths = {name: weight_2d(model.get_submodule(name)).shape[1] for name, scheme in schemes.items()
              if getattr(scheme, "type", "int") == "float" and scheme.group_size and scheme.block_rows is None}
    bad = [(name, schemes[name], k) for name, k in widths.items() if k % schemes[name].group_size]
    if bad:
        name, scheme, cols = bad[0]
        raise OptcError(f"{scheme.label()} needs in_features divisible by {scheme.group_size}: {name} has {cols}"
                        + (f" (and {len(bad) - 1} more Linears)" if len(bad) > 1 else "")
                        + "; ignore them or give them another scheme in overrides")
