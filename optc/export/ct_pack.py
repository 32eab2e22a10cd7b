"""compressed-tensors ``pack-quantized`` checkpoints (llm-compressor layout; transformers and vLLM load them).

Layout, checked against the installed compressed-tensors 0.20.1
(``compressors/pack_quantized/{base,helpers}.py``, ``quantization/lifecycle/initialize.py``):

- ``<m>.weight_packed`` int32 ``[N, ceil(K*b/32)]``: codes ``q + 2^(b-1)`` as one little-endian bit
  stream per row (:func:`optc.export.packing.pack_int32`). Dense, as the installed helpers
  document ("no padding bits ... split across int32 boundaries"): a 3/5/6/7-bit element may
  straddle two words. Releases before compressed-tensors #732 padded each word instead; 2/4/8
  bits are identical in both.
- ``<m>.weight_scale`` ``[N, G]`` in the weight's dtype (``[N, 1]`` per channel).
- ``<m>.weight_zero_point`` int32 ``[ceil(N*b/32), G]``, only when asymmetric: the same packing
  applied along the output dimension.
- ``<m>.weight_shape`` int64 ``[2]`` = ``[N, K]``.
- ``<m>.weight_g_idx`` int32 ``[K]``, only for act-order groups; 0.20.1 has dropped it (see
  :func:`write_pack`).
"""

from __future__ import annotations

import logging
import re
from importlib import metadata
from pathlib import Path
from typing import Literal

import torch
from pydantic import ValidationError

from optc.compress.quant import QuantParams, QuantScheme, default_g_idx, dequantize
from optc.errors import OptcError
from optc.export.files import quantization_config, write_config
from optc.export.packing import (
    scales_in_dtype,
    even_group_size,
    fit_group_size,
    grid_codes,
    pack_int32,
    regroup,
    splice,
    unpack_int32,
    write_weights,
)
from optc.export.source import ExportSource, ModelSource
from optc.memory import trim
from optc.model.safetensors_io import Lazy, read_safetensors

log = logging.getLogger(__name__)

FORMAT = "pack-quantized"
# The release whose layout this module implements; stamped when compressed-tensors is absent.
LAYOUT_VERSION = "0.20.1"
DEFAULT_SHARD_BYTES = 2 * 1024**3


def _target_group_sizes(
    qparams: dict[str, QuantParams], mode: str
) -> dict[str, int | None]:
    """Group size to store each module with (see ``uneven_groups`` of :func:`write_pack`)."""
    own = {n: p.scheme.group_size for n, p in qparams.items()}
    if mode == "keep":
        return own
    if mode == "per_layer":
        return {n: own[n] if p.actorder else even_group_size(own[n], p.g_idx.numel())
                for n, p in qparams.items()}
    if mode != "uniform":
        raise ValueError(f"uneven_groups must be 'per_layer', 'uniform' or 'keep', got {mode!r}")
    # One size per original scheme keeps one config group, which transformers' dequantize=True
    # path needs (it decompresses every dense layer with the first group's scheme).
    ks: dict[QuantScheme, list[int]] = {}
    for p in qparams.values():
        if p.scheme.group_size is not None and not p.actorder:
            ks.setdefault(p.scheme, []).append(p.g_idx.numel())
    shared = {scheme: fit_group_size(scheme.group_size, k) for scheme, k in ks.items()}
    return {n: own[n] if p.actorder else shared.get(p.scheme, own[n]) for n, p in qparams.items()}


def _ct_version() -> str:
    try:
        return metadata.version("compressed-tensors")
    except metadata.PackageNotFoundError:
        log.warning("compressed-tensors is not installed; stamping layout version %s", LAYOUT_VERSION)
        return LAYOUT_VERSION


def _ct_accepts_g_idx() -> bool:
    """Whether the installed compressed-tensors still reads ``actorder: group`` (``weight_g_idx``)."""
    try:
        from compressed_tensors.quantization import QuantizationArgs
    except ImportError:
        return False
    try:
        QuantizationArgs(num_bits=4, group_size=128, actorder="group")
    except ValueError:
        return False
    return True


