"""compressed-tensors ``pack-quantized`` checkpoints (llm-compressor layout; transformers and vLLM load them).

Layout, checked against the installed compressed-tensors 0.20.1
(``compressors/pack_quantized/{base,helpers}.py``, ``quantization/lifecycle/initialize.py``):

- ``<m>.weight_packed`` int32 ``[N, ceil(K*b/32)]``: codes ``q + 2^(b-1)`` as one little-endian bit
  stream per row, element ``k`` at stream bits ``[k*b, (k+1)*b)``, word ``w`` holding stream bits
  ``[32w, 32w+32)``. Dense, as the installed helpers document ("no padding bits ... split across
  int32 boundaries"): a 3/5/6/7-bit element may straddle two words. Releases before
  compressed-tensors #732 padded each word instead; 2/4/8 bits are identical in both.
- ``<m>.weight_scale`` ``[N, G]`` in the weight's dtype (``[N, 1]`` per channel).
- ``<m>.weight_zero_point`` int32 ``[ceil(N*b/32), G]``, only when asymmetric: the same packing
  applied along the output dimension.
- ``<m>.weight_shape`` int64 ``[2]`` = ``[N, K]``.
- ``<m>.weight_g_idx`` int32 ``[K]``, only for act-order groups; 0.20.1 has dropped it (see
  :func:`write_pack_quantized`).
"""

from __future__ import annotations

import json
import logging
import math
import re
from importlib import metadata
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from optc.calibrate.observers import OBSERVERS
from optc.compress.actquant import ActivationScheme, InputQuant
from optc.compress.quant import QuantParams, QuantScheme, default_g_idx, dequantize, quantize
from optc.errors import OptcError
from optc.model.safetensors_io import model_state_dict, read_safetensors, write_safetensors
from optc.memory import trim

log = logging.getLogger(__name__)

FORMAT = "pack-quantized"
# The release whose layout this module implements; stamped when compressed-tensors is absent.
LAYOUT_VERSION = "0.20.1"
_ROWS_PER_CHUNK = 4096  # bounds the int64 working copy of a large weight
_MASK32 = 0xFFFFFFFF


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"pack-quantized holds 1..8-bit codes, got {bits} bits")


def _bit_positions(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Word index and bit shift of each of the 32 elements of a block (32 elements fill b words)."""
    start = torch.arange(32, device=device) * bits
    return start // 32, start % 32


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    n, k = q.shape
    blocks = math.ceil(k / 32)
    word, shift = _bit_positions(bits, q.device)
    u = F.pad(q.to(torch.int64) + (1 << (bits - 1)), (0, blocks * 32 - k)).view(n, blocks, 32)
    # Bit fields never overlap, so adding them is the same as OR-ing them.
    if 32 % bits == 0:
        # 2/4/8 bits: whole elements per word, word w = sum_i u[w * per + i] << (i * bits);
        # a broadcast shift and one sum, several times faster than the general scatter.
        per = 32 // bits
        words = (u.view(n, blocks * bits, per) << shift[:per]).sum(dim=2)
    else:
        words = torch.zeros(n, blocks, bits, dtype=torch.int64, device=q.device)
        words.index_add_(2, word, (u << shift) & _MASK32)
        spill = shift + bits > 32
        if spill.any():
            words.index_add_(2, word[spill] + 1, u[:, :, spill] >> (32 - shift[spill]))
        words = words.view(n, blocks * bits)
    words = words[:, : math.ceil(k * bits / 32)]
    # Reinterpret the unsigned 32-bit pattern as two's-complement int32.
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed codes ``q`` ([N, K], values in ``[-2^(b-1), 2^(b-1)-1]``) along the last dim."""
    _check_bits(bits)
    if q.dim() != 2 or q.is_floating_point():
        raise ValueError(f"expected a 2-D integer tensor, got {q.dtype} of shape {tuple(q.shape)}")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"codes outside [{lo}, {hi}] cannot be packed in {bits} bits")
    return torch.cat([_pack_rows(c, bits) for c in q.split(_ROWS_PER_CHUNK)])


