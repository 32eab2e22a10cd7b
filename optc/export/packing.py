"""Tensor code every format writer shares: bit packing into int32 words, re-expressing a grid
with other groups, the codes of a fake-quantized weight, and splicing packed tensors into a
checkpoint's state dict.

Packing (``pack_int32``, the layout compressed-tensors 0.20.1 documents and GPTQ/AWQ reuse):
codes ``q + 2^(b-1)`` as one little-endian bit stream per row, element ``k`` at stream bits
``[k*b, (k+1)*b)``, word ``w`` holding stream bits ``[32w, 32w+32)``. Dense: a 3/5/6/7-bit
element may straddle two words (2/4/8 bits never do).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

from optc.compress.quant import QuantParams, QuantScheme, default_g_idx, dequantize, quantize
from optc.errors import OptcError
from optc.model.safetensors_io import Entry, write_safetensors, write_sharded

log = logging.getLogger(__name__)

_ROWS_PER_CHUNK = 4096  # bounds the int64 working copy of a large weight
_MASK32 = 0xFFFFFFFF


# --- bit packing ------------------------------------------------------------------------------


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


# --- GPTQ layout: codes along the input dimension, v1 zero points (optc.export.gptq_format) ----


def pack_qweight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes ``q`` ([N, K]) as GPTQ ``qweight`` ([K*b/32, N] int32)."""
    # pack_int32 writes q + 2^(b-1) as one little-endian stream per row, which is GPTQ's column
    # stream once transposed.
    return pack_int32(q, bits).t().contiguous()


