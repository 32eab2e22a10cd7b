"""safetensors checkpoints: state dicts written single-file or sharded, and files written one tensor
at a time, so nothing has to hold a whole shard.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once (and copies
each to bytes). Streaming compression writes checkpoints far larger than memory, so this
writer takes *entries* whose bytes come from a tensor, from a byte range of another
safetensors file (copied with plain reads, never memory-mapped, so it does not count as
resident memory), or from a function called just before the tensor is written.

The layout is byte for byte what safetensors 0.4-0.8 writes (checked against ``save_file`` in
the tests): tensors sorted by dtype (safetensors' ``Dtype`` enum, descending) then name, a
compact JSON header with ``__metadata__`` first, padded with spaces to a multiple of 8 bytes.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from optc.errors import OptcError

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tied_keys(model: torch.nn.Module) -> set[str]:
    """State-dict keys that HF ``save_pretrained`` leaves out because they are tied to another key."""
    # transformers >= 5 resolves the ties that are actually active (config-dependent) here.
    resolved = getattr(model, "all_tied_weights_keys", None)
    if resolved is not None:
        return set(resolved)
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    declared = getattr(model, "_tied_weights_keys", None) or ()
    return set(declared)


def model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without the tied copies, i.e. the keys HF stores on disk."""
    drop = tied_keys(model)
    return {k: v for k, v in model.state_dict().items() if k not in drop}


def _dedupe_aliases(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the first name of tensors that are the very same view of the same storage.

    Callers put the canonical name first (state-dict order does: embeddings precede lm_head).
    Different views of one storage are distinct values and are kept, each cloned on write.
    """
    seen: dict[tuple, str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(),
               tuple(t.shape), t.stride())
        if t.numel() and key in seen:
            log.info("not storing %s: it aliases %s", name, seen[key])
            continue
        seen.setdefault(key, name)
        out[name] = t
    return out


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split of tensor names (with their byte sizes) in insertion order, like HF: a
    tensor larger than the limit gets its own shard."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, n in sizes.items():
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _remove_stale(directory: Path) -> None:
    # A leftover shard or index from an earlier export would be picked up by loaders.
    stale = [directory / SINGLE_FILE, directory / INDEX_FILE,
             *directory.glob("model-*-of-*.safetensors")]
    for path in (p for p in stale if p.exists()):
        log.info("removing stale %s", path.name)
        path.unlink()


def write_safetensors(
    tensors: dict[str, torch.Tensor],
    directory: Path,
    max_shard_bytes: int = 2 * 1024**3,
    metadata: dict | None = None,
) -> list[Path]:
    """Write ``tensors`` as ``model.safetensors`` or HF-style shards plus index; return the files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale(directory)
    tensors = _dedupe_aliases(tensors)
    meta = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}

    shards = plan_shards({k: _nbytes(t) for k, t in tensors.items()}, max_shard_bytes)
    n = len(shards)
    names = shard_file_names(n)
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    # The same bytes as safetensors' save_file, which first copies every tensor of a file into
    # one Python bytes object (the whole checkpoint again in memory at the end of a run).

    for file_name, keys in zip(names, shards):
        path = directory / file_name
        write_file(path, {k: tensors[k] for k in keys}, meta)
        paths.append(path)
        weight_map.update(dict.fromkeys(keys, file_name))

    if n > 1:
        write_index(directory, weight_map, sum(_nbytes(t) for t in tensors.values()))
    log.info("wrote %d tensors to %d file(s) in %s", len(tensors), n, directory)
    return paths


def shard_file_names(n: int) -> list[str]:
    return [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(directory) / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded checkpoint written by :func:`write_safetensors`."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [SINGLE_FILE]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(directory / f)))
    return out


# safetensors' Dtype enum in declaration order: files are sorted by it, descending.
_ENUM_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
               "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "U64", "I64")
DTYPE_CODES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.uint16: "U16", torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32",
    torch.uint32: "U32", torch.float32: "F32", torch.float64: "F64", torch.uint64: "U64",
    torch.int64: "I64", torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fn: "F8_E4M3",
}
TORCH_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileSlice:
    """A tensor's bytes inside an existing safetensors file."""

    path: Path
    offset: int  # absolute byte offset in the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Lazy:
    """A tensor produced only when it is written (loaded, converted or generated)."""

    make: Callable[[], torch.Tensor]
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


Entry = torch.Tensor | FileSlice | Lazy


