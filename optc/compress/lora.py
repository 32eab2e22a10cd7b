"""LoRA updates that respect pruning masks and quantization grids, and distillation losses.

Pure tensor functions; the training loop that uses them is :mod:`optc.methods.recover_training`.

- LoRA (Hu et al. 2021, sec. 4.1): a frozen ``W0`` ([N, K]) is adapted by ``dW = (alpha / r) B A``
  with ``A`` [r, K], ``B`` [N, r] and ``B = 0`` at the start, so training starts from the
  compressed model exactly.
- Masked update: on a pruned Linear the update is ``M * dW`` (element-wise, ``M`` the keep
  mask), so every pruned weight stays exactly zero after merging and an N:M pattern holds.
- Quantization-aware update: on a quantized Linear the effective weight is ``Q(W0 + dW)`` on
  the Linear's fixed grid (the scales and zero points the quantization stage chose), with the
  straight-through estimator (Bengio et al. 2013) for the rounding, so merging and
  re-quantizing onto the same grid gives exactly the weights that were trained.
- Knowledge distillation (Hinton et al. 2015, sec. 2): ``T^2 KL(softmax(z_t / T) || softmax(z_s / T))``
  per token, with the full teacher distribution or its cached top-k logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from optc.compress.quant import QuantParams, fake_quantize


def lora_init(rank: int, in_features: int, out_features: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` with peft's default init (Kaiming-uniform, a = sqrt(5)) and ``B = 0``."""
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on an [r, K] matrix
    a = (torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound
    return a, torch.zeros(out_features, rank)


def lora_delta(
    a: torch.Tensor, b: torch.Tensor, scaling: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``dW = scaling * B A`` ([N, K]), zero wherever ``mask`` (True = kept) is False."""
    delta = (b @ a) * scaling
    return delta if mask is None else delta * mask


class _StraightThrough(torch.autograd.Function):
    # A Function rather than ``w + (Q(w) - w).detach()``: that sum is not bit-exactly Q(w)
    # in floating point, and the merged weights must lie exactly on the grid.
    @staticmethod
    def forward(ctx, w: torch.Tensor, p: QuantParams) -> torch.Tensor:
        return fake_quantize(w, p)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def ste_fake_quantize(w: torch.Tensor, p: QuantParams) -> torch.Tensor:
    """``Q(w)`` forward, identity gradient (straight-through), on the fixed grid ``p``."""
    return _StraightThrough.apply(w, p)


def merged_weight(
    w0: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None = None,
    qparams: QuantParams | None = None,
) -> torch.Tensor:
    """The effective weight: ``W0 + M * dW``, re-quantized onto ``qparams``'s grid if given."""
    w = w0 + lora_delta(a, b, scaling, mask).to(w0.dtype)
    return w if qparams is None else ste_fake_quantize(w, qparams)


def next_token_logp(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the next token at every position but the last ([B, S-1, V])."""
    return F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)


def cross_entropy(logits: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` [B, S, V] on ``ids`` [B, S] (``logp``: the
    student's :func:`next_token_logp` at T = 1, if already computed)."""
    logp = next_token_logp(logits) if logp is None else logp
    return F.nll_loss(logp.flatten(0, 1), ids[:, 1:].flatten())


def kl_to(s_logp: torch.Tensor, t_logp: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``KL(p_t || p_s)`` per position from log-probabilities ([..., V]), its ``mean`` or ``sum``
    over the positions; differentiable in ``s_logp`` only."""
    # KL(p_t || p_s) = sum p_t log p_t - sum p_t log p_s; the first term is a constant, so
    # only the second is differentiated (autograd then keeps p_t, not the difference).
    with torch.no_grad():
        p_t = t_logp.exp()
        neg_entropy = (p_t * t_logp).sum(-1)
    kl = neg_entropy - (p_t * s_logp).sum(-1)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be mean or sum, not {reduction!r}")
    return kl.mean() if reduction == "mean" else kl.sum()


def kl_and_grad(s_logits: torch.Tensor, t_logits: torch.Tensor) -> tuple[float, torch.Tensor]:
    """``KL(p_t || p_s)`` summed over the rows of ``s_logits`` and ``t_logits`` ([R, V]) and its
    gradient in the student's logits, ``softmax(s) - p_t`` per row (float32), without an autograd
    graph: autograd through ``log_softmax`` and :func:`kl_to` keeps about twice as many
    vocabulary-wide tensors alive at once."""
    with torch.no_grad():
        t_logp = t_logits.float().log_softmax(-1)
        p_t = t_logp.exp()
        s_logp = s_logits.float().log_softmax(-1)
        kl = float((p_t * t_logp.sub_(s_logp)).sum())
        del t_logp
        return kl, s_logp.exp_().sub_(p_t)


def kd_loss(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0, s_logp: torch.Tensor | None = None
) -> torch.Tensor:
    """``T^2 KL(p_t || p_s)`` per predicted token, averaged ([B, S, V] logits, last position
    dropped so the tokens match :func:`cross_entropy`; ``s_logp``: the student's
    :func:`next_token_logp` at this temperature, if already computed)."""
    t = temperature
    s_logp = next_token_logp(student, t) if s_logp is None else s_logp
    with torch.no_grad():
        t_logp = next_token_logp(teacher, t)
    return kl_to(s_logp, t_logp) * t * t


def topk_logits(teacher: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest teacher logits per token and their vocabulary ids (to cache)."""
    values, index = teacher.float().topk(k, dim=-1)
    return values.to(torch.float16), index.to(torch.int32)


def kd_loss_topk(
    student: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    s_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`kd_loss` against a teacher known only by its top-k logits: the teacher's
    distribution is renormalized over those k ids and the student's is the full softmax
    (the mass it puts elsewhere counts as error, as with the full teacher)."""
    t = temperature
    s_logp = next_token_logp(student, t) if s_logp is None else s_logp
    with torch.no_grad():
        t_logp = F.log_softmax(values[:, :-1].float() / t, dim=-1)
    return kl_to(s_logp.gather(-1, index[:, :-1].long()), t_logp) * t * t