def unpack_qweight(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Signed codes [N, K] of a GPTQ ``qweight``."""
    return unpack_int32(qweight.t().contiguous(), bits, k)


def pack_qzeros(zero: torch.Tensor, bits: int, v1: bool = True) -> torch.Tensor:
    """Signed zero points ([N, G]) as GPTQ ``qzeros`` ([G, N*b/32] int32); v1 stores zero - 1."""
    stored = zero.to(torch.int32) - (1 if v1 else 0)
    return pack_int32(stored.t().contiguous(), bits)


def unpack_qzeros(qzeros: torch.Tensor, bits: int, n: int, v1: bool = True) -> torch.Tensor:
    """Signed zero points [N, G] (int32) of a GPTQ ``qzeros``."""
    stored = unpack_int32(qzeros, bits, n).to(torch.int32)
    return (stored + (1 if v1 else 0)).t().contiguous()


def v1_representable(q: torch.Tensor, p: QuantParams, name: str = "") -> tuple[torch.Tensor, QuantParams]:
    """Codes and params with every zero point storable as v1's ``zero - 1``.

    An asymmetric group whose unsigned zero is 0 cannot be stored in v1 (``-1`` wraps to all
    ones and reads back as ``2^b``; GPTQModel: "v1 checkpoint format with sym=False ... will
    overflow"). When such a group never uses the top code, shifting its codes and its zero up
    by one is exact; otherwise the grid does not fit v1 and the export is refused.
    """
    low = p.zero == p.scheme.qmin  # [N, G]
    if not bool(low.any()):
        return q, p
    g_idx = p.g_idx.long()
    member = low[:, g_idx]  # [N, K]: column k's group has zero 0
    top = torch.zeros(low.shape, dtype=torch.int32, device=q.device).index_add_(
        1, g_idx, (q == p.scheme.qmax).to(torch.int32)
    ) > 0
    top &= low
    if bool(top.any()):
        raise OptcError(
            f"{name}: {int(top.sum())} asymmetric group(s) have zero point 0 and use the top code; "
            "GPTQ v1 stores zero - 1 and cannot hold them (export compressed-tensors, or quantize "
            "symmetric)"
        )
    log.info("%s: %d group(s) with zero point 0 shifted up by one code (exact)", name, int(low.sum()))
    shifted = QuantParams(p.scheme, p.scale, p.zero + low.to(p.zero.dtype), p.g_idx)
    return (q.to(torch.int16) + member.to(torch.int16)).to(torch.int8), shifted


# --- AWQ GEMM layout: 4-bit codes along the output dimension, interleaved (optc.export.awq_format)

AWQ_BITS = 4
AWQ_PACK = 32 // AWQ_BITS
# Nibble i of each word holds column AWQ_ORDER[i] of its 8-column block (AutoAWQ's order_map).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _interleave_index(n: int, device: torch.device) -> torch.Tensor:
    """Column read into each packed position: position 8c + i holds column 8c + AWQ_ORDER[i]."""
    base = torch.arange(0, n, AWQ_PACK, device=device).unsqueeze(1)
    return (base + torch.tensor(AWQ_ORDER, device=device)).reshape(-1)


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit codes ``[R, N]`` (rows = input columns, or groups) packed ``[R, N/8]`` with AWQ's interleave."""
    if q.shape[1] % AWQ_PACK:
        raise ValueError(f"AWQ packs outputs in words of {AWQ_PACK}; N={q.shape[1]}")
    return pack_int32(q[:, _interleave_index(q.shape[1], q.device)], AWQ_BITS)


def unpack_awq(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_awq`: signed codes ``[R, n]`` (int8)."""
    interleaved = unpack_int32(packed, AWQ_BITS, n)
    out = torch.empty_like(interleaved)
    out[:, _interleave_index(n, packed.device)] = interleaved
    return out


# --- groups -----------------------------------------------------------------------------------


def fit_group_size(group_size: int | None, ks: Iterable[int]) -> int | None:
    """The largest group size that divides ``group_size`` and every K in ``ks``: groups of it
    re-express groups of ``group_size`` exactly in every row (``None``, per channel, stays)."""
    if group_size is None:
        return None
    size = group_size
    for k in ks:
        size = math.gcd(size, k)
    return size


def even_group_size(group_size: int | None, k: int) -> int | None:
    """The largest group size that divides ``k`` and re-expresses ``group_size`` groups exactly.

    ``None`` (per channel) when a single group spans the row.
    """
    if group_size is not None and k < group_size:
        return None
    return fit_group_size(group_size, [k])


def regroup(p: QuantParams, group_size: int | None) -> QuantParams:
    """``p`` with contiguous groups of ``group_size`` columns (``None``: one per row), exactly.

    Exact when every new group lies inside one old group, i.e. ``g_idx`` is constant on each run
    of ``group_size`` columns (a finer split of contiguous groups, or any split of one group):
    scales and zeros are repeated. compressed-tensors 0.20.1 sizes scales ``[N, ceil(K/g)]`` but
    rejects ``K % g != 0`` when dequantizing; GPTQ and AWQ configs hold one group size.
    """
    if group_size == p.scheme.group_size:
        return p
    if p.actorder:
        raise ValueError("act-order groups cannot be regrouped")
    k = p.g_idx.numel()
    scheme = QuantScheme(bits=p.scheme.bits, symmetric=p.scheme.symmetric, group_size=group_size)
    if group_size is None:
        if bool((p.g_idx != p.g_idx[0]).any()):
            raise ValueError(f"{p.scale.shape[1]} groups cannot become one per-channel scale")
        old = p.g_idx[:1].long()
    else:
        if k % group_size:
            raise ValueError(f"group size {group_size} does not divide K={k}")
        runs = p.g_idx.view(-1, group_size)
        if bool((runs != runs[:, :1]).any()):
            raise ValueError(f"groups of {group_size} columns would straddle the checkpoint's groups")
        old = runs[:, 0].long()
    return QuantParams(scheme, p.scale[:, old], p.zero[:, old], default_g_idx(k, scheme).to(p.g_idx.device))


# --- codes and checkpoints --------------------------------------------------------------------


def grid_codes(name: str, weight: torch.Tensor, p: QuantParams) -> torch.Tensor:
    """Signed codes of ``weight`` on ``p``; warns when the weight is not on its grid (then the file
    holds the nearest codes, not the weight)."""
    q = quantize(weight, p)
    off = float((dequantize(q, p, weight.dtype) != weight).float().mean())
    if off:
        log.warning("%s: %.2f%% of weights are not on their quantization grid", name, 100 * off)
    return q


def scales_in_dtype(packed: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype | None) -> None:
    """compressed-tensors' ``*_scale`` tensors in the checkpoint's declared dtype (in place): the
    scales are made in the calibrated weight's dtype, which a stored dtype chosen below it
    (bfloat16 from a float32 GGUF) does not change. A no-op when the two agree."""
    if dtype is None or not dtype.is_floating_point:
        return
    for tensors in packed.values():
        for leaf, t in tensors.items():
            if leaf.endswith("_scale") and t.is_floating_point() and t.dtype != dtype:
                tensors[leaf] = t.to(dtype)


def splice(src, packed: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, Entry]:
    """The checkpoint's entries in state-dict order: each packed module's tensors where its
    ``weight`` was, every other tensor of ``src`` unchanged."""
    entries: dict[str, Entry] = {}
    for key in src.keys():
        mod, _, leaf = key.rpartition(".")
        if leaf == "weight" and mod in packed:
            entries.update({f"{mod}.{k}": v for k, v in packed[mod].items()})
        else:
            entries[key] = src.entry(key)
    # KV-cache scales (compressed-tensors' kv_cache_scheme): one [1] float32 tensor each for
    # the keys and the values of every attention layer, beside its projections.
    for name, kq in src.kv_quant.items():
        entries[f"{name}.k_scale"] = kq.k_scale.reshape(1).float()
        entries[f"{name}.v_scale"] = kq.v_scale.reshape(1).float()
    return entries


def write_weights(entries: Mapping[str, Entry], directory: Path, max_shard_bytes: int) -> list[Path]:
    """``model.safetensors`` or shards plus index. Tensors in memory go through
    :func:`write_safetensors` (aliases stored once, stale shards removed); entries read from disk
    are written one at a time, in the same shard plan and bytes."""
    if all(isinstance(e, torch.Tensor) for e in entries.values()):
        return write_safetensors(dict(entries), directory, max_shard_bytes=max_shard_bytes)
    return write_sharded(dict(entries), directory, max_shard_bytes)