def entry_nbytes(e: Entry) -> int:
    if isinstance(e, torch.Tensor):
        return e.numel() * e.element_size()
    return e.nbytes


def _dtype_shape(e: Entry) -> tuple[torch.dtype, tuple[int, ...]]:
    return e.dtype, tuple(e.shape)


@dataclass(frozen=True)
class HeaderEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


# safetensors' own limit on the JSON header (its readers refuse larger ones as HeaderTooLarge).
MAX_HEADER_BYTES = 100_000_000


def header_json(path: Path) -> tuple[dict, int]:
    """The parsed JSON header of a safetensors file and its length in bytes.

    The length field is checked against the file before anything is read: an absurd one would
    otherwise be a read of that many bytes (a MemoryError, not a message)."""
    path = Path(path)
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        if len(head) < 8:
            raise OptcError(f"{path} is not a safetensors file: {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise OptcError(f"{path} is corrupt or not a safetensors file: its header length field says {n:,} "
                            f"bytes, the file holds {size - 8:,} after it (at most {MAX_HEADER_BYTES:,} allowed)")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise OptcError(f"{path} is corrupt or not a safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise OptcError(f"{path} is corrupt or not a safetensors file: its header is not a JSON object")
    return header, n


def read_header(path: Path) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """The tensors of a safetensors file (dtype, shape, absolute byte range) and its metadata."""
    header, n = header_json(path)
    try:
        meta = header.pop("__metadata__", None) or {}
        base = 8 + n
        out = {
            name: HeaderEntry(TORCH_DTYPES[h["dtype"]], tuple(h["shape"]),
                              base + h["data_offsets"][0], base + h["data_offsets"][1])
            for name, h in header.items()
        }
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        raise OptcError(f"{path} is corrupt or not a safetensors file: a header entry cannot be read "
                        f"({type(exc).__name__}: {exc})") from None
    return out, meta


def file_slices(path: Path) -> dict[str, FileSlice]:
    """Every tensor of a safetensors file as a :class:`FileSlice` (nothing is read but the header)."""
    header, _ = read_header(path)
    return {k: FileSlice(Path(path), h.start, h.end - h.start, h.dtype, h.shape) for k, h in header.items()}


def _write_bytes(fh, e: Entry) -> None:
    if isinstance(e, FileSlice):
        with e.path.open("rb") as src:
            src.seek(e.offset)
            left = e.nbytes
            while left:
                chunk = src.read(min(_COPY_CHUNK, left))
                if not chunk:
                    raise OSError(f"{e.path} ended before byte {e.offset + e.nbytes}")
                fh.write(chunk)
                left -= len(chunk)
        return
    t = e.make() if isinstance(e, Lazy) else e
    if (t.dtype, tuple(t.shape)) != _dtype_shape(e):
        raise ValueError(f"tensor is {t.dtype} {tuple(t.shape)}, declared {_dtype_shape(e)}")
    t = t.detach().to("cpu").contiguous()
    if t.numel():
        # A byte view of the tensor's own memory: no copy, whatever the dtype.
        fh.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def write_file(path: Path, entries: dict[str, Entry], metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file from ``entries``."""
    path = Path(path)
    order = sorted(entries, key=lambda k: (-_ENUM_ORDER.index(DTYPE_CODES[entries[k].dtype]), k))
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        dtype, shape = _dtype_shape(entries[name])
        n = entry_nbytes(entries[name])
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name in order:
            _write_bytes(fh, entries[name])


def write_sharded(
    entries: dict[str, Entry], directory: Path, max_shard_bytes: int, metadata: dict[str, str] | None = None
) -> list[Path]:
    """Like :func:`optc.model.safetensors_io.write_safetensors` (same shard plan, names, index and
    bytes), one tensor in memory at a time."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
    shards = plan_shards({k: entry_nbytes(e) for k, e in entries.items()}, max_shard_bytes)
    names = shard_file_names(len(shards))
    paths, weight_map = [], {}
    for file_name, keys in zip(names, shards):
        write_file(directory / file_name, {k: entries[k] for k in keys}, meta)
        paths.append(directory / file_name)
        weight_map.update(dict.fromkeys(keys, file_name))
    if len(shards) > 1:
        write_index(directory, weight_map, sum(entry_nbytes(e) for e in entries.values()))
    return paths


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> file of a single-file or sharded safetensors checkpoint directory."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: directory / f for k, f in weight_map.items()}
    single = directory / SINGLE_FILE
    if not single.is_file():
        return {}
    return dict.fromkeys(read_header(single)[0], single)
