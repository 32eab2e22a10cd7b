"""Floating-point element grids: FP8 E4M3, FP4 E2M1, and the scales NVFP4 and MXFP4 store.

The grids (OCP 8-bit Floating Point Specification (OFP8) rev. 1.0, Sec. 5, and OCP Microscaling
Formats (MX) v1.0, Sec. 5.3.3 and 6.3):

- **E4M3** (``float8_e4m3fn``): 4 exponent bits (bias 7), 3 mantissa bits, no infinities; finite
  values up to 448, subnormals down to 2^-9. A value is rounded to the nearest representable one,
  ties to even, after saturating at +-448 (what compressed-tensors and vLLM compute).
- **E2M1**: the eight magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Rounding to nearest with ties to the
  even mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), as
  compressed-tensors' ``cast_to_fp4`` and vLLM's reference do.
- **NVFP4** scales: one E4M3 scale per 16 values, under one FP32 scale per tensor that maps the
  E4M3 scales into E4M3's range (dequantization: ``x = q * s_e4m3 / s_global``). optc rounds
  each scale to E4M3's four significant bits (:func:`round_scale_e4m3`) and takes the tensor
  scale as a power of two when it writes the file (:func:`nvfp4_global_scale`): multiplying by a
  power of two changes no mantissa, so the stored E4M3 scales are exactly the ones the codes
  were chosen against.
- **MXFP4** scales: one E8M0 scale (a power of two, 2^(e - 127) for a stored byte ``e``) per 32
  values. From a group's ``amax`` the shared exponent is ``floor(log2(amax)) - 2`` (Sec. 6.3,
  ``emax`` of E2M1 = 2), raised by one when ``amax``'s mantissa is 1.75 or more (compressed-tensors'
  ``generate_mx_scales``: the group maximum then rounds to 8 rather than saturating far above 6).
"""

from __future__ import annotations

import torch

from optc.compress.schemes import FLOAT_MAX

E4M3_MAX = FLOAT_MAX[8]
E8M0_BIAS = 127
FP4_CODES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest E4M3 value (saturating at +-448), in ``x``'s dtype."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def round_e2m1_(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded in place to the nearest E2M1 value (saturating at +-6), ties to even."""
    # On float32 bits: from 1 up, E2M1 is float32 with one mantissa bit, so adding half an ulp
    # of that bit (less one, plus the kept bit: ties to even) and clearing the 22 lower bits
    # rounds it; below 1 the grid is E2M1's subnormal step of 0.5. A few elementwise passes,
    # about half the time of a bucketize search over the midpoints.
    a = x.detach().float().abs().clamp_(max=FP4_CODES[-1].item())
    small = a < 1.0
    sub = (a * 2).round_().mul_(0.5)
    bits = a.view(torch.int32)
    bits.add_(0x1FFFFF + ((bits >> 22) & 1)).bitwise_and_(~0x3FFFFF)
    return x.copy_(torch.where(small, sub, a).copysign_(x))


def round_float_(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded in place to the ``bits``-bit float grid (8: E4M3, 4: E2M1)."""
    if bits == 4:
        return round_e2m1_(x)
    return x.copy_(round_e4m3(x))


def round_scale_e4m3(s: torch.Tensor) -> torch.Tensor:
    """Positive scales rounded to four significant bits (E4M3's mantissa at its own exponent).

    The exponent is left free: :func:`nvfp4_global_scale` later moves the largest scale of the
    tensor into E4M3's range by a power of two, which keeps every mantissa.
    """
    m, e = torch.frexp(s.float())  # s = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.round(m * 16) / 16, e).to(s.dtype)


def mx_scale(amax: torch.Tensor) -> torch.Tensor:
    """MXFP4's power-of-two scale of each group maximum ``amax`` (an all-zero group gets E8M0's
    smallest, 2^-127, as compressed-tensors gives it)."""
    a = amax.float()
    m, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    # floor(log2 a) = e - 1; a mantissa of 1.75 (m >= 0.875) rounds the maximum up a binade.
    shared = torch.where(a > 0, (e - 1) + (m >= 0.875).to(e.dtype) - 2, -E8M0_BIAS)
    return torch.ldexp(torch.ones_like(a), shared.clamp(-E8M0_BIAS, E8M0_BIAS)).to(amax.dtype)


def round_scale_e8m0(s: torch.Tensor) -> torch.Tensor:
    """Positive scales rounded to a power of two (E8M0), the nearest in log2."""
    m, e = torch.frexp(s.float())
    e = e - 1 + (m >= 2**-0.5).to(e.dtype)
    return torch.ldexp(torch.ones_like(s, dtype=torch.float32), e.clamp(-E8M0_BIAS, E8M0_BIAS)).to(s.dtype)


def e8m0_encode(s: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales as E8M0 bytes ``log2(s) + 127`` (uint8)."""
    _, e = torch.frexp(s.float())
    return (e - 1 + E8M0_BIAS).clamp(0, 254).to(torch.uint8)


def e8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes back to float32 scales ``2^(b - 127)``."""
    return torch.ldexp(torch.ones(b.shape), b.to(torch.int32) - E8M0_BIAS)


def nvfp4_global_scale(scale: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor FP32 scale for the effective group scales ``scale``: the power of two
    that brings the largest into E4M3's top binade, so ``scale * global`` is exact in E4M3."""
    top = float(scale.float().max())
    if not top > 0:
        return torch.ones(1)
    _, e = torch.frexp(torch.tensor(E4M3_MAX / top))
    return torch.ldexp(torch.ones(1), e - 1)


def e2m1_nibbles(q: torch.Tensor) -> torch.Tensor:
    """E2M1 values (exactly on the grid) as 4-bit codes: sign bit 3, magnitude index bits 0-2."""
    mag = torch.bucketize(q.abs().float(), FP4_CODES.to(q.device))
    return (mag | (q < 0).to(mag.dtype) << 3).to(torch.uint8)


def e2m1_values(nibbles: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes back to float32 values (bit 3 the sign)."""
    n = nibbles.to(torch.int64)
    v = FP4_CODES.to(nibbles.device)[n & 7]
    return torch.where(n & 8 != 0, -v, v)
