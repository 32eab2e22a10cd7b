"""GGUF k-quants (Q2_K..Q6_K): the solver's grid invariants, and its super-blocks read back by a
reference decoder written here from llama.cpp's ``dequantize_row_q*_K`` (ggml-quants.c) and by
the ``gguf`` package's reader, bit for bit.

Block definitions (ggml ``ggml-common.h``, QK_K = 256): ``block_q2_K {uint8 scales[16]; uint8
qs[64]; half d, dmin;}``, ``block_q3_K {uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half
d;}``, ``block_q4_K {half d, dmin; uint8 scales[12]; uint8 qs[128];}``, ``block_q5_K {half d,
dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128];}``, ``block_q6_K {uint8 ql[128]; uint8
qh[64]; int8 scales[16]; half d;}``.
"""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
import torch

from optc.compress.kquant import K_TYPES, kdequant, kquant
from optc.export.gguf_format import encode_kblocks


def _f16(b: bytes) -> np.float32:
    return np.float32(np.frombuffer(b, dtype="<f2")[0])


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_block(kind: str, b: bytes) -> list[np.float32]:
    """256 weights of one super-block, following ggml's dequantize_row_q*_K loop by loop."""
    y = [np.float32(0)] * 256
    if kind == "q2_k":
        scales, q, d, dmin = b[:16], b[16:80], _f16(b[80:82]), _f16(b[82:84])
        i, s_i = 0, 0
        for n in range(0, 256, 128):
            shift = 0
            for _ in range(4):
                for half in (0, 16):
                    sc = scales[s_i]
                    s_i += 1
                    dl, ml = d * np.float32(sc & 0xF), dmin * np.float32(sc >> 4)
                    for l in range(16):
                        y[i] = dl * np.float32((q[n // 4 + half + l] >> shift) & 3) - ml
                        i += 1
                shift += 2
    elif kind == "q3_k":
        hm, q, raw, d = b[:32], b[32:96], b[96:108], _f16(b[108:110])
        aux = list(struct.unpack("<3I", raw)) + [0]
        tmp = aux[2]
        k1, k2 = 0x03030303, 0x0F0F0F0F
        aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4)
        aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)
        aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4)
        aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4)
        scales = np.frombuffer(struct.pack("<4I", *aux), dtype=np.int8)
        i, s_i, m = 0, 0, 1
        for n in range(0, 256, 128):
            shift = 0
            for _ in range(4):
                for half in (0, 16):
                    dl = d * np.float32(int(scales[s_i]) - 32)
                    s_i += 1
                    for l in range(16):
                        v = ((q[n // 4 + half + l] >> shift) & 3) - (0 if hm[half + l] & m else 4)
                        y[i] = dl * np.float32(v)
                        i += 1
                shift += 2
                m <<= 1
    elif kind in ("q4_k", "q5_k"):
        d, dmin, scales = _f16(b[0:2]), _f16(b[2:4]), b[4:16]
        qh = b[16:48] if kind == "q5_k" else None
        ql = b[48:176] if kind == "q5_k" else b[16:144]
        i, s_i, u1, u2 = 0, 0, 1, 2
        for j in range(0, 256, 64):
            for part, mask in ((0, u1), (1, u2)):
                sc, mn = _scale_min_k4(s_i + part, scales)
                d1, m1 = d * np.float32(sc), dmin * np.float32(mn)
                for l in range(32):
                    v = (ql[j // 2 + l] & 0xF) if part == 0 else (ql[j // 2 + l] >> 4)
                    if qh is not None and qh[l] & mask:
                        v += 16
                    y[i] = d1 * np.float32(v) - m1
                    i += 1
            s_i += 2
            u1 <<= 2
            u2 <<= 2
    else:  # q6_k
        ql, qh, sc, d = b[:128], b[128:192], np.frombuffer(b[192:208], dtype=np.int8), _f16(b[208:210])
        for n in range(2):
            L, H, S, Y = ql[64 * n:], qh[32 * n:], sc[8 * n:], 128 * n
            for l in range(32):
                is_ = l // 16
                q1 = ((L[l] & 0xF) | (((H[l] >> 0) & 3) << 4)) - 32
                q2 = ((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32
                q3 = ((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32
                q4 = ((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32
                for off, s_off, qv in ((0, 0, q1), (32, 2, q2), (64, 4, q3), (96, 6, q4)):
                    y[Y + l + off] = (d * np.float32(S[is_ + s_off])) * np.float32(qv)
    return y


def ref_decode(raw: np.ndarray, kind: str) -> np.ndarray:
    size = K_TYPES[kind].block_bytes
    out = []
    for row in raw:
        vals = []
        for b in range(row.size // size):
            vals += ref_block(kind, row[b * size:(b + 1) * size].tobytes())
        out.append(vals)
    return np.array(out, dtype=np.float32)


@pytest.fixture(scope="module")
def weights() -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(6, 512) * 0.02
    w[:, 5] *= 10  # an outlier column, as real Linears have
    w[1, 256:] = w[1, 256:].abs()  # a super-block of positive weights only (min at 0)
    w[2, :256] = 0  # an all-zero super-block
    return w


@pytest.mark.parametrize("kind", list(K_TYPES))
def test_blocks_decode_to_the_solver_grid_bit_for_bit(weights, kind) -> None:
    kq = kquant(weights, kind)
    raw = encode_kblocks(kq)
    assert raw.shape == (6, 2 * K_TYPES[kind].block_bytes)
    ours = kdequant(kq).numpy()
    assert np.array_equal(ref_decode(raw, kind), ours)
    assert np.array_equal(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind.upper()]), ours)
    assert np.all(ours[2, :256] == 0)


@pytest.mark.parametrize("kind", list(K_TYPES))
def test_codes_and_scale_codes_stay_in_their_fields(weights, kind) -> None:
    kt = K_TYPES[kind]
    kq = kquant(weights, kind)
    assert int(kq.u.max()) <= kt.levels
    lo, hi = kt.scale_codes
    assert lo <= int(kq.sc.min()) and int(kq.sc.max()) <= hi
    if kt.with_min:
        assert 0 <= int(kq.m.min()) and int(kq.m.max()) <= hi
        assert bool((kq.dmin.float() >= 0).all())


def test_error_falls_with_bits_and_importance_is_honoured(weights) -> None:
    w = weights[[0, 3, 4, 5]]
    errs = [float((kdequant(kquant(w, k)) - w).square().mean()) for k in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")]
    assert errs == sorted(errs, reverse=True)
    imp = torch.ones(512)
    imp[100:116] = 1000.0  # one sub-block's inputs carry nearly all the energy
    plain, weighted = kdequant(kquant(w, "q3_k")), kdequant(kquant(w, "q3_k", imp))
    cols = slice(100, 116)
    assert float((weighted - w)[:, cols].square().sum()) < float((plain - w)[:, cols].square().sum())


def test_rows_that_are_not_whole_super_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="K=576"):
        kquant(torch.zeros(2, 576), "q4_k")


@pytest.mark.parametrize(("kind", "bits", "with_min"), [("q4_0", 4, False), ("q5_0", 5, False), ("q8_0", 8, False),
                                                        ("q4_1", 4, True), ("q5_1", 5, True)])
def test_32_weight_blocks_by_the_weighted_search_beat_round_to_nearest(weights, kind, bits, with_min) -> None:
    from optc.compress.kquant import block32_quant
    from optc.export.gguf_format import encode_blocks

    w = weights[[0, 3, 4, 5]]
    imp = torch.rand(512) ** 3 * 10 + 0.01
    t = gguf.GGMLQuantizationType[kind.upper()]
    ours = gguf.quants.dequantize(encode_blocks(*block32_quant(w, bits, with_min, imp), kind), t)
    rtn = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), t), t)
    err = lambda x: float(((torch.from_numpy(x) - w).square() * imp).sum())  # noqa: E731
    assert err(ours) < err(rtn)
