"""GGUF k-quant grids: super-blocks of 256 weights whose sub-block scales are themselves quantized
(llama.cpp's "k-quants", ``ggml-quants.c``; Kawrakow, llama.cpp PR 1684, 2023).

Notation, per row of ``W`` along the input dimension: a super-block of ``QK_K = 256`` weights is
cut into ``S`` sub-blocks of ``g`` weights (``g = 16`` or ``32``). Sub-block ``j`` has the scale
``s_j = d * sc_j`` and, in the types with a min, the offset ``o_j = dmin * m_j``; ``d`` and ``dmin``
are float16 per super-block, ``sc_j`` and ``m_j`` integers of ``scale_bits`` bits. A weight is

- ``x = s_j * u - o_j``, ``u`` in ``[0, 2^b - 1]`` (Q2_K, Q4_K, Q5_K: "type-1", with a min);
- ``x = s_j * q``, ``q`` in ``[-2^(b-1), 2^(b-1) - 1]`` (Q3_K, Q6_K: "type-0", centred; their
  scale codes are signed, and this module uses the non-negative half).

The solver is an importance-weighted least-squares search, per sub-block, then per super-block:

1. for each sub-block, a set of candidate step sizes around ``range / levels`` gives codes ``L``
   by rounding; for each, ``(s, o)`` are refitted by weighted least squares given ``L`` (the
   2x2 normal equations; ``o >= 0``, i.e. the min never above 0), and the candidate of least
   weighted error ``sum_i w_i (x_i - x_hat_i)^2`` is kept (llama.cpp's ``make_qkx2_quants`` and
   ``make_qx_quants`` search the same family);
2. the super-block scale is ``d = fp16(max_j s_j / scmax)`` and ``sc_j = round(s_j / d)`` (the
   same for ``dmin``, ``m_j``), so the largest sub-block keeps its step and the others round to
   the nearest multiple of ``d``;
3. the codes are re-rounded on the stored grid (nearest level: the error of each weight is
   separable once the grid is fixed).

``w_i`` is the importance of the weight's input column, ``diag(X^T X)`` of the calibration inputs
(what llama.cpp calls the importance matrix), or 1: the output error of a Linear is
``sum_k (X^T X)_kk e_k^2`` when its inputs are uncorrelated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256


@dataclass(frozen=True)
class KType:
    """One k-quant type: code bits, weights per sub-block, a min or centred, bits per scale code
    (and min code), and the bytes of one super-block."""

    bits: int
    group: int
    with_min: bool
    scale_bits: int
    block_bytes: int

    @property
    def subblocks(self) -> int:
        return QK_K // self.group

    @property
    def levels(self) -> int:
        return 2**self.bits - 1

    @property
    def scale_codes(self) -> tuple[int, int]:
        """Range of the scale codes: unsigned for the types with a min, signed for the centred
        types (Q3_K stores ``sc + 32`` in 6 bits, Q6_K an int8)."""
        if self.with_min:
            return 0, 2**self.scale_bits - 1
        return -(2 ** (self.scale_bits - 1)), 2 ** (self.scale_bits - 1) - 1

    @property
    def stored_bits(self) -> float:
        return self.block_bytes * 8 / QK_K


# ggml-common.h: block_q2_K (scales[16], qs[64], d, dmin), block_q3_K (hmask[32], qs[64],
# scales[12], d), block_q4_K (d, dmin, scales[12], qs[128]), block_q5_K (d, dmin, scales[12],
# qh[32], qs[128]), block_q6_K (ql[128], qh[64], scales[16], d).
K_TYPES: dict[str, KType] = {
    "q2_k": KType(2, 16, True, 4, 84),
    "q3_k": KType(3, 16, False, 6, 110),
    "q4_k": KType(4, 32, True, 6, 144),
    "q5_k": KType(5, 32, True, 6, 176),
    "q6_k": KType(6, 16, False, 8, 210),
}


@dataclass
class KQuant:
    """One weight on a k-quant grid: stored codes ``u`` ([N, K] uint8; centred types store
    ``q + 2^(b-1)``), super-block scales ``d`` and ``dmin`` ([N, K/256] float16; ``dmin`` None for
    centred types), sub-block codes ``sc`` and ``m`` ([N, K/256, S] int16)."""

    kind: str
    u: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor
    dmin: torch.Tensor | None
    m: torch.Tensor | None


def _candidates(kt: KType, device) -> torch.Tensor:
    # Steps of range / (levels + t): llama.cpp searches t in [-1, 1] (type-1) and [-0.9, 0.9]
    # (type-0) in tenths; the same here.
    t = torch.arange(-10, 11, dtype=torch.float32, device=device) / 10
    return t if kt.with_min else t[1:-1]


def _fit_subblocks(x: torch.Tensor, w: torch.Tensor, kt: KType) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Best float ``(s, o)`` per sub-block of ``x`` ([R, S, g]) under weights ``w`` (same shape)."""
    t = _candidates(kt, x.device)
    x4, w4 = x[..., None, :], w[..., None, :]  # [R, S, 1, g]
    if kt.with_min:
        lo = x.amin(-1).clamp(max=0)
        rng = (x.amax(-1) - lo).clamp_min(1e-30)
        step = rng[..., None] / (kt.levels + t)  # [R, S, P]
        L = ((x4 - lo[..., None, None]) / step[..., None]).round_().clamp_(0, kt.levels)
        sw = w4.sum(-1)
        swl = (w4 * L).sum(-1)
        swll = (w4 * L * L).sum(-1)
        swx = (w4 * x4).sum(-1)
        swlx = (w4 * L * x4).sum(-1)
        det = sw * swll - swl * swl
        ok = det > 0
        det = torch.where(ok, det, torch.ones_like(det))
        s = torch.where(ok, (sw * swlx - swl * swx) / det, step)
        mn = torch.where(ok, (swll * swx - swl * swlx) / det, lo[..., None].expand_as(step))
        # A min above 0 is not storable (o = dmin * m >= 0): refit the step alone with mn = 0.
        pos = mn > 0
        s = torch.where(pos, swlx / swll.clamp_min(1e-30), s)
        mn = torch.where(pos, torch.zeros_like(mn), mn)
        s = s.clamp_min(0)
        err = (w4 * (s[..., None] * L + mn[..., None] - x4).square()).sum(-1)
        pick = err.argmin(-1, keepdim=True)
        return s.gather(-1, pick)[..., 0], (-mn).gather(-1, pick)[..., 0]
    # The weight of largest magnitude goes to the level -2^(b-1), the one without a positive
    # twin (a negative step when that weight is positive), as llama.cpp's make_qx_quants does.
    ext = _extreme(x)
    ext = torch.where(ext == 0, torch.full_like(ext, 1e-30), ext)
    step = -ext[..., None] / (2 ** (kt.bits - 1) + t)
    L = (x4 / step[..., None]).round_().clamp_(-(2 ** (kt.bits - 1)), 2 ** (kt.bits - 1) - 1)
    s = (w4 * L * x4).sum(-1) / (w4 * L * L).sum(-1).clamp_min(1e-30)
    err = (w4 * (s[..., None] * L - x4).square()).sum(-1)
    pick = err.argmin(-1, keepdim=True)
    return s.gather(-1, pick)[..., 0], None


