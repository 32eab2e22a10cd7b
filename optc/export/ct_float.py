"""compressed-tensors' floating-point weight formats: FP8 ``float-quantized``, ``nvfp4-pack-quantized``
and ``mxfp4-pack-quantized``.

Layout, checked against the installed compressed-tensors 0.20.1
(``compressors/naive_quantized/base.py``, ``compressors/nvfp4/{base,helpers}.py``,
``compressors/mxfp4/base.py``, ``compressors/mx_utils.py``, ``quantization/quant_scheme.py``'s
``FP8_DYNAMIC``, ``NVFP4A16`` and ``MXFP4A16`` presets):

- **FP8** (``float-quantized``): ``<m>.weight`` ``float8_e4m3fn`` ``[N, K]``, the codes themselves;
  ``<m>.weight_scale`` ``[N, 1]`` per channel (``[N, G]`` per group), float32: the scales the codes
  were chosen against, exactly (loaders cast them to the compute dtype). Strategy ``channel`` or
  ``group``; or ``block`` with ``block_structure [R, C]``: ``weight_scale`` ``[ceil(N/R), ceil(K/C)]``,
  one scale per tile (a short last tile where ``R`` or ``C`` does not divide, as compressed-tensors
  pads; vLLM's block kernels need ``K`` divisible by ``C``).
- **NVFP4** (``nvfp4-pack-quantized``): ``<m>.weight_packed`` uint8 ``[N, K/2]``, two E2M1 codes a
  byte, the even column in the low nibble (sign bit 3, magnitude index bits 0-2);
  ``<m>.weight_scale`` ``float8_e4m3fn`` ``[N, K/16]``; ``<m>.weight_global_scale`` float32 ``[1]``.
  Dequantization ``w = q * weight_scale / weight_global_scale``. Strategy ``tensor_group``.
- **MXFP4** (``mxfp4-pack-quantized``): ``weight_packed`` as NVFP4; ``<m>.weight_scale`` uint8
  ``[N, K/32]``, E8M0 exponents ``log2(s) + 127``; no global scale. Strategy ``group``.

The 4-bit formats need ``K`` to be a multiple of the group (16 or 32), as every runtime does.
"""

from __future__ import annotations

import torch

from optc.compress import fpquant
from optc.compress.quant import QuantParams, QuantScheme, default_g_idx, dequantize
from optc.errors import OptcError
from optc.export.packing import grid_codes

FP8_FORMAT = "float-quantized"
NVFP4_FORMAT = "nvfp4-pack-quantized"
MXFP4_FORMAT = "mxfp4-pack-quantized"
# scale_format of a float scheme -> the sub-format storing it.
FORMAT_OF = {"float": FP8_FORMAT, "e4m3": NVFP4_FORMAT, "e8m0": MXFP4_FORMAT}
FLOAT_FORMATS = tuple(FORMAT_OF.values())


def format_of(scheme: QuantScheme) -> str:
    return FORMAT_OF[scheme.scale_format or "float"]


def float_weights_args(scheme: QuantScheme) -> dict:
    """A float scheme's ``weights`` block (compressed-tensors ``QuantizationArgs``, as dumped)."""
    args = {"num_bits": scheme.bits, "type": "float", "symmetric": True, "group_size": scheme.group_size,
            "dynamic": False}
    if scheme.scale_format == "e4m3":
        return {**args, "strategy": "tensor_group", "scale_dtype": "torch.float8_e4m3fn"}
    if scheme.scale_format == "e8m0":
        return {**args, "strategy": "group", "scale_dtype": "torch.uint8"}
    if scheme.block_rows is not None:
        return {**args, "group_size": None, "strategy": "block", "block_structure": [scheme.block_rows,
                                                                                    scheme.group_size]}
    return {**args, "strategy": "channel" if scheme.group_size is None else "group"}