def unpack_int32(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int8 signed codes ``[N, k]``."""
    _check_bits(bits)
    n, n_words = packed.shape
    if packed.dtype != torch.int32 or n_words != math.ceil(k * bits / 32):
        raise ValueError(
            f"expected int32 [N, {math.ceil(k * bits / 32)}] for K={k} at {bits} bits, "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    return torch.cat([_unpack_rows(c, bits, k) for c in packed.split(_ROWS_PER_CHUNK)])


def _unpack_rows(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    n, n_words = packed.shape
    blocks = math.ceil(k / 32)
    words = F.pad(packed.to(torch.int64) & _MASK32, (0, blocks * bits - n_words))
    words = words.view(n, blocks, bits)
    word, shift = _bit_positions(bits, packed.device)
    out = words[:, :, word] >> shift
    spill = shift + bits > 32
    if spill.any():
        out[:, :, spill] |= words[:, :, word[spill] + 1] << (32 - shift[spill])
    out = (out & ((1 << bits) - 1)).view(n, blocks * 32)[:, :k]
    return (out - (1 << (bits - 1))).to(torch.int8)


def even_group_size(group_size: int | None, k: int) -> int | None:
    """The largest group size that divides ``k`` and re-expresses ``group_size`` groups exactly.

    ``None`` (per channel) when a single group spans the row.
    """
    if group_size is None or k % group_size == 0:
        return group_size
    return None if math.ceil(k / group_size) == 1 else math.gcd(group_size, k)


def regroup(p: QuantParams, group_size: int | None) -> QuantParams:
    """``p`` re-expressed with finer groups of ``group_size`` columns (``None``: one group per row).

    compressed-tensors 0.20.1 sizes scales ``[N, ceil(K/g)]`` but its group dequantization
    rejects ``K % g != 0``. When ``group_size`` divides both K and the old group size, each new
    group lies inside one old group, so repeating scales and zeros is exact.
    """
    g, k = p.scheme.group_size, p.g_idx.numel()
    if group_size == g:
        return p
    if p.actorder:
        raise ValueError("act-order groups cannot be regrouped")
    scheme = QuantScheme(bits=p.scheme.bits, symmetric=p.scheme.symmetric, group_size=group_size)
    g_idx = default_g_idx(k, scheme).to(p.g_idx.device)
    if group_size is None:
        if p.scale.shape[1] != 1:
            raise ValueError(f"{p.scale.shape[1]} groups cannot become one per-channel scale")
        return QuantParams(scheme, p.scale, p.zero, g_idx)
    if g is None or g % group_size or k % group_size:
        raise ValueError(f"group size {group_size} does not split groups of {g} over K={k}")
    old = (torch.arange(k // group_size, device=p.scale.device) * group_size) // g
    return QuantParams(scheme, p.scale[:, old], p.zero[:, old], g_idx)


def _target_group_sizes(
    qparams: dict[str, QuantParams], mode: str
) -> dict[str, int | None]:
    """Group size to store each module with (see ``uneven_groups`` of write_pack_quantized)."""
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
    shared: dict[QuantScheme, int] = {}
    for p in qparams.values():
        if p.scheme.group_size is not None and not p.actorder:
            g = shared.get(p.scheme, p.scheme.group_size)
            shared[p.scheme] = math.gcd(g, p.g_idx.numel())
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


def _weights_args(scheme: QuantScheme, actorder: bool) -> dict:
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


def _compress_module(
    name: str, weight: torch.Tensor, p: QuantParams
) -> dict[str, torch.Tensor]:
    q = quantize(weight, p)
    off_grid = (dequantize(q, p, weight.dtype) != weight).float().mean().item()
    if off_grid:
        # Export stores the nearest codes; a fake-quantized model should match them exactly.
        log.warning("%s: %.2f%% of weights are not on their quantization grid", name, 100 * off_grid)
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


def pack_linear(
    name: str, module: torch.nn.Module | None, p: QuantParams, group_size: int | None
) -> tuple[dict[str, torch.Tensor], tuple]:
    """The pack-quantized tensors of one fake-quantized Linear, stored with ``group_size``
    (see :func:`regroup`), and its config-group key ``(bits, symmetric, group_size, actorder)``."""
    if not isinstance(module, torch.nn.Linear):
        raise OptcError(f"{name!r} is not an nn.Linear of this model; pack-quantized covers Linears only")
    if p.actorder and not _ct_accepts_g_idx():
        raise OptcError(
            f"{name} uses act-order groups (permuted g_idx), which compressed-tensors "
            f"{_ct_version()} no longer loads (actorder 'group' was removed); "
            "quantize with static groups (actorder 'weight') instead"
        )
    if group_size != p.scheme.group_size:
        stored = regroup(p, group_size)
        log.info("%s (K=%d): %s stored as %s", name, module.in_features, p.scheme.label(), stored.scheme.label())
        p = stored
    with torch.no_grad():
        tensors = _compress_module(name, module.weight, p)
    return tensors, (p.scheme.bits, p.scheme.symmetric, p.scheme.group_size, p.actorder)


def write_pack_quantized_config(model: torch.nn.Module, groups: dict[tuple, list[str]], directory: Path) -> dict:
    """``config.json`` (and the generation config) of a pack-quantized checkpoint; ``groups``
    maps :func:`pack_linear` keys to module names, in order. Returns the config groups."""
    config_groups = {}
    for i, ((bits, sym, gs, actorder), names) in enumerate(groups.items()):
        scheme = QuantScheme(bits=bits, symmetric=sym, group_size=gs)
        config_groups[f"group_{i}"] = {
            # Exact module names: compressed-tensors and vLLM match targets by exact name, "re:"
            # regex or class name; names keep mixed-precision assignments unambiguous.
            "targets": names,
            "weights": _weights_args(scheme, actorder),
            "input_activations": None,
            "output_activations": None,
            "format": FORMAT,
        }
    quantized = {n for names in groups.values() for n in names}
    ignore = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in quantized]
    # Same block ModelCompressor.update_config writes.
    _write_quantized_config(model, Path(directory), config_groups, ignore, FORMAT)
    return config_groups


def write_pack_quantized(
    model: torch.nn.Module,
    qparams: dict[str, QuantParams],
    directory: Path,
    *,
    uneven_groups: Literal["per_layer", "uniform", "keep"] = "per_layer",
    max_shard_bytes: int = 2 * 1024**3,
) -> dict:
    """Write ``model`` (fake-quantized Linears described by ``qparams``) as a pack-quantized checkpoint.

    compressed-tensors cannot dequantize a layer whose group size does not divide K, so such
    layers are stored with exactly equivalent finer groups (:func:`regroup`):
    ``"per_layer"`` regroups only those layers (fewest extra scales, one more config group);
    ``"uniform"`` gives all layers of a scheme one common size (one config group per scheme,
    which transformers' ``dequantize=True`` load path requires); ``"keep"`` stores
    compressed-tensors' own ``[N, ceil(K/g)]`` layout, which it cannot load.
    """
    if not qparams:
        raise OptcError("no quantized modules to export as pack-quantized")
    directory = Path(directory)
    modules = dict(model.named_modules())
    state = model_state_dict(model)
    targets = _target_group_sizes(qparams, uneven_groups)

    packed: dict[str, dict[str, torch.Tensor]] = {}
    groups: dict[tuple, list[str]] = {}
    regrouped: dict[str, int | None] = {}
    for name, p in qparams.items():
        module = modules.get(name)
        if f"{name}.weight" not in state and isinstance(module, torch.nn.Linear):
            raise OptcError(f"{name}.weight is tied to another tensor; a tied weight cannot be quantized alone")
        packed[name], key = pack_linear(name, module, p, targets[name])
        trim()  # the packing temporaries (a few MB) would otherwise stay as heap fragments
        if key[2] != p.scheme.group_size:
            regrouped[name] = key[2]
        groups.setdefault(key, []).append(name)

    tensors: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        mod, _, leaf = key.rpartition(".")
        if leaf == "weight" and mod in packed:
            tensors.update({f"{mod}.{k}": v for k, v in packed[mod].items()})
        else:
            tensors[key] = t
    files = write_safetensors(tensors, directory, max_shard_bytes=max_shard_bytes)

    config_groups = write_pack_quantized_config(model, groups, directory)
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


def read_pack_quantized(
    directory: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, QuantParams]]:
    """Dequantized float state dict and solved params of a pack-quantized checkpoint.

    Tied weights are absent, as on disk; load with ``strict=False`` and re-tie.
    """
    directory = Path(directory)
    qc = json.loads((directory / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        raise OptcError(f"{directory} is not a compressed-tensors checkpoint")
    tensors = read_safetensors(directory)

    state: dict[str, torch.Tensor] = {}
    qparams: dict[str, QuantParams] = {}
    modules = [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]
    for name in modules:
        state[f"{name}.weight"], qparams[name] = dequantize_packed(name, tensors, qc)
    state.update(tensors)
    return state, qparams


def _weight_scheme(name: str, qc: dict, formats: tuple[str, ...]) -> tuple[dict, QuantScheme]:
    """Module ``name``'s config group in ``quantization_config`` ``qc`` and its weight scheme;
    the group's format must be one of ``formats`` (the first names it in the error)."""
    group = _scheme_for(name, qc["config_groups"])
    fmt = group.get("format") or qc.get("format")
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
    _, scheme = _weight_scheme(name, qc, (FORMAT,))
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
    return dequantize(q, p, scale.dtype), p


# --------------------------------------------------------------------------------------------
# int-quantized (W8A8): int8 weights stored whole, activation scales beside them
#
# Layout, checked against compressed-tensors 0.20.1 (``compressors/naive_quantized/base.py``,
# ``quantization/lifecycle/{initialize,forward}.py``) and vLLM's W8A8 int8 scheme:
#
# - ``<m>.weight`` int8 ``[N, K]``: the signed codes themselves (no packing).
# - ``<m>.weight_scale`` ``[N, G]`` in the weight's dtype (``[N, 1]`` per channel);
#   ``<m>.weight_zero_point`` int8 ``[N, G]`` only when asymmetric.
# - ``<m>.input_scale`` ``[1]`` for static per-tensor activations; nothing for dynamic ones,
#   whose scales the runtime computes per token (or per tensor) on the fly.
#
# A checkpoint whose Linears are not all W8A8 (weight-only ones kept as pack-quantized) is
# ``mixed-precision`` with each config group naming its own format.

INT_FORMAT = "int-quantized"
MIXED_FORMAT = "mixed-precision"


def _input_args(scheme: ActivationScheme) -> dict:
    args = {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": True,
        "group_size": None,
        "strategy": scheme.strategy,
        "dynamic": scheme.dynamic,
    }
    if not scheme.dynamic:
        # Free text in compressed-tensors' QuantizationArgs: records how the scale was chosen.
        args["observer"] = scheme.observer
    return args


def _compress_int_module(weight: torch.Tensor, p: QuantParams, iq: InputQuant) -> dict[str, torch.Tensor]:
    scale_dtype = weight.dtype if weight.is_floating_point() else torch.float16
    out = {"weight": quantize(weight, p), "weight_scale": p.scale.to(scale_dtype)}
    if not p.scheme.symmetric:
        out["weight_zero_point"] = p.zero.to(torch.int8)
    if iq.scale is not None:
        out["input_scale"] = iq.scale.reshape(1).to(scale_dtype)
    return out


def write_int_quantized(
    model: torch.nn.Module,
    qparams: dict[str, QuantParams],
    input_quant: dict[str, InputQuant],
    directory: Path,
    *,
    max_shard_bytes: int = 2 * 1024**3,
) -> dict:
    """Write a W8A8 checkpoint: Linears in ``input_quant`` as ``int-quantized`` (int8 weights,
    ``input_scale`` when static), other quantized Linears as ``pack-quantized``.

    Every Linear with activation quantization must have quantized weights (``qparams``):
    int8 GEMMs need both operands in int8.
    """
    if not input_quant:
        raise OptcError("no Linear has activation quantization; write pack-quantized instead")
    directory = Path(directory)
    modules = dict(model.named_modules())
    state = model_state_dict(model)
    missing = sorted(set(input_quant) - set(qparams))
    if missing:
        raise OptcError(f"{missing[0]} quantizes its input but not its weights; int-quantized needs both")
    targets = _target_group_sizes(qparams, "per_layer")

    compressed: dict[str, dict[str, torch.Tensor]] = {}
    groups: dict[tuple, list[str]] = {}
    for name, p in qparams.items():
        module = modules.get(name)
        if not isinstance(module, torch.nn.Linear):
            raise OptcError(f"{name!r} is not an nn.Linear of this model; compressed-tensors covers Linears only")
        if f"{name}.weight" not in state:
            raise OptcError(f"{name}.weight is tied to another tensor; a tied weight cannot be quantized alone")
        if p.actorder:
            raise OptcError(f"{name} uses act-order groups (permuted g_idx), which {INT_FORMAT} cannot store")
        if targets[name] != p.scheme.group_size:
            p = regroup(p, targets[name])
        iq = input_quant.get(name)
        with torch.no_grad():
            if iq is None:
                compressed[name] = _compress_module(name, module.weight, p)
            else:
                compressed[name] = _compress_int_module(module.weight, p, iq)
        act_key = None if iq is None else (iq.scheme.strategy, iq.scheme.dynamic, iq.scheme.observer if not iq.scheme.dynamic else None)
        key = (p.scheme.bits, p.scheme.symmetric, p.scheme.group_size, act_key)
        groups.setdefault(key, []).append(name)

    tensors: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        mod, _, leaf = key.rpartition(".")
        if leaf == "weight" and mod in compressed:
            tensors.update({f"{mod}.{k}": v for k, v in compressed[mod].items()})
        else:
            tensors[key] = t
    files = write_safetensors(tensors, directory, max_shard_bytes=max_shard_bytes)

    config_groups = {}
    formats = set()
    for i, ((bits, sym, gs, act_key), names) in enumerate(groups.items()):
        fmt = FORMAT if act_key is None else INT_FORMAT
        formats.add(fmt)
        config_groups[f"group_{i}"] = {
            "targets": names,
            "weights": _weights_args(QuantScheme(bits=bits, symmetric=sym, group_size=gs), False),
            "input_activations": None if act_key is None else _input_args(input_quant[names[0]].scheme),
            "output_activations": None,
            "format": fmt,
        }
    fmt = formats.pop() if len(formats) == 1 else MIXED_FORMAT
    ignore = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear) and n not in qparams]
    _write_quantized_config(model, directory, config_groups, ignore, fmt)
    summary = {
        "format": fmt,
        "bytes": sum(f.stat().st_size for f in files),
        "modules": len(compressed),
        "activation_modules": len(input_quant),
        "files": [f.name for f in files],
    }
    log.info("%s: %d modules, %d bytes in %s", fmt, summary["modules"], summary["bytes"], directory)
    return summary


