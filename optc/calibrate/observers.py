"""Activation range observers for static int8 activation scales.

Two halves, kept apart as everywhere in optc:

- **Accumulators** fed by the sequential engine, one batch of a Linear's input at a time:
  :class:`MinMaxObserver` (running min/max, per tensor or per input channel),
  :class:`MovingAverageMinMaxObserver` (exponential moving average of each batch's min/max,
  as ``torch.ao``'s observer and llm-compressor's activation observer do) and
  :class:`HistogramObserver` (a histogram of ``|x|``). :class:`ActivationStats` bundles them
  with a seeded sample of rows, so one calibration pass can answer every observer.
- **Solvers**, pure functions of a histogram returning a clipping threshold ``t`` (the value
  that maps to the largest code): :func:`percentile_threshold`, :func:`mse_threshold` and
  :func:`kl_threshold`, the histogram calibrators of TensorRT / NVIDIA pytorch-quantization.

A symmetric ``b``-bit scale is then ``t / ((2^b - 1) / 2)`` (:func:`threshold_for`), the
convention compressed-tensors and vLLM use for ``input_scale``.
"""

from __future__ import annotations

import math

import torch

from optc.calibrate.stats import InputSampler
from optc.compress.actquant import InputQuant, nvfp4_input_global_scale, quantize_input, scale_from_threshold, sqnr_db
from optc.compress.schemes import OBSERVERS, ActivationScheme, ObserverName  # noqa: F401 - torch-free for the recipe schema

DEFAULT_BINS = 2048


# --------------------------------------------------------------------------------------------
# Accumulators


class MinMaxObserver:
    """Running minimum and maximum of every value seen (``channels``: one per input channel)."""

    def __init__(self, channels: int | None = None) -> None:
        self.channels = channels
        self.min: torch.Tensor | None = None
        self.max: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        x = x.detach()
        if self.channels is None:
            lo, hi = torch.aminmax(x.float())
        else:
            lo, hi = torch.aminmax(x.reshape(-1, self.channels).float(), dim=0)
        lo, hi = lo.cpu(), hi.cpu()
        self.min = lo if self.min is None else torch.minimum(self.min, lo)
        self.max = hi if self.max is None else torch.maximum(self.max, hi)

    @property
    def absmax(self) -> torch.Tensor:
        if self.min is None or self.max is None:
            raise ValueError("observer has seen no data")
        return torch.maximum(-self.min, self.max)


class MovingAverageMinMaxObserver:
    """Exponential moving average of each batch's min and max.

    ``m <- m + c * (batch_m - m)`` with averaging constant ``c``; the first batch sets ``m``.
    Less sensitive than a running max to one extreme batch, and dependent on batch order.
    """

    def __init__(self, averaging_constant: float = 0.01) -> None:
        if not 0 < averaging_constant <= 1:
            raise ValueError(f"averaging constant must be in (0, 1], got {averaging_constant}")
        self.c = averaging_constant
        self.min: float | None = None
        self.max: float | None = None
        # Every batch's (min, max), two floats a batch: batches seen in another order (or by
        # other processes) can be folded again into exactly the sequential average.
        self.history: list[tuple[float, float]] = []

    def add(self, x: torch.Tensor) -> None:
        lo, hi = (float(v) for v in torch.aminmax(x.detach().float()))
        self._fold(lo, hi)

    def _fold(self, lo: float, hi: float) -> None:
        self.history.append((lo, hi))
        if self.min is None or self.max is None:
            self.min, self.max = lo, hi
        else:
            self.min += self.c * (lo - self.min)
            self.max += self.c * (hi - self.max)

    def replay(self, history: list[tuple[float, float]]) -> None:
        """Start again from the per-batch ranges ``history``, in that order."""
        self.min = self.max = None
        self.history = []
        for lo, hi in history:
            self._fold(lo, hi)

    @property
    def absmax(self) -> float:
        if self.min is None or self.max is None:
            raise ValueError("observer has seen no data")
        return max(-self.min, self.max)


