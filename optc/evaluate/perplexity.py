"""Perplexity on non-overlapping (or strided) windows, with a confidence interval.

Standard protocol: the text is tokenized whole, cut into windows of ``seqlen`` tokens, and
perplexity = exp(mean next-token NLL over all scored tokens). With ``stride < seqlen`` each
window re-reads ``seqlen - stride`` tokens of context and scores only its last ``stride``.

Against a baseline, both models read the same windows in one pass (:func:`evaluate_windows`),
so the per-window NLLs are paired: the interval of their mean difference tells a real
regression from window-to-window noise, and the same logits feed the KL divergence.
The tokenized text is cached on disk, keyed by the tokenizer and the text's hash.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from optc.errors import OptcError
from optc.evaluate.kl import DivergenceAccumulator, DivergenceResult
from optc.evaluate.stats import mean_ci
from optc.progress import NullProgress, Progress

log = logging.getLogger(__name__)

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
    # Logits that were NaN or infinite, and the first module whose output was not finite: a model
    # with NaN weights or scales scores NaN, which must never pass for a number.
    non_finite_logits: int = 0
    first_non_finite: str | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        if not self.non_finite_logits:  # the usual report holds no such keys
            del out["non_finite_logits"], out["first_non_finite"]
        return out


def windows_of(tokens: torch.Tensor, seqlen: int, stride: int, limit: int | None) -> list[tuple[int, int]]:
    """(start, first scored position) of each window."""
    starts = range(0, tokens.numel() - seqlen + 1, stride)
    spans = [(s, 0 if s == 0 else seqlen - stride) for s in starts]
    if not spans:
        raise OptcError(
            f"evaluation text has {tokens.numel()} tokens, shorter than one window of {seqlen}"
        )
    return spans[:limit] if limit else spans


def _check_protocol(model: torch.nn.Module, seqlen: int, stride: int | None) -> int:
    context = model_context(model)
    if context is not None and seqlen > context:
        raise OptcError(f"seqlen {seqlen} is above the model's context length {context}")
    stride = stride or seqlen
    if not 0 < stride <= seqlen:
        raise OptcError(f"stride must be in 1..seqlen ({seqlen}), got {stride}")
    return stride


class _WindowScores:
    """Per-window mean NLLs of one model (an accumulator fed by the window loop)."""

    def __init__(self) -> None:
        self.nll_sum, self.count, self.per_window = 0.0, 0, []
        self.non_finite = 0  # logits that are NaN or infinite
        self.first_bad: int | None = None  # the window holding the first of them

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        # logits[t] predicts targets[t]; both already cut to the window's scored positions.
        bad = int(logits.numel() - torch.isfinite(logits).sum())
        if bad and self.first_bad is None:
            self.first_bad = len(self.per_window)
        self.non_finite += bad
        nll = float(F.cross_entropy(logits.float(), targets, reduction="sum"))
        self.per_window.append(nll / targets.numel())
        self.nll_sum += nll
        self.count += targets.numel()

    def result(self, seqlen: int, stride: int, seconds: float) -> PerplexityResult:
        nll = self.nll_sum / self.count
        _, lo_ci, hi_ci = mean_ci(torch.tensor(self.per_window))
        return PerplexityResult(
            perplexity=math.exp(nll),
            nll=nll,
            # None, not NaN, so that report.json stays strict JSON.
            ci95=(math.exp(lo_ci), math.exp(hi_ci)) if not math.isnan(lo_ci) else (None, None),
            windows=len(self.per_window),
            tokens=self.count,
            seqlen=seqlen,
            stride=stride,
            seconds=round(seconds, 3),
            window_nll=self.per_window,
            non_finite_logits=self.non_finite,
        )


@dataclass
class WindowEvaluation:
    """One pass over the evaluation windows: the model, and its baseline when given."""

    model: PerplexityResult
    baseline: PerplexityResult | None = None
    divergence: DivergenceResult | None = None


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


def _first_tensor(out: object) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return getattr(out, "logits", None) if not isinstance(out, tuple | list) else None


@torch.inference_mode()
def first_non_finite_module(model: torch.nn.Module, ids: torch.Tensor) -> str | None:
    """The first module (in the order the forward runs them) whose output holds a NaN or an
    infinity on ``ids``: where a broken weight or scale shows, for the error message."""
    found: list[str] = []

    def hook(name: str):
        def check(_module, _inputs, out) -> None:
            t = _first_tensor(out)
            if not found and t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                found.append(name)
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        _logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


@torch.inference_mode()
def evaluate_windows(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    seqlen: int,
    windows: int | None = None,
    stride: int | None = None,
    batch_size: int = 1,
    progress: Progress | None = None,
    baseline: torch.nn.Module | None = None,
) -> WindowEvaluation:
    """Perplexity of ``model`` (and ``baseline``, with KL between them) on 1-D ``tokens``."""
    stride = _check_protocol(model, seqlen, stride)
    if baseline is not None:
        _check_protocol(baseline, seqlen, stride)
    spans = windows_of(tokens, seqlen, stride, windows)
    device = next(model.parameters()).device
    progress = progress or NullProgress()
    scores, base_scores = _WindowScores(), _WindowScores()
    divergence = DivergenceAccumulator() if baseline is not None else None
    seconds = base_seconds = 0.0
    label = f"perplexity ({len(spans)} x {seqlen})" + (" + baseline" if baseline is not None else "")
    with progress.task(label, total=len(spans)) as advance:
        for i in range(0, len(spans), batch_size):
            chunk = spans[i : i + batch_size]
            ids = torch.stack([tokens[s : s + seqlen] for s, _ in chunk]).to(device)
            t0 = time.perf_counter()
            logits = _logits(model, ids)
            t1 = time.perf_counter()
            base_logits = _logits(baseline, ids) if baseline is not None else None
            seconds += t1 - t0
            base_seconds += time.perf_counter() - t1
            for j, (_, first) in enumerate(chunk):
                # Position t predicts token t+1; score targets from max(first, 1) on.
                lo = max(first, 1)
                targets = ids[j, lo:]
                scores.update(logits[j, lo - 1 : -1], targets)
                if base_logits is not None:
                    base_scores.update(base_logits[j, lo - 1 : -1], targets)
                    divergence.update(base_logits[j, lo - 1 : -1], logits[j, lo - 1 : -1])
                advance()
            del logits, base_logits
    result = WindowEvaluation(
        model=scores.result(seqlen, stride, seconds),
        baseline=base_scores.result(seqlen, stride, base_seconds) if baseline is not None else None,
        divergence=divergence.result() if divergence is not None else None,
    )
    for who, acc, res in ((model, scores, result.model), (baseline, base_scores, result.baseline)):
        if res is not None and acc.first_bad is not None:
            start, _ = spans[acc.first_bad]
            res.first_non_finite = first_non_finite_module(who, tokens[start : start + seqlen][None].to(device))
    return result


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
    return evaluate_windows(model, tokens, seqlen, windows, stride, batch_size, progress).model


def paired_difference(baseline: PerplexityResult, model: PerplexityResult) -> dict:
    """The model's perplexity change over the baseline on the same windows, with a 95% CI.

    The per-window NLL differences ``d_i`` are paired (same text), so their t-interval is far
    narrower than the two perplexities' own intervals; since ppl = exp(mean NLL), the
    relative change is ``exp(mean d) - 1``.
    """
    if len(baseline.window_nll) != len(model.window_nll):
        raise OptcError("baseline and model were evaluated on different windows")
    d = torch.tensor(model.window_nll, dtype=torch.float64) - torch.tensor(baseline.window_nll, dtype=torch.float64)
    _, lo, hi = mean_ci(d)
    delta = model.nll - baseline.nll  # token-weighted, matching the reported perplexities
    ci = (None, None) if math.isnan(lo) else (100 * math.expm1(lo), 100 * math.expm1(hi))
    return {
        "ppl_baseline": baseline.perplexity,
        "ppl_model": model.perplexity,
        "ppl_difference": model.perplexity - baseline.perplexity,
        "ppl_increase_pct": 100 * math.expm1(delta),
        "ppl_increase_pct_ci95": ci,
        "nll_difference": delta,
        # A change is "significant" when its whole interval lies on one side of zero.
        "significant": ci[0] is not None and (ci[0] > 0 or ci[1] < 0),
        "windows": len(d),
    }


# --- tokenized-text cache ------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything that decides token ids: the full tokenizer definition when the
    tokenizer is a fast one (vocab, merges, normalizer, pre-tokenizer), else its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{text}".encode()).hexdigest()[:20]


def evaluation_token_cache(tokenizer, dataset, use_cache: bool = True) -> torch.Tensor:
    """:func:`optc.data.evaluation_tokens`, cached on disk under ``$OPTC_CACHE/tokens``.

    The key is the tokenizer fingerprint and the sha256 of the text, so an edited file or a
    different tokenizer never reads stale ids.
    """
    from optc.data import load_text, tokenize
    from optc.model.load import cache_dir

    # dataset: a name/path or an optc.data.DataSource; conversations render with the chat template.
    text = load_text(dataset, "evaluation", tokenizer)
    if not use_cache:
        return tokenize(text, tokenizer)
    text_hash = hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]
    # safetensors, like every file optc reads or writes: no pickle.
    path = cache_dir() / "tokens" / f"{tokenizer_fingerprint(tokenizer)}-{text_hash}.safetensors"
    if path.is_file():
        try:
            return load_file(path)["ids"].long()
        except (OSError, SafetensorError, KeyError) as exc:
            log.warning("ignoring unreadable token cache %s (%s)", path, exc)
    ids = tokenize(text, tokenizer)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokens-", suffix=".safetensors")
        os.close(fd)
        # int32 halves the file; written beside the target and renamed so readers never
        # see a partial file.
        save_file({"ids": ids.to(torch.int32).contiguous()}, tmp)
        Path(tmp).replace(path)
    except OSError as exc:
        log.warning("could not write the token cache %s (%s)", path, exc)
    return ids