def weights_args(scheme: QuantScheme, actorder: bool) -> dict:
    """A config group's ``weights`` block (compressed-tensors ``QuantizationArgs``)."""
    args = {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "group_size": scheme.group_size,
        "strategy": "channel" if scheme.group_size is None else "group",
        "dynamic": False,
    }
    if actorder:
        args["actorder"] = "group"
    return args


def compress_weight(name: str, weight: torch.Tensor, p: QuantParams) -> dict[str, torch.Tensor]:
    """The pack-quantized tensors of one weight on its grid ``p`` (names without the module prefix)."""
    q = grid_codes(name, weight, p)  # the nearest codes; a fake-quantized model matches them exactly
    bits = p.scheme.bits
    scale_dtype = weight.dtype if weight.is_floating_point() else torch.float16
    out = {
        "weight_packed": pack_int32(q, bits),
        "weight_scale": p.scale.to(scale_dtype),
    }
    if not p.scheme.symmetric:
        out["weight_zero_point"] = pack_int32(p.zero.t(), bits).t()
    out["weight_shape"] = torch.tensor(weight.shape, dtype=torch.int64)
    if p.actorder:
        out["weight_g_idx"] = p.g_idx.to(torch.int32)
    return out


def pack_weight(
    name: str, weight: torch.Tensor, p: QuantParams, group_size: int | None
) -> tuple[dict[str, torch.Tensor], tuple]:
    """The pack-quantized tensors of one fake-quantized Linear weight, stored with ``group_size``
    (see :func:`optc.export.packing.regroup`), and its config-group key
    ``(bits, symmetric, group_size, actorder)``."""
    if p.actorder and not _ct_accepts_g_idx():
        raise OptcError(
            f"{name} uses act-order groups (permuted g_idx), which compressed-tensors "
            f"{_ct_version()} no longer loads (actorder 'group' was removed); "
            "quantize with static groups (actorder 'weight') instead"
        )
    if group_size != p.scheme.group_size:
        stored = regroup(p, group_size)
        log.info("%s (K=%d): %s stored as %s", name, weight.shape[1], p.scheme.label(), stored.scheme.label())
        p = stored
    with torch.no_grad():
        tensors = compress_weight(name, weight, p)
    return tensors, (p.scheme.bits, p.scheme.symmetric, p.scheme.group_size, p.actorder)


def pack_linear(
    name: str, module: torch.nn.Module | None, p: QuantParams, group_size: int | None
) -> tuple[dict[str, torch.Tensor], tuple]:
    """:func:`pack_weight` of an ``nn.Linear`` module (the resume state packs layer by layer)."""
    if not isinstance(module, torch.nn.Linear):
        raise OptcError(f"{name!r} is not an nn.Linear of this model; pack-quantized covers Linears only")
    return pack_weight(name, module.weight, p, group_size)


def kv_cache_args(src: ExportSource) -> dict | None:
    """The ``kv_cache_scheme`` block (compressed-tensors ``QuantizationArgs``, as dumped) of the
    model's KV-cache quantization, or None; one scheme for the whole model."""
    schemes = {kq.scheme for kq in src.kv_quant.values()}
    if not schemes:
        return None
    if len(schemes) > 1:
        raise OptcError(f"compressed-tensors holds one kv_cache_scheme per checkpoint; the model has "
                        f"{', '.join(sorted(s.label() for s in schemes))}")
    scheme = schemes.pop()
    return {"num_bits": scheme.bits, "type": scheme.type, "symmetric": True, "group_size": None,
            "strategy": "tensor", "dynamic": False, "observer": scheme.observer}