class HistogramObserver:
    """Histogram of ``|x|`` with fixed-width bins starting at 0.

    The width is the largest power of two that still spreads the values seen over more than
    ``bins`` bins (so between ``bins`` and ``2 bins`` are used). A batch beyond the covered
    range (``2 bins`` widths) doubles the width, merging neighbouring bins, which is exact for
    power-of-two widths; bin ``k`` counts ``k w <= |x| < (k + 1) w``. The result therefore depends only on
    the values seen, not on their order or batching, and histograms of disjoint data (other
    processes') merge exactly (:meth:`rebin`, then add the counts).
    """

    # Bin indices are computed in chunks, so a large batch needs no large int64 temporary.
    _CHUNK = 1 << 22

    def __init__(self, bins: int = DEFAULT_BINS) -> None:
        if bins < 1:
            raise ValueError(f"a histogram needs at least one bin, got {bins}")
        self.bins = bins
        self.width: float | None = None  # None while only zeros were seen (all in bin 0)
        self.counts = torch.zeros(0, dtype=torch.float64)

    def _width_for(self, top: float) -> float:
        # frexp: top / (2 bins) = m 2^e with 0.5 <= m < 1, so 2^e is the smallest power of two
        # with top < 2^e * 2 bins (then top >= 2^e * bins). Float32's smallest subnormal bounds
        # it from below.
        return max(math.ldexp(1.0, math.frexp(top / (2 * self.bins))[1]), math.ldexp(1.0, -149))

    def rebin(self, width: float) -> None:
        """Merge bins up to ``width`` (a power of two at least the current width)."""
        if self.width is None:
            self.width = width
            return
        while self.width < width:
            if self.counts.numel() % 2:
                self.counts = torch.cat([self.counts, self.counts.new_zeros(1)])
            self.counts = self.counts.view(-1, 2).sum(dim=1)
            self.width *= 2
        if self.width != width:
            raise ValueError(f"cannot merge histogram bins of width {self.width} into width {width}")

    def add(self, x: torch.Tensor) -> None:
        a = x.detach().float().abs().flatten()
        if a.numel() == 0:
            return
        top = float(a.max())
        if top > 0 and (self.width is None or top >= self.width * 2 * self.bins):
            self.rebin(max(self._width_for(top), self.width or 0.0))
        n = 1 if self.width is None else int(top // self.width) + 1
        if n > self.counts.numel():
            self.counts = torch.cat([self.counts, self.counts.new_zeros(n - self.counts.numel())])
        if self.width is None:
            self.counts[0] += a.numel()
            return
        # |x| / w is exact for a power-of-two w, so floor gives the true bin.
        for chunk in a.split(self._CHUNK):
            idx = torch.floor(chunk / self.width).long()
            self.counts += torch.bincount(idx, minlength=self.counts.numel()).double().cpu()

    @property
    def edges(self) -> torch.Tensor:
        if self.counts.numel() == 0:
            raise ValueError("observer has seen no data")
        width = self.width if self.width is not None else 1.0 / self.bins
        return torch.arange(self.counts.numel() + 1, dtype=torch.float64) * width


class ActivationStats:
    """Everything one calibration pass records about one Linear input.

    ``absmax`` per channel (SmoothQuant and the report), a moving-average min/max, the
    ``|x|`` histogram (percentile, MSE, KL) and a bounded seeded sample of rows (to measure
    quantization error exactly). ``extra`` accumulators (e.g. a Hessian) are fed the same
    batches, so a stage can collect everything it needs in one forward.
    """

    def __init__(
        self,
        in_features: int,
        total_tokens: int,
        *,
        bins: int = DEFAULT_BINS,
        averaging_constant: float = 0.01,
        sample_tokens: int = 2048,
        seed: int = 0,
        first_row: int = 0,
        extra: tuple = (),
    ) -> None:
        self.channel = MinMaxObserver(in_features)
        self.moving = MovingAverageMinMaxObserver(averaging_constant)
        self.histogram = HistogramObserver(bins)
        self.sampler = InputSampler(in_features, total_tokens, sample_tokens, seed, first_row)
        self.extra = extra

    def add(self, x: torch.Tensor) -> None:
        for acc in (self.channel, self.moving, self.histogram, self.sampler, *self.extra):
            acc.add(x)

    @property
    def absmax(self) -> float:
        return float(self.channel.absmax.max())


# --------------------------------------------------------------------------------------------
# Solvers: histogram -> clipping threshold


def _check_histogram(hist: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hist, edges = hist.double().flatten(), edges.double().flatten()
    if edges.numel() != hist.numel() + 1:
        raise ValueError(f"{hist.numel()} bins need {hist.numel() + 1} edges, got {edges.numel()}")
    if hist.sum() <= 0:
        raise ValueError("histogram is empty")
    return hist, edges


def percentile_threshold(hist: torch.Tensor, edges: torch.Tensor, percentile: float) -> float:
    """Smallest ``t`` with ``percentile`` % of the mass at or below it.

    Linear interpolation inside the bin where the cumulative count crosses the target
    (values assumed uniform within a bin); ``100`` gives the right edge of the last
    occupied bin.
    """
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    hist, edges = _check_histogram(hist, edges)
    cum = torch.cat([hist.new_zeros(1), hist.cumsum(0)])
    target = cum[-1] * (percentile / 100)
    k = int(torch.searchsorted(cum[1:], target).clamp(max=hist.numel() - 1))
    frac = float((target - cum[k]) / hist[k]) if hist[k] > 0 else 1.0
    return float(edges[k] + min(max(frac, 0.0), 1.0) * (edges[k + 1] - edges[k]))


def mse_threshold(
    hist: torch.Tensor, edges: torch.Tensor, bits: int = 8, start_bin: int = 128, chunk: int = 256
) -> float:
    """``t`` minimising the histogram-weighted squared error of symmetric fake-quantization.

    Each bin stands for its centre ``c``; candidate thresholds are the bin edges from
    ``start_bin`` on (as pytorch-quantization's MSE calibrator) and the error of a candidate
    is ``sum_k h_k (c_k - Q_t(c_k))^2`` with the same grid as :func:`threshold_for`:
    ``s = t / ((2^b - 1) / 2)``, codes clamped to ``2^(b-1) - 1``.
    """
    hist, edges = _check_histogram(hist, edges)
    centers = (edges[1:] + edges[:-1]) / 2
    first = min(start_bin, hist.numel())
    candidates = edges[first:]
    qmax = 2 ** (bits - 1) - 1
    half_range = (2**bits - 1) / 2
    errors = []
    # Chunks bound the [candidates, bins] working set to a few MB.
    for c in candidates.split(chunk):
        s = (c / half_range)[:, None]
        q = torch.round(centers[None, :] / s).clamp_(max=qmax) * s
        errors.append(((q - centers[None, :]).pow_(2) * hist[None, :]).sum(dim=1))
    err = torch.cat(errors)
    return float(candidates[int(err.argmin())])


def kl_divergences(
    hist: torch.Tensor, bits: int = 8, start_bin: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(P || Q) of every candidate threshold of TensorRT's entropy calibration.

    For a candidate keeping the first ``i`` bins (``i = start_bin .. B``), ``P`` is the
    histogram clipped at bin ``i`` (the mass beyond added to bin ``i - 1``) and ``Q`` is
    ``bins[:i]`` merged into ``n = 2^(b-1)`` levels (bin ``k`` goes to level
    ``floor(k n / i)``) and expanded back, each level's count spread evenly over its
    non-empty bins (empty bins stay empty). Both are normalised; ``P_k > 0 = Q_k`` makes the
    divergence infinite. This is pytorch-quantization's ``_compute_amax_entropy`` with
    stride 1 (TensorRT's "entropy calibration", Migacz 2017).

    The direct form costs ``O(B^2)``; here every candidate costs ``O(n)`` through prefix
    sums: with ``S_j`` the count and ``m_j`` the non-empty bins of level ``j``,
    ``N = sum(h)`` and ``C_i = sum(h[:i])``,

        N * KL = sum_{k<i} h_k log h_k - C_i log N - sum_j S_j log(S_j / m_j) + C_i log C_i

    plus a correction replacing ``h_{i-1}`` by ``h_{i-1} + (N - C_i)`` in the last term.
    Returns ``(i, KL)`` for all candidates.
    """
    h = hist.double().flatten()
    n_levels = 2 ** (bits - 1)
    b = h.numel()
    start = n_levels if start_bin is None else start_bin
    start = min(max(start, n_levels), b)
    i = torch.arange(start, b + 1, dtype=torch.int64)  # [C] candidate bin counts

    zero = h.new_zeros(1)
    cum = torch.cat([zero, h.cumsum(0)])  # cum[k] = sum(h[:k])
    nonzero = torch.cat([zero, (h > 0).double().cumsum(0)])
    hlogh = torch.cat([zero, torch.xlogy(h, h).cumsum(0)])
    total = cum[-1]

    # Level j of candidate i spans bins [ceil(j i / n), ceil((j + 1) i / n)); n is a power
    # of two, so the ceiling division is a shift.
    j = torch.arange(n_levels + 1, dtype=torch.int64)
    bounds = (j[None, :] * i[:, None] + (n_levels - 1)) >> (bits - 1)  # [C, n + 1]
    level_sum = cum[bounds].diff(dim=1)  # S_j  [C, n]
    level_nz = nonzero[bounds].diff(dim=1)  # m_j
    # sum_j S_j log(S_j / m_j); xlogy(0, .) = 0 covers empty levels.
    s_log_avg = (torch.xlogy(level_sum, level_sum) - torch.xlogy(level_sum, level_nz)).sum(dim=1)

    c_i = cum[i]
    log_total = total.log()
    kl = hlogh[i] - c_i * log_total - s_log_avg + torch.xlogy(c_i, c_i)

    # Bin i - 1 holds the outliers too: swap its P term. Its level is n - 1, whose
    # normalised Q value is q = S / (m C_i).
    last = h[i - 1]
    outliers = total - c_i
    log_q = (level_sum[:, -1] / (level_nz[:, -1].clamp_min(1) * c_i.clamp_min(1e-300))).clamp_min(1e-300).log()

    def term(p: torch.Tensor) -> torch.Tensor:  # p log(p / N) - p log q
        return torch.xlogy(p, p) - p * (log_total + log_q)

    kl = (kl + term(last + outliers) - term(last)) / total
    kl = torch.where((outliers > 0) & (last == 0), torch.full_like(kl, math.inf), kl)
    return i, kl


def kl_threshold(hist: torch.Tensor, edges: torch.Tensor, bits: int = 8, start_bin: int | None = None) -> float:
    """The entropy-calibration threshold: the right edge of the last kept bin of the
    candidate with the smallest KL(P || Q); ties go to the widest range, as in TensorRT."""
    hist, edges = _check_histogram(hist, edges)
    if hist.numel() <= 2 ** (bits - 1):
        return float(edges[-1])  # every bin gets its own level: nothing to trade off
    i, kl = kl_divergences(hist, bits, start_bin)
    best = kl.numel() - 1 - int(torch.flip(kl, [0]).argmin())
    return float(edges[int(i[best])])


# --------------------------------------------------------------------------------------------
# Dispatch


def threshold_for(
    observer: str,
    stats: ActivationStats,
    *,
    bits: int = 8,
    percentile: float = 99.99,
) -> float:
    """The clipping threshold the named observer chooses from ``stats``."""
    if observer == "minmax":
        return stats.absmax
    if observer == "moving_minmax":
        return stats.moving.absmax
    hist, edges = stats.histogram.counts, stats.histogram.edges
    if observer == "percentile":
        return percentile_threshold(hist, edges, percentile)
    if observer == "mse":
        return mse_threshold(hist, edges, bits)
    if observer == "kl":
        return kl_threshold(hist, edges, bits)
    raise ValueError(f"unknown observer {observer!r} (expected one of {', '.join(OBSERVERS)})")


def clipped_fraction(hist: torch.Tensor, edges: torch.Tensor, threshold: float) -> float:
    """Share of values above ``threshold`` (bins straddling it counted pro rata)."""
    hist, edges = _check_histogram(hist, edges)
    lo, hi = edges[:-1], edges[1:]
    above = ((hi - threshold) / (hi - lo)).clamp(0, 1)
    return float((hist * above).sum() / hist.sum())


# --------------------------------------------------------------------------------------------
# Solving from calibration statistics, and measuring the result


def solve_input_quant(scheme: ActivationScheme, stats: ActivationStats | None) -> InputQuant:
    """The input quantization ``scheme`` prescribes, static scales chosen by its observer."""
    if scheme.dynamic and not scheme.tensor_group:
        return InputQuant(scheme)
    if stats is None:
        raise ValueError("static activation scales need calibration statistics")
    if scheme.tensor_group:
        t = threshold_for(scheme.observer, stats, percentile=scheme.percentile)
        return InputQuant(scheme, global_scale=nvfp4_input_global_scale(t))
    t = threshold_for(scheme.observer, stats, bits=scheme.bits, percentile=scheme.percentile)
    return InputQuant(scheme, scale_from_threshold(t, scheme.bits, scheme.type == "float"))


def observer_ranges(stats: ActivationStats, scheme: ActivationScheme) -> dict[str, float]:
    """The threshold every observer would choose from the same statistics (for the report)."""
    return {
        name: round(threshold_for(name, stats, bits=scheme.bits, percentile=scheme.percentile), 6)
        for name in OBSERVERS
    }


def _json_db(v: float) -> float | None:
    # No error at all gives an infinite ratio, which strict JSON cannot hold.
    return round(v, 3) if math.isfinite(v) else None


def calibration_summary(
    iq: InputQuant, stats: ActivationStats, w: torch.Tensor, w_hat: torch.Tensor
) -> dict:
    """How much one quantized Linear loses, measured on the calibration sample rows.

    ``input_sqnr_db`` compares ``x`` with its fake-quantized self; ``output_sqnr_db``
    compares ``x W^T`` with ``Q(x) Q(W)^T`` (weights and activations together).
    """
    x = stats.sampler.sample.float()
    x_hat = quantize_input(x, iq)
    w, w_hat = w.float().to(x.device), w_hat.float().to(x.device)
    absmax = stats.absmax
    out = {
        "activations": iq.scheme.label(),
        "absmax": round(absmax, 6),
        "input_sqnr_db": _json_db(sqnr_db(x, x_hat)),
        "output_sqnr_db": _json_db(sqnr_db(x @ w.T, x_hat @ w_hat.T)),
    }
    t = iq.threshold()
    if t is not None:
        out.update(
            threshold=round(t, 6),
            clip_ratio=round(t / absmax, 6) if absmax > 0 else 1.0,
            clipped=clipped_fraction(stats.histogram.counts, stats.histogram.edges, t),
        )
    return out
