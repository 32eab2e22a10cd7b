"""Integer quantization primitives shared by RTN, GPTQ, AWQ and every exporter.

Conventions (one representation everywhere, converted only at export time):

- A weight ``W`` has shape ``[N, K]`` (out_features, in_features), as in ``nn.Linear``.
- Integer codes ``q`` live in the *signed* domain ``[-2^(b-1), 2^(b-1) - 1]`` and the
  zero point ``z`` is an integer in the same domain (``0`` for symmetric schemes).
  Dequantization is ``W_hat = (q - z) * s``. GPTQ/AWQ formats store ``q + 2^(b-1)``;
  compressed-tensors stores the signed values (offset by ``2^(b-1)`` when packed).
- Groups run along the input dimension. ``G = ceil(K / g)`` groups; the last group may be
  shorter when ``g`` does not divide ``K``. ``scale`` and ``zero`` have shape ``[N, G]``.
  Per-channel quantization is ``group_size=None`` (``G = 1``).
- ``g_idx[k]`` is the group of input column ``k``. It is ``k // g`` unless GPTQ's
  act-order assigned groups in a permuted order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from optc.compress import fpquant
from optc.compress.schemes import QuantScheme  # noqa: F401 - defined torch-free, re-exported


@dataclass
class QuantParams:
    """Solved quantization parameters of one Linear weight."""

    scheme: QuantScheme
    scale: torch.Tensor  # [N, G] float
    zero: torch.Tensor  # [N, G] int32, signed domain
    g_idx: torch.Tensor  # [K] int32

    @property
    def actorder(self) -> bool:
        """True when groups are not contiguous runs of columns (GPTQ act-order)."""
        k = self.g_idx.numel()
        return not torch.equal(self.g_idx, default_g_idx(k, self.scheme).to(self.g_idx.device))


def default_g_idx(in_features: int, scheme: QuantScheme) -> torch.Tensor:
    if scheme.group_size is None:
        return torch.zeros(in_features, dtype=torch.int32)
    return torch.arange(in_features, dtype=torch.int32) // scheme.group_size


def group_view(t: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """``[..., K]`` -> ``[..., G, g]``, zero-padding a short last group (``group_size`` None: one
    group of all K)."""
    k = t.shape[-1]
    g = k if group_size is None else group_size
    groups = math.ceil(k / g)
    pad = groups * g - k
    t = torch.nn.functional.pad(t, (0, pad)) if pad else t
    return t.reshape(*t.shape[:-1], groups, g)


def block_reduce(t: torch.Tensor, rows: int | None, op: str = "sum") -> torch.Tensor:
    """``t`` ([N, ...]) reduced (``sum``, ``amin`` or ``amax``) over each block of ``rows``
    consecutive rows (a short last block included) and broadcast back to every row of it: what a
    scale shared by a block of rows (FP8 128 x 128 tiles) sees. ``rows`` None: ``t`` itself."""
    if rows is None or rows == 1:
        return t
    n = t.shape[0]
    blocks = math.ceil(n / rows)
    if op == "sum":
        pad = torch.zeros((blocks * rows - n, *t.shape[1:]), dtype=t.dtype, device=t.device)
    else:  # pad with copies of the last row, in the last block: they change no min or max
        pad = t[-1:].expand(blocks * rows - n, *t.shape[1:])
    tb = torch.cat((t, pad)).reshape(blocks, rows, *t.shape[1:])
    red = getattr(tb, op)(dim=1, keepdim=True)
    return red.expand_as(tb).reshape(blocks * rows, *t.shape[1:])[:n]


def _grouped_minmax(w: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(row, group) min and max, with 0 always inside the range ([N, G] each); a block
    scheme's ranges span its block of rows."""
    # Zero padding cannot change the result because 0 is forced into every range below.
    wp = group_view(w, scheme.group_size)
    lo, hi = wp.amin(dim=2).clamp(max=0), wp.amax(dim=2).clamp(min=0)
    return block_reduce(lo, scheme.block_rows, "amin"), block_reduce(hi, scheme.block_rows, "amax")


