"""Optimized rounding by signed gradient descent (SignRound: Cheng et al. 2023, "Optimize Weight
Rounding via Signed Gradient Descent for the Quantization of LLMs", arXiv:2309.05516).

Notation of the paper (Sec. 3, Eq. 1-4), per group of a weight ``W`` ([N, K], groups along K):

    s = (max(W) * alpha - min(W) * beta) / (2^b - 1),   zp = round(-min(W) * beta / s)
    W~ = s * (clip(round(W / s + V) + zp, 0, 2^b - 1) - zp)

``V`` in [-0.5, 0.5] (one per weight) moves each weight across its rounding boundary; ``alpha``
and ``beta`` in [0.5, 1] clip the group's range. They are learnt by signed gradient descent
(Sec. 3.2, Eq. 5: ``theta <- theta - lr * sign(grad)``) on the output error of a decoder block,
the gradients passing ``round`` unchanged (straight-through). Symmetric grids (optc's signed
domain, zero point 0) take ``s = max(|min(W)| beta, max(W) alpha) / ((2^b - 1) / 2)``, the grid
of :func:`optc.compress.quant.params_from_range`.

optc's addition (algorithms.md, "Optimized rounding"): the search can start from another
solution's codes and grid (GPTQ's) instead of round-to-nearest. The start grid gives the base
range, and a fixed per-weight offset ``D`` moves ``u = W / s`` into its start code ``c``'s
rounding cell when it lies outside: mirrored across the cell's boundary, as far inside as it
was outside, so ``V = 0`` reproduces the start codes and the weights that flip first under small
steps are, as from round-to-nearest, the ones nearest a boundary. (Placed just inside the
boundary instead, every code GPTQ moved flips back within a few steps and the loss jumps
seventy-fold; placed at the cell's centre, they could never flip.)

Everything here is a pure function of tensors; the loss and the loop over a layer's batches are
the method's (:mod:`optc.methods.signround`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optc.compress.quant import QuantParams, QuantScheme, _grouped_minmax, default_g_idx, group_view

# The farthest from its code a start anchor sits (code units): V = 0 must round to the start code
# itself, and 0.5 exactly would be a tie.
_CELL = 0.499


@dataclass
class Rounding:
    """The learnable state of one weight: ``V`` ([N, G, g], the padded group view) and the clip
    factors ``alpha``, ``beta`` ([N, G]) with their bounds, over a base range ``lo``/``hi``."""

    V: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    upper: torch.Tensor  # the largest clip factor of each group (1, or back to the min-max range)
    lower: float
    offset: torch.Tensor | None  # D ([N, G, g]) when started from given codes

    def tensors(self) -> list[torch.Tensor]:
        return [self.V, self.alpha, self.beta]

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach().clone() for t in self.tensors())

    def restore(self, saved: tuple[torch.Tensor, ...]) -> None:
        with torch.no_grad():
            for t, s in zip(self.tensors(), saved):
                t.copy_(s)


def _range_of(p: QuantParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The [lo, hi] range whose grid is ``p`` (inverse of ``params_from_range``)."""
    s, z = p.scale.float(), p.zero.float()
    if p.scheme.symmetric:
        amax = s * ((p.scheme.qmax - p.scheme.qmin) / 2)
        return -amax, amax
    lo = (p.scheme.qmin - z) * s
    return lo, lo + s * (p.scheme.qmax - p.scheme.qmin)


def init_rounding(
    w: torch.Tensor, scheme: QuantScheme, start: QuantParams | None = None,
    start_codes: torch.Tensor | None = None, lower: float = 0.5,
) -> Rounding:
    """The search's start: round-to-nearest on the min-max range (``start`` None, the paper's),
    or ``start``'s grid with its integer codes ``start_codes`` ([N, K], signed domain)."""
    if scheme.type != "float" and start is not None and not torch.equal(
            start.g_idx.cpu(), default_g_idx(w.shape[1], scheme)):
        raise ValueError("optimized rounding starts from contiguous groups (no act-order permutation)")
    w3 = group_view(w.float(), scheme.group_size)
    lo_mm, hi_mm = _grouped_minmax(w.float(), scheme)
    n, groups, _ = w3.shape
    ones = torch.ones(n, groups, dtype=torch.float32, device=w.device)
    if start is None:
        lo, hi, upper, offset = lo_mm, hi_mm, ones.clone(), None
    else:
        lo, hi = _range_of(start)
        # The clip factors may grow back to the min-max range the start grid clipped.
        grow = torch.maximum(-lo_mm / (-lo).clamp_min(1e-12), hi_mm / hi.clamp_min(1e-12))
        upper = grow.clamp(1.0, 2.0)
        s3 = start.scale.float()[..., None]
        u = w3 / s3  # the start grid's real-valued code, zero point excluded
        c = group_view(start_codes.float(), scheme.group_size) - start.zero.float()[..., None]
        e = u - c
        # Mirrored into the start code's cell: as far inside it as u is outside it.
        offset = c + e.sign() * torch.minimum(e.abs(), (1 - e.abs()).clamp(0, _CELL)) - u
    return Rounding(
        V=torch.zeros_like(w3), alpha=ones.clone(), beta=ones.clone(), lo=lo, hi=hi,
        upper=upper, lower=lower, offset=offset,
    )