def _write_quantized_config(
    model: torch.nn.Module, directory: Path, config_groups: dict, ignore: list[str], fmt: str
) -> None:
    quant_config = {
        "version": _ct_version(),
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        "config_groups": config_groups,
        "format": fmt,
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "ignore": ignore,
    }
    config = model.config.to_dict()
    config["dtype"] = str(model.dtype).removeprefix("torch.")
    config["quantization_config"] = quant_config
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


def read_compressed_tensors(
    directory: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, QuantParams], dict[str, InputQuant]]:
    """Dequantized float state dict, weight params and input quantization of a
    compressed-tensors checkpoint: pack-quantized, int-quantized or a mix of both."""
    directory = Path(directory)
    qc = json.loads((directory / "config.json").read_text()).get("quantization_config") or {}
    # Packed groups first (that reader passes every other tensor through untouched).
    state, qparams = read_pack_quantized(directory)
    input_quant: dict[str, InputQuant] = {}
    names = [k.removesuffix(".weight_scale") for k in list(state) if k.endswith(".weight_scale")]
    for name in names:
        group, scheme = _weight_scheme(name, qc, (INT_FORMAT, "naive-quantized"))
        q = state[f"{name}.weight"]
        scale = state.pop(f"{name}.weight_scale")
        zp = state.pop(f"{name}.weight_zero_point", None)
        zero = torch.zeros(scale.shape, dtype=torch.int32) if zp is None else zp.to(torch.int32)
        p = QuantParams(scheme, scale.float(), zero, default_g_idx(q.shape[1], scheme))
        state[f"{name}.weight"] = dequantize(q, p, scale.dtype)
        qparams[name] = p
        ia = group.get("input_activations")
        input_scale = state.pop(f"{name}.input_scale", None)
        state.pop(f"{name}.input_zero_point", None)
        if ia:
            if ia.get("type", "int") != "int" or not ia.get("symmetric", True):
                raise OptcError(f"{name}: only symmetric int input activations are supported")
            observer = ia.get("observer")
            act = ActivationScheme(
                bits=ia.get("num_bits", 8),
                strategy=ia.get("strategy") or "tensor",
                dynamic=bool(ia.get("dynamic", False)),
                **({"observer": observer} if observer in OBSERVERS else {}),
            )
            if not act.dynamic and input_scale is None:
                raise OptcError(f"{name}: static input activations but no {name}.input_scale")
            input_quant[name] = InputQuant(act, None if act.dynamic else input_scale.float().reshape(1))
    return state, qparams, input_quant


