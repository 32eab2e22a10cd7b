"""Models larger than memory: an empty (meta-device) model whose tensors are read from the
checkpoint's safetensors shards only while a part of the model is needed.

:class:`CheckpointSource` reads tensors by name from a checkpoint directory (single file or
sharded): the safetensors headers give each tensor's byte range, and the bytes are read straight
into the tensor, nothing else. Pack-quantized Linears are dequantized when the checkpoint is
one optc wrote. :func:`materialize` fills a module's meta
tensors from a source and :func:`release` turns them back into meta tensors, so at any time
only the parts of the model in use occupy memory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Protocol
from pathlib import Path

import torch
from torch import nn

from optc.errors import OptcError
from optc.memory import trim
from optc.model.safetensors_io import FileSlice, checkpoint_files, read_header

log = logging.getLogger(__name__)


def local_model_dir(source: str | None) -> Path:
    """The local directory holding ``source``'s config and safetensors weights."""
    from optc.model.load import _BUILTIN, DEFAULT_MODEL, builtin_model_dir

    source = source or DEFAULT_MODEL
    if source in _BUILTIN:
        return builtin_model_dir(source)
    path = Path(source).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise OptcError(
        f"streaming reads a local Hugging Face directory with safetensors weights; {source!r} is not one "
        "(download it first, or run without streaming)"
    )


def read_slice(sl: FileSlice, key: str) -> torch.Tensor:
    """The tensor stored at ``sl`` (``key`` names it in errors)."""
    t = torch.empty(sl.shape, dtype=sl.dtype)
    # Read straight into the tensor. A memory map (safe_open) would count every page
    # it touches as resident until the file is closed, doubling the memory a layer
    # takes while it loads (bench-scale model, up to the first layer: 1.75 GiB peak
    # through safe_open, 1.1 GiB read this way).
    try:
        with sl.path.open("rb") as fh:
            fh.seek(sl.offset)
            got = fh.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy())) if sl.nbytes else 0
    except OSError as exc:
        raise OptcError(f"{sl.path} cannot be read ({exc})") from None
    if got != sl.nbytes:
        raise OptcError(f"{sl.path} is truncated: {key} ends after {got} of {sl.nbytes} bytes")
    return t


class Unpacker(Protocol):
    """How a quantized checkpoint format stores one Linear's weight, for reading it alone: the
    stored tensors that make up ``module``'s weight (the first one marks it present), and the
    float weight rebuilt from them (``qc``: the checkpoint's ``quantization_config``)."""

    def leaves(self, module: str) -> list[str]: ...
    def weight(self, module: str, raw: dict[str, torch.Tensor], qc: dict) -> torch.Tensor: ...