def read_kv_quant(directory: Path, state: dict[str, torch.Tensor]) -> dict:
    """Attention module name -> :class:`~optc.compress.kvquant.KVQuant` from a checkpoint's
    ``kv_cache_scheme`` and its ``k_scale`` / ``v_scale`` tensors (taken out of ``state``)."""
    from optc.compress.kvquant import KVQuant
    from optc.compress.schemes import KVCacheScheme

    args = (quantization_config(directory) or {}).get("kv_cache_scheme")
    scales = {k: state.pop(k) for k in [k for k in state if k.endswith((".k_scale", ".v_scale"))]}
    if not args:
        return {}
    if args.get("num_bits", 8) != 8 or args.get("type", "float") not in ("int", "float") \
            or not args.get("symmetric", True) or args.get("dynamic", False) \
            or (args.get("strategy") or "tensor") != "tensor":
        raise OptcError(f"kv_cache_scheme {args}: only static per-tensor 8-bit symmetric (FP8 or int8) "
                        "KV caches are supported")
    try:  # the observer is free text in QuantizationArgs: kept when it is one of optc's
        scheme = KVCacheScheme(type=args.get("type", "float"), observer=args.get("observer") or "minmax")
    except ValidationError:
        scheme = KVCacheScheme(type=args.get("type", "float"))
    out = {}
    for name in sorted({k.rpartition(".")[0] for k in scales}):
        k, v = scales.get(f"{name}.k_scale"), scales.get(f"{name}.v_scale")
        if k is None or v is None:
            raise OptcError(f"{name}: kv_cache_scheme needs both {name}.k_scale and {name}.v_scale")
        out[name] = KVQuant(scheme, k.float().reshape(1), v.float().reshape(1))
    if not out:
        raise OptcError("config.json has a kv_cache_scheme but the checkpoint holds no k_scale / v_scale tensors")
    return out


def write_ct_config(src: ExportSource, directory: Path, config_groups: dict, ignore: list[str], fmt: str) -> None:
    """``config.json`` with the block ``ModelCompressor.update_config`` writes."""
    write_config(src, {
        "version": _ct_version(),
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        "config_groups": config_groups,
        "format": fmt,
        "quantization_status": "compressed",
        "kv_cache_scheme": kv_cache_args(src),
        "global_compression_ratio": None,
        "ignore": ignore,
    }, directory)


def write_pack_config(src: ExportSource, groups: dict[tuple, list[str]], directory: Path) -> dict:
    """``config.json`` (and the generation config) of a pack-quantized checkpoint; ``groups``
    maps :func:`pack_weight` keys to module names, in order. Returns the config groups."""
    config_groups = {}
    for i, ((bits, sym, gs, actorder), names) in enumerate(groups.items()):
        scheme = QuantScheme(bits=bits, symmetric=sym, group_size=gs)
        config_groups[f"group_{i}"] = {
            # Exact module names: compressed-tensors and vLLM match targets by exact name, "re:"
            # regex or class name; names keep mixed-precision assignments unambiguous.
            "targets": names,
            "weights": weights_args(scheme, actorder),
            "input_activations": None,
            "output_activations": None,
            "format": FORMAT,
        }
    quantized = {n for names in groups.values() for n in names}
    ignore = [n for n in src.linears() if n not in quantized]
    write_ct_config(src, Path(directory), config_groups, ignore, FORMAT)
    return config_groups


def write_pack_quantized_config(model: torch.nn.Module, groups: dict[tuple, list[str]], directory: Path) -> dict:
    """:func:`write_pack_config` of a model (the streaming run passes its meta-device model)."""
    return write_pack_config(ModelSource(model), groups, directory)


def checked_linear(src: ExportSource, name: str, stored: set[str], linears: set[str], what: str) -> None:
    """Refuse a module compressed-tensors cannot store: a tied weight or not an nn.Linear."""
    if name in linears and f"{name}.weight" not in stored:
        raise OptcError(f"{name}.weight is tied to another tensor; a tied weight cannot be quantized alone")
    if name not in linears:
        raise OptcError(f"{name!r} is not an nn.Linear of this model; {what} covers Linears only")


def _pack_stored(src: ExportSource, name: str, p: QuantParams, group_size: int | None) -> tuple[dict, tuple]:
    """:func:`pack_weight` of ``src``'s Linear ``name``, scales in the checkpoint's declared dtype."""
    tensors, key = pack_weight(name, src.tensor(f"{name}.weight"), p, group_size)
    scales_in_dtype({name: tensors}, src.dtype)
    return tensors, key