# --------------------------------------------------------------------------------------------
# Sparsity metadata (pruned models are stored dense, with their zeros)


def sparsity_config(model: torch.nn.Module, masks: dict[str, torch.Tensor]) -> dict:
    """The ``sparsity_config`` block of compressed-tensors for a model pruned in place.

    Fields as ``compressed_tensors.config.SparsityCompressionConfig`` 0.20.1 defines them:
    ``format`` ``dense`` (the weights are stored uncompressed, zeros included, so every loader
    reads them), ``targets`` the pruned Linears, ``ignore`` the other Linears,
    ``global_sparsity`` the share of zeros over all of the model's parameters, and
    ``sparsity_structure`` ``"N:M"`` when every pruned Linear is N:M along its input dimension
    (checked on the weights, not taken from the recipe), else ``unstructured``.
    """
    modules = dict(model.named_modules())
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in params)
    zeros = sum(int((p == 0).sum()) for p in params)
    return {
        "format": "dense",
        "targets": sorted(masks),
        "ignore": sorted(n for n, m in modules.items() if isinstance(m, torch.nn.Linear) and n not in masks),
        "global_sparsity": round(zeros / max(1, total), 6),
        "sparsity_structure": _common_structure([modules[n].weight for n in masks if n in modules]),
    }


def _common_structure(weights: list[torch.Tensor]) -> str:
    """``"N:M"`` if all weights hold at most N non-zeros in every M consecutive inputs (the
    smallest M of 4, 8, 16 and the N seen), else ``"unstructured"``."""
    if not weights:
        return "unstructured"
    for m in (4, 8, 16):
        if any(w.shape[-1] % m for w in weights):
            continue
        n = max(int((w.reshape(w.shape[0], -1, m) != 0).sum(-1).max()) for w in weights)
        if n < m and n * 2 <= m:  # denser groups are not N:M sparsity anyone accelerates
            return f"{n}:{m}"
    return "unstructured"


def write_sparsity_config(directory: Path, block: dict) -> None:
    """Add ``block`` as ``quantization_config.sparsity_config`` of ``directory/config.json``.

    A quantized checkpoint already has a compressed-tensors ``quantization_config``; a dense
    one gets the minimal one llm-compressor writes for sparse-only models (no config groups,
    format ``dense``), which transformers loads through compressed-tensors unchanged.
    """
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    qc = config.get("quantization_config")
    if qc is None:
        qc = {
            "version": _ct_version(),
            "quant_method": "compressed-tensors",
            "config_groups": {},
            "format": "dense",
            "quantization_status": "compressed",
            "ignore": [],
            "transform_config": {},
        }
    elif qc.get("quant_method") != "compressed-tensors":
        raise OptcError(f"{path}: sparsity metadata needs a compressed-tensors config, not {qc.get('quant_method')!r}")
    qc["sparsity_config"] = block
    config["quantization_config"] = qc
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
