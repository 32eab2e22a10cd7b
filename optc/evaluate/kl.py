"""How far a compressed model's next-token distribution moved from its baseline's.

For every scored position t, with P the baseline's next-token distribution and Q the
compressed model's, the token KL divergence is

    KL(P_t || Q_t) = sum_v P_t(v) (log P_t(v) - log Q_t(v))

(the direction llama.cpp's ``perplexity --kl-divergence`` reports, and the metric Dutta et al.
2024, "Accuracy is Not All You Need", argue for alongside "flips": the reference
distribution weighs the error).
Top-1 agreement is the share of positions where both models' most likely token is the same.

The kernel (:func:`token_kl`) is a pure function on logits; :class:`DivergenceAccumulator`
is fed window by window by the evaluation loop, so no full-vocabulary tensor outlives its
window.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from optc.evaluate.stats import mean_ci

# Rows per log-softmax chunk: bounds the temporary [rows, vocab] tensors (~100 MB at 49k vocab).
_CHUNK = 512


def token_kl(base_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(P || Q) and top-1 agreement for ``[T, V]`` logits (P: baseline).

    Returns ``(kl [T] float64, agree [T] bool)``.
    """
    if base_logits.shape != logits.shape:
        raise ValueError(f"logits shapes differ: {tuple(base_logits.shape)} vs {tuple(logits.shape)}")
    kls, agrees = [], []
    for lo in range(0, logits.shape[0], _CHUNK):
        logp = torch.log_softmax(base_logits[lo : lo + _CHUNK].float(), dim=-1)
        logq = torch.log_softmax(logits[lo : lo + _CHUNK].float(), dim=-1)
        kl = (logp.exp() * (logp - logq)).sum(dim=-1)
        # Rounding can make a ~0 divergence slightly negative; KL is never below 0.
        kls.append(kl.clamp_min(0).double())
        agrees.append(logp.argmax(dim=-1) == logq.argmax(dim=-1))
        del logp, logq
    return torch.cat(kls), torch.cat(agrees)


@dataclass
class DivergenceResult:
    kl_mean: float
    kl_max: float
    kl_p99: float  # 99th percentile over tokens: the tail without the single worst token
    kl_ci95: tuple[float | None, float | None]  # from per-window means; None with one window
    top1_agreement: float
    tokens: int
    windows: int

    def to_dict(self) -> dict:
        return asdict(self)


class DivergenceAccumulator:
    """Collects per-token KL and top-1 agreement over evaluation windows."""

    def __init__(self) -> None:
        self.kl_sum = 0.0
        self.kl_max = 0.0
        self.agree = 0
        self.count = 0
        self.window_kl: list[float] = []
        # Per-token values kept in float32 only for the percentile (40 x 2048 tokens: 320 kB).
        self._all: list[torch.Tensor] = []

    def update(self, base_logits: torch.Tensor, logits: torch.Tensor) -> None:
        """One window's scored positions: ``[T, V]`` logits of the baseline and the model."""
        kl, agree = token_kl(base_logits, logits)
        self.kl_sum += float(kl.sum())
        worst = float(kl.max())  # NaN when any token's is: it must stay NaN, not lose to 0.0
        self.kl_max = worst if math.isnan(worst) or worst > self.kl_max else self.kl_max
        self.agree += int(agree.sum())
        self.count += kl.numel()
        self.window_kl.append(float(kl.mean()))
        self._all.append(kl.float())

    def result(self) -> DivergenceResult:

        if not self.count:
            raise ValueError("no tokens were scored")
        _, lo, hi = mean_ci(torch.tensor(self.window_kl))
        every = torch.cat(self._all)
        return DivergenceResult(
            kl_mean=self.kl_sum / self.count,
            kl_max=self.kl_max,
            # kthvalue, not quantile: quantile refuses inputs above 2^24 elements.
            kl_p99=float(every.kthvalue(max(1, math.ceil(0.99 * every.numel()))).values),
            kl_ci95=(None, None) if math.isnan(lo) else (lo, hi),
            top1_agreement=self.agree / self.count,
            tokens=self.count,
            windows=len(self.window_kl),
        )