def float_scheme(name: str, args: dict) -> QuantScheme:
    """The scheme of a config group's float ``weights`` block."""
    strategy = args.get("strategy")
    bits, group = args.get("num_bits"), args.get("group_size")
    if bits == 8 and strategy == "block":
        rows, cols = args.get("block_structure") or (None, None)
        return QuantScheme(type="float", bits=8, group_size=cols, block_rows=rows)
    if bits == 8 and strategy in ("channel", "group"):
        return QuantScheme(type="float", bits=8, group_size=group if strategy == "group" else None)
    if bits == 4 and strategy in ("tensor_group", "group"):
        return QuantScheme(type="float", bits=4, group_size=group,
                           scale_format="e4m3" if strategy == "tensor_group" else "e8m0")
    raise OptcError(f"{name}: float weights with {bits} bits and strategy {strategy!r} are not supported")


def check_fits(name: str, weight: torch.Tensor, scheme: QuantScheme) -> None:
    g = scheme.group_size
    # Block scales over a short last tile are what compressed-tensors computes too (it pads).
    if g is not None and weight.shape[1] % g and scheme.block_rows is None:
        raise OptcError(f"{name}: {scheme.label()} needs in_features divisible by {g}, got {weight.shape[1]}; "
                        "ignore this Linear or give it another scheme")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``[N, K]`` (K even) as uint8 ``[N, K/2]``, the even column in the low nibble."""
    nib = fpquant.e2m1_nibbles(q)
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` back to float32 E2M1 values ``[N, K]``."""
    n = packed.shape[0]
    both = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return fpquant.e2m1_values(both.reshape(n, -1))


def compress_float(name: str, weight: torch.Tensor, p: QuantParams) -> dict:
    """The tensors of one Linear weight on its float grid ``p`` (names without the module prefix)."""
    check_fits(name, weight, p.scheme)
    q = grid_codes(name, weight, p)
    fmt = p.scheme.scale_format
    if fmt is None or fmt == "float":
        # A block scheme's rows share their scales: one row of them per tile of rows.
        scale = p.scale.float() if p.scheme.block_rows is None else p.scale.float()[:: p.scheme.block_rows]
        return {"weight": q.to(torch.float8_e4m3fn), "weight_scale": scale}
    out = {"weight_packed": pack_nibbles(q)}
    if fmt == "e8m0":
        out["weight_scale"] = fpquant.e8m0_encode(p.scale)
        return out
    gs = fpquant.nvfp4_global_scale(p.scale)
    stored = p.scale.float() * gs
    inexact = int((fpquant.round_e4m3(stored) != stored).sum())
    if inexact:
        # Scales more than 2^14 below the tensor's largest fall into E4M3's subnormals.
        raise OptcError(f"{name}: {inexact} NVFP4 group scales are below E4M3's range under the tensor's "
                        "largest; this weight cannot be stored exactly")
    out["weight_scale"] = stored.to(torch.float8_e4m3fn)
    out["weight_global_scale"] = gs.to(torch.float32)
    return out


def dequantize_float(name: str, tensors: dict[str, torch.Tensor], args: dict) -> tuple[torch.Tensor, QuantParams]:
    """Module ``name``'s float weight and params from its stored tensors (taken out of ``tensors``)."""
    scheme = float_scheme(name, args)
    scale = tensors.pop(f"{name}.weight_scale")
    if scheme.bits == 8:
        q = tensors.pop(f"{name}.weight").float()
        s = scale.float()
        if scheme.block_rows is not None:
            s = s.repeat_interleave(scheme.block_rows, dim=0)[: q.shape[0]]
    else:
        q = unpack_nibbles(tensors.pop(f"{name}.weight_packed"))
        if scheme.scale_format == "e8m0":
            s = fpquant.e8m0_decode(scale)
        else:
            s = scale.float() / tensors.pop(f"{name}.weight_global_scale").float()
    p = QuantParams(scheme, s, torch.zeros(s.shape, dtype=torch.int32), default_g_idx(q.shape[1], scheme))
    return dequantize(q, p, torch.float32), p