def output_error(out: torch.Tensor, target: torch.Tensor, loss: str = "mse") -> torch.Tensor:
    """The loss of a block's output ``out`` against ``target`` ([..., T, d]).

    - ``mse``: the mean squared error (the paper's, Sec. 3.2);
    - ``normalized``: each token's squared error over its target's mean square, averaged over
      tokens: the error as the next normalization (RMSNorm or LayerNorm, which divide each token
      by its own scale) passes it on, so tokens with large activations do not outweigh the rest;
    - ``clipped``: the squared error of tokens up to the median token's mean square as ``mse``
      counts it, and each token above that (the attention sinks' massive activations) over its
      mean square times the median's: its error as the next normalization passes it on, at an
      ordinary token's scale."""
    if loss == "mse":
        return torch.nn.functional.mse_loss(out.float(), target.float())
    t = target.float()
    err = (out.float() - t).pow(2).mean(-1)
    scale = t.pow(2).mean(-1).clamp_min(1e-12)
    if loss == "normalized":
        return (err / scale).mean()
    if loss == "clipped":
        return (err / (scale / scale.median()).clamp_min(1.0)).mean()
    raise ValueError(f"unknown loss {loss!r}")


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` with the identity as its gradient (the straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


def grid(r: Rounding, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point ([N, G]) of the clipped range (Eq. 2), differentiable in alpha, beta."""
    lo, hi = r.lo * r.beta, r.hi * r.alpha
    span = scheme.qmax - scheme.qmin
    if scheme.symmetric:
        s = torch.maximum(-lo, hi) / (span / 2)
        return s.clamp_min(1e-12), torch.zeros_like(s)
    s = ((hi - lo) / span).clamp_min(1e-12)
    z = (scheme.qmin - _round_ste(lo / s)).clamp(scheme.qmin, scheme.qmax)
    return s, z


def quantize_dequantize(w3: torch.Tensor, r: Rounding, scheme: QuantScheme) -> torch.Tensor:
    """``W~`` of Eq. 1 on the padded group view ``w3`` ([N, G, g]), differentiable in V, alpha and
    beta; ``w3`` is the float weight, fixed."""
    s, z = grid(r, scheme)
    s3, z3 = s[..., None], z[..., None]
    x = w3 / s3 + r.V
    if r.offset is not None:
        x = x + r.offset
    q = (_round_ste(x) + z3).clamp(scheme.qmin, scheme.qmax)
    return (q - z3) * s3


@dataclass
class FixedGrid:
    """What Eq. 1 keeps fixed while only ``V`` is learnt (the clip factors frozen): the real-valued
    code ``W / s`` plus the start offset ``D``, the scale and the zero point ([N, G, g], [N, G, 1]).
    With them a step needs no autograd graph through the rounding: ``W~ = s (clip(round(u + V) +
    zp) - zp)``, and by the straight-through estimator ``dL/dV = s dL/dW~`` wherever the code is
    not clipped (zero where it is)."""

    u: torch.Tensor
    s: torch.Tensor
    z: torch.Tensor


def fixed_grid(w3: torch.Tensor, r: Rounding, scheme: QuantScheme) -> FixedGrid:
    """The fixed part of Eq. 1 for ``r``'s current clip factors. ``u`` holds ``r``'s start
    offset, so from here on the codes are :func:`codes_fixed`'s and ``r.offset`` may be freed."""
    with torch.no_grad():
        s, z = grid(r, scheme)
        u = w3 / s[..., None]
        if r.offset is not None:
            u = u + r.offset
        return FixedGrid(u, s[..., None], z[..., None])


def _unclamped_codes(fg: FixedGrid, V: torch.Tensor) -> torch.Tensor:
    return torch.round(fg.u + V).add_(fg.z)


def dequantize_fixed(fg: FixedGrid, V: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """``W~`` of Eq. 1 on the fixed grid ([N, G, g], no autograd) and where its codes are inside
    the grid (the straight-through gradient's support)."""
    with torch.no_grad():
        q = _unclamped_codes(fg, V)
        inside = (q >= scheme.qmin) & (q <= scheme.qmax)
        return q.clamp_(scheme.qmin, scheme.qmax).sub_(fg.z).mul_(fg.s), inside


def codes_fixed(fg: FixedGrid, V: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The integer codes of :func:`dequantize_fixed` ([N, G, g]), stored as ``q - qmin`` in
    uint8: a quarter of ``V``'s memory, enough to rebuild ``W~`` exactly."""
    with torch.no_grad():
        q = _unclamped_codes(fg, V).clamp_(scheme.qmin, scheme.qmax)
        return q.sub_(scheme.qmin).to(torch.uint8)


def finish_fixed(fg: FixedGrid, codes: torch.Tensor, scheme: QuantScheme, k: int) -> tuple[torch.Tensor, QuantParams]:
    """:func:`finish` for a search on a fixed grid: the weight ([N, K]) of ``codes``
    (:func:`codes_fixed`'s) and its grid, the very codes the search evaluated."""
    with torch.no_grad():
        w_hat = as_weight((codes.float() + scheme.qmin - fg.z) * fg.s, k)
    return w_hat, _params(fg.s[..., 0], fg.z[..., 0], scheme, k, w_hat.device)


def _params(s: torch.Tensor, z: torch.Tensor, scheme: QuantScheme, k: int, device: torch.device) -> QuantParams:
    # An all-zero group's codes are 0 on any grid: it stores the scale 1, as min-max grids do.
    s = torch.where(s > 1e-12, s, torch.ones_like(s))
    return QuantParams(scheme, s.clone(), z.round().to(torch.int32), default_g_idx(k, scheme).to(device))


def set_v_grad_(r: Rounding, fg: FixedGrid, grad_w3: torch.Tensor, inside: torch.Tensor) -> None:
    """``V.grad`` from the loss's gradient at ``W~`` ([N, G, g]; consumed): the chain rule of
    :func:`dequantize_fixed` under the straight-through estimator."""
    r.V.grad = grad_w3.mul_(fg.s).mul_(inside)


def as_weight(w_hat3: torch.Tensor, k: int) -> torch.Tensor:
    """The [N, G, g] view back to the weight's [N, K]."""
    return w_hat3.reshape(w_hat3.shape[0], -1)[:, :k]


def sign_step_(r: Rounding, lr: float, clip: bool = True) -> None:
    """One signed gradient step (Eq. 5), then the parameters clamped to their ranges."""
    with torch.no_grad():
        r.V.sub_(r.V.grad.sign(), alpha=lr).clamp_(-0.5, 0.5)
        if clip:
            for t in (r.alpha, r.beta):
                t.sub_(t.grad.sign(), alpha=lr)
                torch.minimum(t.clamp_(min=r.lower), r.upper, out=t)
    for t in r.tensors():
        t.grad = None


def finish(w: torch.Tensor, r: Rounding, scheme: QuantScheme) -> tuple[torch.Tensor, QuantParams]:
    """The fake-quantized weight ([N, K], float32) and its grid for the current state: codes
    exact on the grid, so every exporter holds them without re-rounding."""
    with torch.no_grad():
        w3 = group_view(w.float(), scheme.group_size)
        s, z = grid(r, scheme)
        w_hat = as_weight(quantize_dequantize(w3, r, scheme), w.shape[1])
    return w_hat, _params(s, z, scheme, w.shape[1], w.device)


def requires_grad_(r: Rounding, clip: bool = True) -> Rounding:
    r.V.requires_grad_(True)
    for t in (r.alpha, r.beta):
        t.requires_grad_(clip)
    return r


# End-to-end tuning of the group scales (EfficientQAT: Chen et al. 2024, "EfficientQAT: Efficient
# Quantization-Aware Training for Large Language Models", arXiv:2407.11062, Sec. 3.3, E2E-QP):
# after the layer-wise search the integer codes stay fixed and only each group's step size
# trains, on the whole model's loss. Written as ``s (1 + theta)``: ``W~ = (q - zp) s (1 + theta)``,
# so the tuned weight is the layer-wise one scaled per group and ``theta = 0`` is the start.


class _GroupScaled(torch.autograd.Function):
    """``W~ (1 + theta)`` per group; the backward reads ``W~`` itself (no copy of it is saved)."""

    @staticmethod
    def forward(ctx, w_hat: torch.Tensor, theta: torch.Tensor, group_size: int) -> torch.Tensor:
        ctx.save_for_backward(w_hat)
        ctx.group_size = group_size
        w3 = group_view(w_hat, group_size)
        return as_weight(w3 * (1 + theta)[..., None].to(w3.dtype), w_hat.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (w_hat,) = ctx.saved_tensors
        g3 = group_view(grad.to(w_hat.dtype), ctx.group_size)
        return None, (g3 * group_view(w_hat, ctx.group_size)).sum(-1), None


def group_scaled(w_hat: torch.Tensor, theta: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """The quantized weight ``w_hat`` ([N, K]) with each group's scale multiplied by ``1 + theta``
    ([N, G]), differentiable in ``theta`` (``dL/dtheta = sum over the group of dL/dW~ * W~``)."""
    return _GroupScaled.apply(w_hat, theta, group_size or w_hat.shape[1])


def scaled_params(p: QuantParams, theta: torch.Tensor) -> QuantParams:
    """``p`` with every group's scale multiplied by ``1 + theta`` (codes and zero points kept)."""
    return QuantParams(p.scheme, p.scale * (1 + theta.detach().to(p.scale.dtype)), p.zero, p.g_idx)