class CheckpointSource:
    """Tensors of a checkpoint directory by state-dict name, read only when asked for."""

    def __init__(self, directory: Path, unpack: Unpacker | None = None) -> None:
        self.directory = Path(directory)
        self.files = checkpoint_files(self.directory)
        if not self.files:
            raise OptcError(f"{self.directory} has no safetensors weights (streaming reads safetensors only)")
        try:
            config = json.loads((self.directory / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise OptcError(f"{self.directory}/config.json cannot be read ({exc})") from None
        self.qc = config.get("quantization_config") or None
        self.unpack = unpack
        if self.qc is not None and unpack is None:
            raise OptcError(
                f"{self.directory}: streaming cannot read {self.qc.get('quant_method')} "
                f"{self.qc.get('format') or ''} weights one tensor at a time".rstrip()
            )
        self._headers: dict[Path, dict] = {}

    def _header(self, path: Path) -> dict:
        if path not in self._headers:
            try:
                self._headers[path] = read_header(path)[0]
            except (OSError, ValueError, KeyError) as exc:
                raise OptcError(f"{path} is corrupt or truncated ({exc})") from None
        return self._headers[path]

    def __contains__(self, key: str) -> bool:
        if key in self.files:
            return True
        leaves = self.unpack.leaves(key.removesuffix(".weight")) if self.unpack is not None else []
        return bool(leaves) and leaves[0] in self.files

    def slice(self, key: str) -> FileSlice:
        """Where a stored tensor's bytes are (for copying it without loading)."""
        path = self.files[key]
        h = self._header(path)[key]
        return FileSlice(path, h.start, h.end - h.start, h.dtype, h.shape)

    def spec(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        h = self._header(self.files[key])[key]
        return h.dtype, h.shape

    def _raw(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        return {k: read_slice(self.slice(k), k) for k in keys}

    def tensors(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Float tensors by state-dict name; a quantized Linear's ``weight`` is dequantized by the
        checkpoint format's :class:`Unpacker`."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise OptcError(f"{self.directory} lacks tensor {missing[0]} ({len(missing)} missing)")
        plain = [k for k in keys if k in self.files]
        packed = [k.removesuffix(".weight") for k in keys if k not in self.files]
        parts = [k for m in packed for k in self.unpack.leaves(m) if k in self.files] if packed else []
        raw = self._raw(plain + parts)
        out = {k: raw.pop(k) for k in plain}
        for m in packed:
            out[f"{m}.weight"] = self.unpack.weight(m, raw, self.qc)
        return out


def meta_model(directory: Path, dtype: torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    """The model of ``directory`` with every parameter on the meta device (no weights read).

    Buffers computed at construction (rotary frequencies) stay real: accelerate's
    ``init_empty_weights`` moves only parameters to the meta device.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from optc.model.load import check_remote_code

    check_remote_code(directory, trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise OptcError(f"cannot read the config of {directory}: {str(exc).splitlines()[0]}") from None
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # optc's reader dequantizes; the model itself is float
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    try:
        model.generation_config = GenerationConfig.from_pretrained(directory)
    except OSError:
        pass  # no generation_config.json: keep the one derived from the config
    model.tie_weights()  # init_empty_weights leaves tied weights as separate meta tensors
    if getattr(model.config, "auto_map", None):
        del model.config.auto_map  # the code it names is not copied: an output never carries it
    model.eval()
    return model


def materialize(module: nn.Module, source: CheckpointSource, prefix: str = "", exclude: str | None = None) -> None:
    """Read ``module``'s meta parameters and persistent buffers (named ``prefix + key`` in the
    source) into memory, in the dtype the module declares. Submodules under ``exclude`` and
    tensors already in memory are left alone; tied weights are tied again afterwards."""
    from optc.model.safetensors_io import tied_keys

    wanted: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    tied = tied_keys(module) if hasattr(module, "config") else set()
    for key, t in module.state_dict(keep_vars=True).items():
        if not t.is_meta or (exclude and key.startswith(exclude + ".")) or id(t) in seen or key in tied:
            continue
        seen.add(id(t))  # a tied tensor is read once, under its first name
        wanted[key] = t
    if not wanted:
        return
    missing = [k for k in wanted if prefix + k not in source]
    if missing:
        raise OptcError(f"{source.directory} lacks tensor {prefix + missing[0]}")
    loaded = source.tensors(prefix + k for k in wanted)
    state = {}
    for key, t in wanted.items():
        x = loaded.pop(prefix + key)
        if tuple(x.shape) != tuple(t.shape):
            raise OptcError(f"{source.directory}: {prefix + key} has shape {tuple(x.shape)}, the config says {tuple(t.shape)}")
        state[key] = x.to(t.dtype)
    module.load_state_dict(state, strict=False, assign=True)
    if hasattr(module, "tie_weights"):
        module.tie_weights()


def release(module: nn.Module, exclude: str | None = None) -> None:
    """Replace ``module``'s parameters and persistent buffers by meta tensors (freeing them),
    and hand the freed memory back to the operating system."""
    for name, sub in module.named_modules():
        if exclude and (name == exclude or name.startswith(exclude + ".")):
            continue
        for key, p in list(sub._parameters.items()):
            if p is not None and not p.is_meta:
                sub._parameters[key] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for key, b in list(sub._buffers.items()):
            if b is not None and not b.is_meta and key not in sub._non_persistent_buffers_set:
                sub._buffers[key] = torch.empty_like(b, device="meta")
    trim()




def is_materialized(module: nn.Module) -> bool:
    return not any(p.is_meta for p in module.parameters())


def tensor_counts(module: nn.Module, exclude: str | None = None) -> tuple[int, int]:
    """(elements, non-zeros) of ``module``'s parameters outside ``exclude``, tied ones once."""
    params: dict[int, torch.Tensor] = {}
    for name, p in module.named_parameters():
        if not (exclude and name.startswith(exclude + ".")):
            params.setdefault(id(p), p)
    return (sum(p.numel() for p in params.values()),
            sum(int(torch.count_nonzero(p)) for p in params.values()))


def linear_summary(layer: nn.Module, name: str) -> dict[str, dict]:
    """Shape, zero count and sparsity of each Linear of a decoder layer (the report's rows)."""
    from optc.model.anatomy import is_linear, weight_2d

    out = {}
    for n, m in layer.named_modules():
        if is_linear(m):
            w = weight_2d(m)
            out[f"{name}.{n}"] = {"shape": list(w.shape), "zeros": int((w == 0).sum()),
                                  "sparsity": round(float((w == 0).float().mean()), 6)}
    return out
