"""Writing state dicts as Hugging Face safetensors checkpoints (single file or sharded)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

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
    from optc.export.stream_writer import write_file

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