def params_from_range(
    lo: torch.Tensor, hi: torch.Tensor, scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and signed zero point for a [lo, hi] range containing 0."""
    if scheme.type == "float":
        return _float_params(torch.maximum(-lo, hi), scheme)
    if scheme.symmetric:
        amax = torch.maximum(-lo, hi)
        # amax maps to (2^b - 1) / 2, the same grid as GPTQ's sym mode and compressed-tensors.
        scale = amax / ((scheme.qmax - scheme.qmin) / 2)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.zeros_like(scale, dtype=torch.int32)
    else:
        scale = (hi - lo) / (scheme.qmax - scheme.qmin)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = (scheme.qmin - torch.round(lo / scale)).clamp(scheme.qmin, scheme.qmax)
        zero = zero.to(torch.int32)
    return scale, zero


def _float_params(amax: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales mapping each ``amax`` onto the float grid's largest value, rounded as the format
    stores them; zero points are 0."""
    if scheme.scale_format == "e8m0":
        scale = fpquant.mx_scale(amax)
    else:
        scale = amax / scheme.qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        if scheme.scale_format == "e4m3":
            scale = fpquant.round_scale_e4m3(scale)
    return scale, torch.zeros_like(scale, dtype=torch.int32)


def round_scales(scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Free positive scales (e.g. refitted ones) rounded to the format the scheme stores them in."""
    if scheme.scale_format == "e8m0":
        return fpquant.round_scale_e8m0(scale)
    if scheme.scale_format == "e4m3":
        return fpquant.round_scale_e4m3(scale)
    return scale


def round_codes_(t: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``t`` (already divided by the scale, zero point added) rounded in place onto the grid."""
    if scheme.type == "float":
        return fpquant.round_float_(t, scheme.bits)
    return t.round_().clamp_(scheme.qmin, scheme.qmax)


def kquant_params(w: torch.Tensor, scheme: QuantScheme, importance: torch.Tensor | None = None) -> QuantParams:
    """A k-quant grid (``scheme.kquant_kind``) for ``w`` ([N, K]) from the importance-weighted
    solver of :mod:`optc.compress.kquant`: each group's scale is ``d * sc`` (exact in float32)."""
    from optc.compress.kquant import kquant

    kq = kquant(w, scheme.kquant_kind, importance)
    n, k = w.shape
    scale = (kq.d.float()[..., None] * kq.sc.float()).reshape(n, -1).to(w.device)
    if scheme.offset_grid:
        zero = (kq.dmin.float()[..., None] * kq.m.float()).reshape(n, -1).to(w.device)
    else:
        zero = torch.zeros_like(scale, dtype=torch.int32)
    return QuantParams(scheme, scale, zero, default_g_idx(k, scheme).to(w.device))


def compute_qparams(
    w: torch.Tensor, scheme: QuantScheme, clip: torch.Tensor | float = 1.0
) -> QuantParams:
    """Min-max parameters for ``w`` ([N, K]); ``clip`` shrinks each range (scalar or [N, G]).
    A k-quant grid has no min-max form: its solver's grid, whatever ``clip``."""
    if scheme.kquant_kind is not None:
        return kquant_params(w.float(), scheme)
    lo, hi = _grouped_minmax(w.float(), scheme)
    scale, zero = params_from_range(lo * clip, hi * clip, scheme)
    return QuantParams(scheme, scale, zero, default_g_idx(w.shape[1], scheme).to(w.device))


def _grouped_view(
    t: torch.Tensor, p: QuantParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` ([N, K]) with ``p``'s scale and zero point shaped to broadcast against it.

    Contiguous groups that divide K are a ``[N, G, g]`` view against ``[N, G, 1]`` parameters,
    so no ``[N, K]`` copy of the scales is made (4x less memory traffic when exporting);
    act-order or a short last group fall back to one gathered scale per column.
    """
    n, k = t.shape
    g = p.scheme.group_size
    scale, zero = p.scale.float(), p.zero.float()
    if g is None or scale.shape[1] == 1:
        return t, scale[:, :1], zero[:, :1]
    if k % g == 0 and torch.equal(p.g_idx, default_g_idx(k, p.scheme).to(p.g_idx.device)):
        return t.reshape(n, k // g, g), scale[..., None], zero[..., None]
    idx = p.g_idx.long()
    return t, scale[:, idx], zero[:, idx]


def quantize(w: torch.Tensor, p: QuantParams) -> torch.Tensor:
    """Integer codes (int8, signed domain) of ``w`` on the grid ``p``; a float grid's values
    (float32) for a float scheme."""
    wv, s, z = _grouped_view(w.float(), p)
    if p.scheme.type == "float":
        return round_codes_(torch.div(wv, s), p.scheme).view(w.shape)
    if p.scheme.offset_grid:  # u = round((w + o) / s) in [0, 2^b - 1]; a group of scale 0 holds -o
        safe = torch.where(s != 0, s, torch.ones_like(s))
        u = torch.add(wv, z).div_(safe).round_().clamp_(0, 2**p.scheme.bits - 1)
        return u.add_(p.scheme.qmin).to(torch.int8).view(w.shape)
    q = torch.div(wv, s).round_().add_(z).clamp_(p.scheme.qmin, p.scheme.qmax)
    return q.to(torch.int8).view(w.shape)


def dequantize(q: torch.Tensor, p: QuantParams, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    qv, s, z = _grouped_view(q, p)
    if p.scheme.offset_grid:  # as llama.cpp computes it: (d * sc) * u - dmin * m
        return torch.sub(qv, p.scheme.qmin).float().mul_(s).sub_(z).to(dtype).view(q.shape)
    return torch.sub(qv, z).mul_(s).to(dtype).view(q.shape)


def fake_quantize(w: torch.Tensor, p: QuantParams) -> torch.Tensor:
    """``dequantize(quantize(w))`` in ``w``'s dtype."""
    return dequantize(quantize(w, p), p, w.dtype)


def quantize_column(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    scheme: QuantScheme,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake-quantize one or more columns given their per-row scale/zero ([N] or [N, c]).

    ``zero=None`` means a zero point of 0 (symmetric grids: adding and subtracting it changes
    nothing); ``out`` receives the result, so GPTQ's column sweep allocates nothing per column.
    The steps run in place on one buffer.
    """
    if scheme.offset_grid:  # zero holds the offset o: W = s * u - o, u in [0, 2^b - 1]
        safe = torch.where(scale != 0, scale, torch.ones_like(scale))
        q = torch.add(w, zero, out=out).div_(safe).round_().clamp_(0, 2**scheme.bits - 1)
        return q.mul_(scale).sub_(zero)
    q = torch.div(w, scale, out=out)
    if zero is None:
        return round_codes_(q, scheme).mul_(scale)
    q.round_()
    return q.add_(zero).clamp_(scheme.qmin, scheme.qmax).sub_(zero).mul_(scale)


def _shrink_errors(
    w3: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    p: torch.Tensor,
    scheme: QuantScheme,
    norm: float,
    imp3: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Error, scale and zero of each candidate shrink ``p`` ([N, G, P]) per (row, group)."""
    scale, zero = params_from_range(lo[..., None] * p, hi[..., None] * p, scheme)
    # One [N, G, P, g] buffer, updated in place: a temporary per step made this search
    # memory-bound (2-2.4x slower on the default model's Linears).
    q = quantize_column(w3, scale[..., None], None if scheme.symmetric else zero[..., None].float(), scheme)
    # |e|^norm as exp(norm * log|e|): torch's pow with a fractional exponent is not
    # vectorised on CPU, this is 3x faster (relative difference ~1e-6; log 0 = -inf gives 0).
    err = q.sub_(w3).abs_().log_().mul_(norm).exp_()
    if imp3 is not None:
        err.mul_(imp3)
    return err.sum(dim=-1), scale, zero


def mse_clip_search(
    w: torch.Tensor,
    scheme: QuantScheme,
    grid: int = 100,
    max_shrink: float = 0.8,
    norm: float = 2.4,
    coarse: int = 5,
    importance: torch.Tensor | None = None,
) -> QuantParams:
    """Per-(row, group) range shrink that minimises ``sum |w - Q(w)|^norm``.

    The objective of GPTQ's reference ``Quantizer(mse=True)`` (shrink factors ``1 - i/grid``
    down to ``1 - max_shrink``, error norm 2.4), searched coarse-to-fine: every ``coarse``-th
    factor first, then every factor within ``coarse`` steps of each (row, group)'s best. That
    evaluates about a quarter of the grid, on a ``[N, G, g]`` view without index expansion.
    ``importance`` ([K], e.g. the input Hessian's diagonal) weights each column's error, so
    the grid favours the inputs that carry the most energy (an activation-aware objective).
    """
    w = w.float()
    n, k = w.shape
    g = k if scheme.group_size is None else scheme.group_size
    groups = math.ceil(k / g)
    # Zero padding adds no error: 0 is always exactly representable (integer zero point).
    w3 = torch.nn.functional.pad(w, (0, groups * g - k)).reshape(n, groups, 1, g)
    imp3 = None
    if importance is not None:
        imp = importance.float().to(w.device) / importance.float().mean().clamp_min(1e-12)
        imp3 = torch.nn.functional.pad(imp, (0, groups * g - k)).reshape(1, groups, 1, g)
    lo, hi = _grouped_minmax(w, scheme)
    steps = int(max_shrink * grid)
    first = torch.arange(0, steps + 1, coarse, dtype=torch.float32, device=w.device)
    err, _, _ = _shrink_errors(
        w3, lo, hi, (1.0 - first / grid).expand(n, groups, -1), scheme, norm, imp3
    )
    # A block scheme's rows share one shrink: their errors are summed (lo, hi already shared).
    centre = first[block_reduce(err, scheme.block_rows).argmin(dim=-1)]  # [N, G]
    offsets = torch.arange(-coarse + 1, coarse, dtype=torch.float32, device=w.device)
    idx = (centre[..., None] + offsets).clamp(0, steps)
    err, scale, zero = _shrink_errors(w3, lo, hi, 1.0 - idx / grid, scheme, norm, imp3)
    pick = block_reduce(err, scheme.block_rows).argmin(dim=-1, keepdim=True)
    best_scale = scale.gather(-1, pick)[..., 0]
    best_zero = zero.gather(-1, pick)[..., 0]
    return QuantParams(scheme, best_scale, best_zero, default_g_idx(k, scheme).to(w.device))


def choose_qparams(
    w: torch.Tensor,
    scheme: QuantScheme,
    observer: str = "minmax",
    importance: torch.Tensor | None = None,
    grid: int = 100,
) -> QuantParams:
    """Pick parameters for a whole weight with the named observer (``minmax`` or ``mse``;
    ``importance`` weights columns in the MSE search, ``grid`` sets its step, 1/grid of the
    range). A k-quant grid comes from its own importance-weighted solver, whatever the observer."""
    if scheme.kquant_kind is not None:
        return kquant_params(w.float(), scheme, importance)
    if observer == "minmax":
        return compute_qparams(w, scheme)
    if observer == "mse":
        return mse_clip_search(w, scheme, grid=grid, coarse=max(1, grid // 20), importance=importance)
    raise ValueError(f"unknown weight observer {observer!r} (expected 'minmax' or 'mse')")
