"""compressed-tensors ``int-quantized`` (W8A8): int8 weights stored whole, activation scales beside them.

Layout, checked against compressed-tensors 0.20.1 (``compressors/naive_quantized/base.py``,
``quantization/lifecycle/{initialize,forward}.py``) and vLLM's W8A8 int8 scheme:

- ``<m>.weight`` int8 ``[N, K]``: the signed codes themselves (no packing).
- ``<m>.weight_scale`` ``[N, G]`` in the weight's dtype (``[N, 1]`` per channel);
  ``<m>.weight_zero_point`` int8 ``[N, G]`` only when asymmetric.
- ``<m>.input_scale`` ``[1]`` for static per-tensor activations; nothing for dynamic ones,
  whose scales the runtime computes per token (or per tensor) on the fly.

A checkpoint whose Linears are not all W8A8 (weight-only ones kept as pack-quantized) is
``mixed-precision`` with each config group naming its own format.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import get_args

import torch

from optc.compress.actquant import ActivationScheme, InputQuant
from optc.compress.quant import QuantParams, QuantScheme, default_g_idx, dequantize, quantize
from optc.errors import OptcError
from optc.export.ct_pack import (
    DEFAULT_SHARD_BYTES,
    _group_format,
    _scheme_for,
    _target_group_sizes,
    checked_linear,
    compress_weight,
    read_pack_quantized,
    weight_scheme,
    weights_args,
    write_ct_config,
)
from optc.export.ct_float import FLOAT_FORMATS, compress_float, dequantize_float, float_weights_args, format_of
from optc.export.ct_pack import FORMAT as PACK_FORMAT
from optc.export.files import quantization_config
from optc.export.packing import regroup, scales_in_dtype, splice, write_weights
from optc.export.source import ExportSource, ModelSource

log = logging.getLogger(__name__)

INT_FORMAT = "int-quantized"
MIXED_FORMAT = "mixed-precision"
# The observers ActivationScheme accepts; another name read from a file is free text, not kept.
_OBSERVERS = get_args(ActivationScheme.model_fields["observer"].annotation)


def _input_args(scheme: ActivationScheme) -> dict:
    args = {
        "num_bits": scheme.bits,
        "type": scheme.type,
        "symmetric": True,
        "group_size": scheme.group_size,
        "strategy": "tensor_group" if scheme.tensor_group else scheme.strategy,
        # NVFP4: the group scales dynamic, the tensor scale (input_global_scale) static.
        "dynamic": "local" if scheme.tensor_group else scheme.dynamic,
    }
    if scheme.tensor_group:
        args["scale_dtype"] = "torch.float8_e4m3fn"
    if not scheme.dynamic or scheme.tensor_group:
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


def _module_format(p: QuantParams, iq: InputQuant | None) -> str:
    if p.scheme.type == "float":
        return format_of(p.scheme)
    return PACK_FORMAT if iq is None else INT_FORMAT


def _compress_module(name: str, weight: torch.Tensor, p: QuantParams, iq: InputQuant | None) -> dict:
    if p.scheme.type == "float":
        out = compress_float(name, weight, p)
    elif iq is None:
        return compress_weight(name, weight, p)
    else:
        return _compress_int_module(weight, p, iq)
    if iq is not None and iq.scale is not None:
        out["input_scale"] = iq.scale.reshape(1).float()
    if iq is not None and iq.global_scale is not None:
        out["input_global_scale"] = iq.global_scale.reshape(1).float()
    return out


def write_int(src: ExportSource, directory: Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """Write a checkpoint whose Linears are not all integer weight-only: W8A8 Linears (in
    ``src.input_quant``) as ``int-quantized`` (int8 weights, ``input_scale`` when static), float
    grids as their own formats (:mod:`optc.export.ct_float`, FP8 inputs beside FP8 weights), the
    other quantized Linears as ``pack-quantized``; ``mixed-precision`` when more than one.

    Every Linear with activation quantization must have quantized weights (``qparams``):
    int8 GEMMs need both operands in int8.
    """
    qparams, input_quant = src.qparams, src.input_quant
    if not input_quant and not any(p.scheme.type == "float" for p in qparams.values()):
        raise OptcError("no Linear has activation quantization or a float grid; write pack-quantized instead")
    directory = Path(directory)
    stored, linears = set(src.keys()), set(src.linears())
    missing = sorted(set(input_quant) - set(qparams))
    if missing:
        raise OptcError(f"{missing[0]} quantizes its input but not its weights; int-quantized needs both")
    targets = _target_group_sizes(qparams, "per_layer")

    compressed: dict[str, dict[str, torch.Tensor]] = {}
    groups: dict[tuple, list[str]] = {}
    for name, p in qparams.items():
        checked_linear(src, name, stored, linears, "compressed-tensors")
        if p.actorder:
            raise OptcError(f"{name} uses act-order groups (permuted g_idx), which {INT_FORMAT} cannot store")
        if p.scheme.type == "int" and targets[name] != p.scheme.group_size:
            p = regroup(p, targets[name])
        iq = input_quant.get(name)
        if iq is not None and (iq.scheme.type == "float") != (p.scheme.type == "float"):
            raise OptcError(f"{name}: {iq.scheme.label()} inputs need weights on the same kind of grid, "
                            f"not {p.scheme.label()}")
        with torch.no_grad():
            compressed[name] = _compress_module(name, src.tensor(f"{name}.weight"), p, iq)
        act = None if iq is None else iq.scheme
        groups.setdefault((_module_format(p, iq), p.scheme, act), []).append(name)

    scales_in_dtype({n: t for n, t in compressed.items() if qparams[n].scheme.type == "int"}, src.dtype)
    files = write_weights(splice(src, compressed), directory, max_shard_bytes)

    config_groups = {}
    formats = set()
    for i, ((fmt, scheme, act), names) in enumerate(groups.items()):
        formats.add(fmt)
        config_groups[f"group_{i}"] = {
            "targets": names,
            "weights": float_weights_args(scheme) if scheme.type == "float" else weights_args(scheme, False),
            "input_activations": None if act is None else _input_args(act),
            "output_activations": None,
            "format": fmt,
        }
    fmt = formats.pop() if len(formats) == 1 else MIXED_FORMAT
    ignore = [n for n in src.linears() if n not in qparams]
    write_ct_config(src, directory, config_groups, ignore, fmt)
    summary = {
        "format": fmt,
        "bytes": sum(f.stat().st_size for f in files),
        "modules": len(compressed),
        "activation_modules": len(input_quant),
        "files": [f.name for f in files],
        "groups": {g: k[1].label() + ("" if k[2] is None else f" + {k[2].label()} inputs")
                   for g, k in zip(config_groups, groups)},
    }
    log.info("%s: %d modules, %d bytes in %s", fmt, summary["modules"], summary["bytes"], directory)
    return summary


def write_int_quantized(
    model: torch.nn.Module,
    qparams: dict[str, QuantParams],
    input_quant: dict[str, InputQuant],
    directory: Path,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict:
    """:func:`write_int` of a model in memory."""
    return write_int(ModelSource(model, None, qparams, input_quant), directory, max_shard_bytes=max_shard_bytes)


def read_compressed_tensors(
    directory: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, QuantParams], dict[str, InputQuant]]:
    """Dequantized float state dict, weight params and input quantization of a
    compressed-tensors checkpoint: pack-quantized, int-quantized or a mix of both."""
    directory = Path(directory)
    qc = quantization_config(directory) or {}
    # Packed groups first (that reader passes every other tensor through untouched).
    state, qparams = read_pack_quantized(directory)
    input_quant: dict[str, InputQuant] = {}
    names = [k.removesuffix(".weight_scale") for k in list(state) if k.endswith(".weight_scale")]
    for name in names:
        group = _scheme_for(name, qc["config_groups"])
        if _group_format(name, qc) in FLOAT_FORMATS:
            state[f"{name}.weight"], qparams[name] = dequantize_float(name, state, group["weights"])
        else:
            group, scheme = weight_scheme(name, qc, (INT_FORMAT, "naive-quantized"))
            q = state[f"{name}.weight"]
            scale = state.pop(f"{name}.weight_scale")
            zp = state.pop(f"{name}.weight_zero_point", None)
            zero = torch.zeros(scale.shape, dtype=torch.int32) if zp is None else zp.to(torch.int32)
            p = QuantParams(scheme, scale.float(), zero, default_g_idx(q.shape[1], scheme))
            state[f"{name}.weight"] = dequantize(q, p, scale.dtype)
            qparams[name] = p
        ia = group.get("input_activations")
        input_scale = state.pop(f"{name}.input_scale", None)
        input_global = state.pop(f"{name}.input_global_scale", None)
        state.pop(f"{name}.input_zero_point", None)
        if ia:
            input_quant[name] = _input_quant(name, ia, input_scale, input_global)
    return state, qparams, input_quant


def _input_quant(name: str, ia: dict, input_scale: torch.Tensor | None,
                 input_global: torch.Tensor | None) -> InputQuant:
    """A config group's ``input_activations`` block and the Linear's input scale tensors."""
    kind = (ia.get("type", "int"), ia.get("num_bits", 8), ia.get("strategy") or "tensor")
    nvfp4 = kind == ("float", 4, "tensor_group") and ia.get("dynamic") == "local"
    if not (nvfp4 or kind[:2] in (("int", 8), ("float", 8))) or not ia.get("symmetric", True):
        raise OptcError(f"{name}: only symmetric int8, FP8 or NVFP4 input activations are supported")
    observer = ia.get("observer")
    act = ActivationScheme(
        bits=kind[1],
        type=kind[0],
        strategy="group" if nvfp4 else kind[2],
        group_size=ia.get("group_size") if nvfp4 else None,
        dynamic=nvfp4 or bool(ia.get("dynamic", False)),
        **({"observer": observer} if observer in _OBSERVERS else {}),
    )
    if nvfp4:
        if input_global is None:
            raise OptcError(f"{name}: NVFP4 input activations but no {name}.input_global_scale")
        return InputQuant(act, global_scale=input_global.float().reshape(1))
    if not act.dynamic and input_scale is None:
        raise OptcError(f"{name}: static input activations but no {name}.input_scale")
    return InputQuant(act, None if act.dynamic else input_scale.float().reshape(1))
