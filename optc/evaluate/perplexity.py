"""Perplexity on non-overlapping (or strided) windows, with a confidence interval.

Standard protocol: the text is tokenized whole, cut into windows of ``seqlen`` tokens, and
perplexity = exp(mean next-token NLL over all scored tokens). With ``stride < seqlen`` each
window re-reads ``seqlen - stride`` tokens of context and scores only its last ``stride``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from optc.errors import OptcError
from optc.progress import NullProgress, Progress

# Two-sided 97.5% quantiles of Student's t for small degrees of freedom; 1.96 beyond.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021,
         60: 2.000, 120: 1.980}


def t_quantile(df: int) -> float:
    if df <= 0:
        return float("nan")
    keys = [k for k in sorted(_T975) if k <= df]
    return _T975[keys[-1]] if df <= 120 else 1.96


def mean_ci(values: torch.Tensor) -> tuple[float, float, float]:
    """Mean and 95% t-interval of per-window values."""
    n = values.numel()
    mean = float(values.double().mean())
    if n < 2:
        return mean, float("nan"), float("nan")
    half = t_quantile(n - 1) * float(values.double().std()) / math.sqrt(n)
    return mean, mean - half, mean + half


def model_context(model: torch.nn.Module) -> int | None:
    cfg = model.config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float
    ci95: tuple[float | None, float | None]  # from the per-window NLLs; None with one window
    windows: int
    tokens: int
    seqlen: int
    stride: int
    seconds: float
    window_nll: list[float]

    def to_dict(self) -> dict:
        return asdict(self)


def windows_of(tokens: torch.Tensor, seqlen: int, stride: int, limit: int | None) -> list[tuple[int, int]]:
    """(start, first scored position) of each window."""
    starts = range(0, tokens.numel() - seqlen + 1, stride)
    spans = [(s, 0 if s == 0 else seqlen - stride) for s in starts]
    if not spans:
        raise OptcError(
            f"evaluation text has {tokens.numel()} tokens, shorter than one window of {seqlen}"
        )
    return spans[:limit] if limit else spans


@torch.inference_mode()
def perplexity(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    seqlen: int,
    windows: int | None = None,
    stride: int | None = None,
    batch_size: int = 1,
    progress: Progress | None = None,
) -> PerplexityResult:
    """Perplexity of ``model`` on 1-D ``tokens``."""
    context = model_context(model)
    if context is not None and seqlen > context:
        raise OptcError(f"seqlen {seqlen} is above the model's context length {context}")
    stride = stride or seqlen
    if not 0 < stride <= seqlen:
        raise OptcError(f"stride must be in 1..seqlen ({seqlen}), got {stride}")
    spans = windows_of(tokens, seqlen, stride, windows)
    device = next(model.parameters()).device
    progress = progress or NullProgress()
    t0 = time.perf_counter()
    nll_sum, count, per_window = 0.0, 0, []
    with progress.task(f"perplexity ({len(spans)} x {seqlen})", total=len(spans)) as advance:
        for i in range(0, len(spans), batch_size):
            chunk = spans[i : i + batch_size]
            ids = torch.stack([tokens[s : s + seqlen] for s, _ in chunk]).to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            for j, (_, first) in enumerate(chunk):
                # Position t predicts token t+1; score targets from max(first, 1) on.
                lo = max(first, 1)
                nll = F.cross_entropy(logits[j, lo - 1 : -1].float(), ids[j, lo:], reduction="sum")
                n = seqlen - lo
                per_window.append(float(nll) / n)
                nll_sum += float(nll)
                count += n
                advance()
            del logits
    nll = nll_sum / count
    _, lo_ci, hi_ci = mean_ci(torch.tensor(per_window))
    return PerplexityResult(
        perplexity=math.exp(nll),
        nll=nll,
        # None, not NaN, so that report.json stays strict JSON.
        ci95=(math.exp(lo_ci), math.exp(hi_ci)) if not math.isnan(lo_ci) else (None, None),
        windows=len(spans),
        tokens=count,
        seqlen=seqlen,
        stride=stride,
        seconds=round(time.perf_counter() - t0, 3),
        window_nll=per_window,
    )