class _Repack:
    """One Linear of a model read from disk, packed again when the writer reaches its tensors, so a
    model larger than memory never holds all its codes at once. The writer orders tensors by dtype,
    not by module: the small tensors of a pack are kept until written, the codes are not (a
    Linear is packed at most twice more; packing is deterministic, so the bytes are the same)."""

    def __init__(self, src: ExportSource, name: str, p: QuantParams, group_size: int | None) -> None:
        self.src, self.name, self.p, self.group_size = src, name, p, group_size
        self.kept: dict[str, torch.Tensor] = {}
        self.written: set[str] = set()

    def entries(self, tensors: dict[str, torch.Tensor]) -> dict[str, Lazy]:
        return {k: Lazy(lambda k=k: self.get(k), v.dtype, tuple(v.shape)) for k, v in tensors.items()}

    def get(self, leaf: str) -> torch.Tensor:
        self.written.add(leaf)
        if leaf in self.kept:
            return self.kept.pop(leaf)
        tensors, _ = _pack_stored(self.src, self.name, self.p, self.group_size)
        self.kept = {k: v for k, v in tensors.items() if k != "weight_packed" and k not in self.written}
        return tensors[leaf]


def write_pack(
    src: ExportSource,
    directory: Path,
    *,
    uneven_groups: Literal["per_layer", "uniform", "keep"] = "per_layer",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict:
    """Write ``src`` (fake-quantized Linears described by ``src.qparams``) as a pack-quantized checkpoint.

    compressed-tensors cannot dequantize a layer whose group size does not divide K, so such
    layers are stored with exactly equivalent finer groups (:func:`optc.export.packing.regroup`):
    ``"per_layer"`` regroups only those layers (fewest extra scales, one more config group);
    ``"uniform"`` gives all layers of a scheme one common size (one config group per scheme,
    which transformers' ``dequantize=True`` load path requires); ``"keep"`` stores
    compressed-tensors' own ``[N, ceil(K/g)]`` layout, which it cannot load.
    """
    qparams = src.qparams
    if not qparams:
        raise OptcError("no quantized modules to export as pack-quantized")
    directory = Path(directory)
    stored, linears = set(src.keys()), set(src.linears())
    targets = _target_group_sizes(qparams, uneven_groups)

    packed: dict[str, dict[str, torch.Tensor]] = {}
    groups: dict[tuple, list[str]] = {}
    regrouped: dict[str, int | None] = {}
    on_disk = getattr(src, "stored", None) is not None  # a CastSource passes its inner source's on
    for name, p in qparams.items():
        checked_linear(src, name, stored, linears, FORMAT)
        packed[name], key = _pack_stored(src, name, p, targets[name])
        if on_disk:  # a streamed model: its Linears are packed again as they are written
            packed[name] = _Repack(src, name, p, targets[name]).entries(packed[name])
        trim()  # the packing temporaries (a few MB) would otherwise stay as heap fragments
        if key[2] != p.scheme.group_size:
            regrouped[name] = key[2]
        groups.setdefault(key, []).append(name)

    files = write_weights(splice(src, packed), directory, max_shard_bytes)
    config_groups = write_pack_config(src, groups, directory)
    summary = {
        "format": FORMAT,
        "bytes": sum(f.stat().st_size for f in files),
        "modules": len(packed),
        "files": [f.name for f in files],
        "groups": {g: QuantScheme(bits=k[0], symmetric=k[1], group_size=k[2]).label()
                   for g, k in zip(config_groups, groups)},
        "regrouped": regrouped,
    }
    log.info("pack-quantized: %d modules, %d bytes in %s", summary["modules"], summary["bytes"], directory)
    return summary


def write_pack_quantized(
    model: torch.nn.Module,
    qparams: dict[str, QuantParams],
    directory: Path,
    *,
    uneven_groups: Literal["per_layer", "uniform", "keep"] = "per_layer",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict:
    """:func:`write_pack` of a model in memory."""
    return write_pack(ModelSource(model, None, qparams), directory, uneven_groups=uneven_groups,
                      max_shard_bytes=max_shard_bytes)


# --- reader -----------------------------------------------------------------------------------


def _target_matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _scheme_for(name: str, config_groups: dict) -> dict:
    for group in config_groups.values():
        if any(_target_matches(name, t) for t in group["targets"]):
            return group
    # Class-name targets ("Linear") cannot be checked without the model; the packed tensor
    # itself says the module was quantized.
    for group in config_groups.values():
        if any("." not in t and not t.startswith("re:") for t in group["targets"]):
            return group
    raise OptcError(f"no config group of the checkpoint targets {name}")


def _group_format(name: str, qc: dict) -> str | None:
    return _scheme_for(name, qc["config_groups"]).get("format") or qc.get("format")


def weight_scheme(name: str, qc: dict, formats: tuple[str, ...]) -> tuple[dict, QuantScheme]:
    """Module ``name``'s config group in ``quantization_config`` ``qc`` and its weight scheme;
    the group's format must be one of ``formats`` (the first names it in the error)."""
    group = _scheme_for(name, qc["config_groups"])
    fmt = _group_format(name, qc)
    args = group["weights"]
    if fmt not in formats or args.get("type", "int") != "int":
        raise OptcError(f"{name}: format {fmt!r} / type {args.get('type')!r} is not int {formats[0]}")
    if args.get("strategy") not in ("group", "channel"):
        raise OptcError(f"{name}: weight strategy {args.get('strategy')!r} is not supported")
    scheme = QuantScheme(
        bits=args["num_bits"],
        symmetric=args.get("symmetric", True),
        group_size=args["group_size"] if args["strategy"] == "group" else None,
    )
    return group, scheme


def dequantize_packed(
    name: str, tensors: dict[str, torch.Tensor], qc: dict
) -> tuple[torch.Tensor, QuantParams]:
    """Module ``name``'s float weight and params from its pack-quantized tensors, which are
    taken out of ``tensors``; ``qc`` is the checkpoint's ``quantization_config``."""
    _, scheme = weight_scheme(name, qc, (FORMAT,))
    n, k = (int(v) for v in tensors.pop(f"{name}.weight_shape"))
    scale = tensors.pop(f"{name}.weight_scale")
    zp = tensors.pop(f"{name}.weight_zero_point", None)
    if scheme.symmetric or zp is None:
        zero = torch.zeros(scale.shape, dtype=torch.int32)
    else:
        zero = unpack_int32(zp.t().contiguous(), scheme.bits, n).t().to(torch.int32)
    g_idx = tensors.pop(f"{name}.weight_g_idx", None)
    g_idx = default_g_idx(k, scheme) if g_idx is None else g_idx.to(torch.int32)
    p = QuantParams(scheme, scale.float(), zero.contiguous(), g_idx)
    q = unpack_int32(tensors.pop(f"{name}.weight_packed"), scheme.bits, k)
    if q.shape[0] != n:
        raise OptcError(f"{name}: packed rows {q.shape[0]} != weight_shape {n}")
    # In float32 at least: the weights are then exactly the codes on the grid p holds (a product
    # rounded to bfloat16 scales would not be, and re-exporting it would re-round the codes).
    return dequantize(q, p, torch.promote_types(scale.dtype, torch.float32)), p


def read_pack_quantized(
    directory: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, QuantParams]]:
    """Dequantized float state dict and solved params of a pack-quantized checkpoint.

    Tied weights are absent, as on disk; load with ``strict=False`` and re-tie.
    """
    directory = Path(directory)
    qc = quantization_config(directory) or {}
    if qc.get("quant_method") != "compressed-tensors":
        raise OptcError(f"{directory} is not a compressed-tensors checkpoint")
    tensors = read_safetensors(directory)

    state: dict[str, torch.Tensor] = {}
    qparams: dict[str, QuantParams] = {}
    modules = [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]
    for name in modules:
        if _group_format(name, qc) not in (FORMAT, None):
            continue  # packed 4-bit floats (NVFP4, MXFP4): read by their own reader
        state[f"{name}.weight"], qparams[name] = dequantize_packed(name, tensors, qc)
    state.update(tensors)
    return state, qparams