def _extreme(v: torch.Tensor) -> torch.Tensor:
    """The signed entry of largest magnitude along the last dimension."""
    return v.gather(-1, v.abs().argmax(-1, keepdim=True))[..., 0]


def _two_level(v: torch.Tensor, kt: KType) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` ([R, S]) as ``fp16 d`` per row times integer codes in ``kt.scale_codes``: the largest
    entry (signed types: of largest magnitude, onto the negative end) keeps its value."""
    lo, hi = kt.scale_codes
    d = (v.amax(-1) / hi) if kt.with_min else (_extreme(v) / lo)
    d = d.to(torch.float16)
    return d, _on_multiples(v, d, kt)


def kquant(w: torch.Tensor, kind: str, importance: torch.Tensor | None = None, rows: int = 2048,
           refine: int = 2) -> KQuant:
    """``w`` ([N, K], K a multiple of 256) on the k-quant grid ``kind`` (a key of ``K_TYPES``),
    scales searched per sub-block under ``importance`` ([K], e.g. ``diag(X^T X)``; None: equal)."""
    kt = K_TYPES[kind]
    n, k = w.shape
    if k % QK_K:
        raise ValueError(f"{kind.upper()} stores rows in super-blocks of {QK_K}; K={k}")
    nb, S, g = k // QK_K, kt.subblocks, kt.group
    imp = torch.ones(k) if importance is None else importance.float().cpu().clamp_min(0)
    imp = imp / imp.mean().clamp_min(1e-30)
    # A column of zero importance still weighs a little, or its weights could go anywhere.
    imp = imp + 1e-6
    out_u, out_d, out_sc, out_dmin, out_m = [], [], [], [], []
    for r0 in range(0, n, rows):  # [rows, K, candidates] floats at a time
        x = w[r0:r0 + rows].detach().float().cpu().reshape(-1, nb, S, g)  # [R, nb, S, g]
        wt = imp.reshape(1, nb, S, g).expand_as(x)
        s, o = _fit_subblocks(x.reshape(-1, S, g), wt.reshape(-1, S, g), kt)
        d, sc = _two_level(s, kt)
        dmin, m = _two_level(o, kt) if kt.with_min else (None, None)
        xs, ws = x.reshape(-1, S, g), wt.reshape(-1, S, g)
        best = (d, sc, dmin, m)
        u = _codes(xs, kt, *best)
        err = _error(xs, ws, kt, u, *best)
        state, u_state = best, u
        for _ in range(refine):
            state = _refit(xs, ws, kt, u_state, *state)
            u_state = _codes(xs, kt, *state)
            e = _error(xs, ws, kt, u_state, *state)
            better = e < err  # per super-block: keep whichever grid has the smaller error
            best = tuple(None if a is None else torch.where(better.view(-1, *[1] * (a.dim() - 1)), b, a)
                         for a, b in zip(best, state))
            u = torch.where(better[:, None, None], u_state, u)
            err = torch.minimum(e, err)
        d, sc, dmin, m = best
        out_u.append(u.reshape(-1, k))
        out_d.append(d.reshape(-1, nb))
        out_sc.append(sc.reshape(-1, nb, S))
        if kt.with_min:
            out_dmin.append(dmin.reshape(-1, nb))
            out_m.append(m.reshape(-1, nb, S))
    return KQuant(kind, torch.cat(out_u), torch.cat(out_d), torch.cat(out_sc),
                  torch.cat(out_dmin) if kt.with_min else None, torch.cat(out_m) if kt.with_min else None)


def _codes(x: torch.Tensor, kt: KType, d, sc, dmin, m) -> torch.Tensor:
    """Nearest stored codes ([R, S, g] uint8) of ``x`` on the grid ``(d, sc, dmin, m)``."""
    step = d.float()[:, None] * sc.float()  # [R, S], as llama.cpp computes d * sc
    safe = torch.where(step != 0, step, torch.ones_like(step))[..., None]
    if kt.with_min:
        off = (dmin.float()[:, None] * m.float())[..., None]
        u = ((x + off) / safe).round_().clamp_(0, kt.levels)
    else:
        half = 2 ** (kt.bits - 1)
        u = (x / safe).round_().clamp_(-half, half - 1).add_(half)
    # A sub-block whose scale code is 0 holds only its offset (or 0).
    u = torch.where(step[..., None] != 0, u, torch.full_like(u, 0 if kt.with_min else 2 ** (kt.bits - 1)))
    return u.to(torch.uint8)


def _error(x, wt, kt: KType, u, d, sc, dmin, m) -> torch.Tensor:
    """Weighted squared error of each super-block ([R]) on a grid."""
    uf = u.float() - (0 if kt.with_min else 2 ** (kt.bits - 1))
    x_hat = (d.float()[:, None] * sc.float())[..., None] * uf
    if kt.with_min:
        x_hat = x_hat - (dmin.float()[:, None] * m.float())[..., None]
    return (wt * (x_hat - x).square()).sum((1, 2))


def _refit(x, wt, kt: KType, u, d, sc, dmin, m):
    """Given the codes, the super-block scales by weighted least squares (rounded to float16),
    then each sub-block's scale codes as the nearest multiples of them to its own least-squares
    step and offset: one step of alternating minimisation of the stored grid's weighted error."""
    uf = u.float() - (0 if kt.with_min else 2 ** (kt.bits - 1))
    a = sc.float()[..., None] * uf  # x ~ d * a - dmin * b
    if kt.with_min:
        b = m.float()[..., None].expand_as(a)
        saa, sab, sbb = (wt * a * a).sum((1, 2)), (wt * a * b).sum((1, 2)), (wt * b * b).sum((1, 2))
        sax, sbx = (wt * a * x).sum((1, 2)), (wt * b * x).sum((1, 2))
        det = saa * sbb - sab * sab
        ok = det > 1e-30
        det = torch.where(ok, det, torch.ones_like(det))
        d_new = torch.where(ok, (sbb * sax - sab * sbx) / det, d.float())
        dmin_new = torch.where(ok, (sab * sax - saa * sbx) / det, dmin.float())
        d = d_new.clamp_min(0).to(torch.float16)
        dmin = dmin_new.clamp_min(0).to(torch.float16)
        # Per sub-block (s, o) by least squares given u, then onto the new multiples.
        sw, swu, swuu = wt.sum(-1), (wt * uf).sum(-1), (wt * uf * uf).sum(-1)
        swx, swux = (wt * x).sum(-1), (wt * uf * x).sum(-1)
        det2 = sw * swuu - swu * swu
        ok2 = det2 > 1e-30
        det2 = torch.where(ok2, det2, torch.ones_like(det2))
        s = torch.where(ok2, (sw * swux - swu * swx) / det2, d.float()[:, None] * sc.float())
        o = torch.where(ok2, (swu * swux - swuu * swx) / det2, dmin.float()[:, None] * m.float())
        sc = _on_multiples(s, d, kt)
        m = _on_multiples(o, dmin, kt)
        return d, sc, dmin, m
    saa, sax = (wt * a * a).sum((1, 2)), (wt * a * x).sum((1, 2))
    d = torch.where(saa > 1e-30, sax / saa.clamp_min(1e-30), d.float()).to(torch.float16)
    s = (wt * uf * x).sum(-1) / (wt * uf * uf).sum(-1).clamp_min(1e-30)
    return d, _on_multiples(s, d, kt), None, None


def _on_multiples(v: torch.Tensor, d: torch.Tensor, kt: KType) -> torch.Tensor:
    """The scale codes nearest ``v / d`` ([R, S]; 0 where ``d`` is 0)."""
    df = d.float()[:, None]
    nonzero = df != 0
    code = torch.where(nonzero, v / torch.where(nonzero, df, torch.ones_like(df)), torch.zeros_like(v))
    return code.round_().clamp_(*kt.scale_codes).to(torch.int16)


def kdequant(kq: KQuant) -> torch.Tensor:
    """The float32 weights ``kq`` holds, computed in llama.cpp's order (``(d * sc) * u - dmin * m``)."""
    kt = K_TYPES[kq.kind]
    n, k = kq.u.shape
    nb, S, g = k // QK_K, kt.subblocks, kt.group
    u = kq.u.float().reshape(n, nb, S, g)
    step = (kq.d.float()[..., None] * kq.sc.float())[..., None]
    if kt.with_min:
        off = (kq.dmin.float()[..., None] * kq.m.float())[..., None]
        return (step * u - off).reshape(n, k)
    return (step * (u - 2 ** (kt.bits - 1))).reshape(n, k)


def block32_quant(w: torch.Tensor, bits: int, with_min: bool, importance: torch.Tensor | None = None,
                  rows: int = 2048) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``w`` ([N, K], K a multiple of 32) on GGUF's 32-weight types (Q4_0/Q5_0/Q8_0 centred,
    Q4_1/Q5_1 with a min) by the same importance-weighted least-squares search per block as the
    k-quants' sub-blocks: stored codes ``u`` ([N, K] uint8), float16 ``d`` and, with a min, the
    block's min ``m`` (``x = d * u + m``) ([N, K/32] each)."""
    kt = KType(bits, 32, with_min, 8, 0)
    n, k = w.shape
    if k % 32:
        raise ValueError(f"32-weight blocks need K divisible by 32; K={k}")
    imp = torch.ones(k) if importance is None else importance.float().cpu().clamp_min(0)
    imp = imp / imp.mean().clamp_min(1e-30) + 1e-6
    us, ds, ms = [], [], []
    for r0 in range(0, n, rows):
        x = w[r0:r0 + rows].detach().float().cpu().reshape(-1, k // 32, 32)
        wt = imp.reshape(1, k // 32, 32).expand_as(x)
        s, o = _fit_subblocks(x, wt, kt)
        d = s.to(torch.float16)
        step = d.float()[..., None]
        safe = torch.where(step != 0, step, torch.ones_like(step))
        if with_min:
            m = (-o).to(torch.float16)
            u = ((x - m.float()[..., None]) / safe).round_().clamp_(0, kt.levels)
            ms.append(m.reshape(-1, k // 32))
        else:
            half = 2 ** (bits - 1)
            u = (x / safe).round_().clamp_(-half, half - 1).add_(half)
        u = torch.where(step != 0, u, torch.full_like(u, 0 if with_min else 2 ** (bits - 1)))
        us.append(u.to(torch.uint8).reshape(-1, k))
        ds.append(d.reshape(-1, k // 32))
    return torch.cat(us), torch.cat(ds), torch.cat(ms) if with_min else None
