"""Activation observers: accumulators (exact counts, determinism) and threshold solvers
(known answers, the literal TensorRT/pytorch-quantization KL loop, timing)."""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import pytest
import torch

from optc.calibrate.observers import (
    OBSERVERS,
    ActivationStats,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    clipped_fraction,
    kl_divergences,
    kl_threshold,
    mse_threshold,
    percentile_threshold,
    threshold_for,
)


def reference_kl(bins: np.ndarray, n_levels: int = 128, start: int = 128) -> np.ndarray:
    """pytorch-quantization's ``_compute_amax_entropy`` loop, written out literally."""
    out = []
    for i in range(start, len(bins) + 1):
        space = np.linspace(0, i, num=n_levels + 1)
        level = np.digitize(range(i), space) - 1
        level[bins[:i] == 0] = -1
        merged = np.zeros(n_levels)
        for k, j in enumerate(level):
            if j != -1:
                merged[j] += bins[k]
        for j, members in Counter(level).items():
            if j != -1:
                merged[j] /= members
        q = np.array([merged[j] if j != -1 else 0.0 for j in level])
        q /= q.sum()
        p = bins[:i].astype(np.float64).copy()
        p[-1] += bins[i:].sum()
        p /= p.sum()
        keep = p > 0
        out.append(np.sum(p[keep] * np.log(p[keep] / q[keep])) if (q[keep] > 0).all() else np.inf)
    return np.array(out)


def gaussian_with_outliers(n: int = 1_000_000, outliers: int = 200, at: float = 40.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[:outliers] = at * torch.sign(torch.randn(outliers, generator=g))
    return x


def histogram_of(x: torch.Tensor, bins: int = 2048) -> HistogramObserver:
    obs = HistogramObserver(bins)
    obs.add(x)
    return obs


@pytest.mark.parametrize("seed", range(4))
def test_kl_matches_the_literal_loop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    b = 300 + 60 * seed
    h = rng.poisson(80 * np.exp(-np.arange(b) / (40 + 10 * seed))).astype(np.float64)
    h[rng.integers(0, b, 25)] = 0  # empty bins inside the range
    h[-1] = 2  # a far outlier
    ref = reference_kl(h)
    i, kl = kl_divergences(torch.tensor(h))
    assert i.tolist() == list(range(128, b + 1))
    kl = kl.numpy()
    assert np.array_equal(np.isfinite(kl), np.isfinite(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(kl[finite], ref[finite], rtol=1e-9, atol=1e-12)
    assert np.argmin(kl) == np.argmin(ref)


def test_kl_threshold_falls_well_inside_planted_outliers() -> None:
    obs = histogram_of(gaussian_with_outliers())
    t = kl_threshold(obs.counts, obs.edges)
    # The bulk is N(0, 1): the entropy threshold lands a few sigma out, far below the outliers
    # at 40 that set the min-max range.
    assert 2.5 < t < 10
    assert obs.edges[-2] <= 40.0 < obs.edges[-1]  # the last bin holds the outliers' range
    assert clipped_fraction(obs.counts, obs.edges, t) < 1e-3


def test_kl_keeps_the_full_range_without_outliers() -> None:
    x = torch.rand(200_000, generator=torch.Generator().manual_seed(1)) * 3  # uniform: nothing to clip
    obs = histogram_of(x)
    assert kl_threshold(obs.counts, obs.edges) > 0.95 * 3


@pytest.mark.slow  # a speed target: timed only in the slow suite, never in CI's shared machine
def test_kl_search_over_2048_bins_is_fast() -> None:
    obs = histogram_of(gaussian_with_outliers())
    assert 2048 < obs.counts.numel() <= 4096
    kl_threshold(obs.counts, obs.edges)  # warm-up
    best = min(_timed(lambda: kl_threshold(obs.counts, obs.edges)) for _ in range(5))
    assert best < 0.050, f"KL threshold search took {best * 1e3:.1f} ms"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_percentile_known_answers() -> None:
    x = torch.linspace(0, 10, 100_001)
    obs = histogram_of(x)
    assert percentile_threshold(obs.counts, obs.edges, 50) == pytest.approx(5.0, abs=0.01)
    assert percentile_threshold(obs.counts, obs.edges, 99) == pytest.approx(9.9, abs=0.01)
    assert 10.0 < percentile_threshold(obs.counts, obs.edges, 100) <= 10.0 + obs.width  # the max's bin edge
    outliers = histogram_of(gaussian_with_outliers(outliers=50))
    assert 3.0 < percentile_threshold(outliers.counts, outliers.edges, 99.99) < 5.0
    for bad in (0, -1, 100.5):
        with pytest.raises(ValueError, match=r"\(0, 100\]"):
            percentile_threshold(obs.counts, obs.edges, bad)


def _fq_error(x: torch.Tensor, t: float) -> float:
    s = t / 127.5
    return float(((torch.round(x / s).clamp(-128, 127) * s - x) ** 2).sum())


def test_mse_threshold_beats_minmax_on_the_data_itself() -> None:
    x = torch.randn(500_000, generator=torch.Generator().manual_seed(2)) ** 3  # heavy tails
    obs = histogram_of(x)
    t = mse_threshold(obs.counts, obs.edges)
    amax = float(x.abs().max())
    assert t < 0.9 * amax
    assert _fq_error(x, t) < 0.8 * _fq_error(x, amax)
    # Outliers that carry real mass are kept: clipping them would cost more than rounding.
    spiky = histogram_of(gaussian_with_outliers(outliers=5000, at=20.0))
    assert mse_threshold(spiky.counts, spiky.edges) > 15


def test_histogram_extends_with_exact_counts() -> None:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(10_000, generator=g), 3 * torch.randn(10_000, generator=g)
    obs = HistogramObserver(256)
    obs.add(a)
    first = obs.width
    assert math.log2(first) == int(math.log2(first))  # a power of two
    assert 256 < obs.counts.numel() <= 512  # spreads max|a| over more than 256 bins
    obs.add(b)
    assert obs.counts.sum() == 20_000
    top = float(torch.cat([a, b]).abs().max())
    assert obs.width > first and obs.width * 256 <= top < obs.width * 512
    n = obs.counts.numel()
    assert n == int(top // obs.width) + 1
    # Exactly the histogram of everything at the final width, and independent of the order.
    both = torch.bincount(torch.floor(torch.cat([a, b]).abs() / obs.width).long(), minlength=n).double()
    assert torch.equal(obs.counts, both)
    other = HistogramObserver(256)
    for x in (b[:5000], a, b[5000:]):
        other.add(x)
    assert other.width == obs.width and torch.equal(other.counts, obs.counts)


def test_moving_average_replays_batches() -> None:
    batches = [torch.randn(64, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(5)]
    ema = MovingAverageMinMaxObserver(averaging_constant=0.3)
    for x in batches:
        ema.add(x)
    again = MovingAverageMinMaxObserver(averaging_constant=0.3)
    again.add(batches[4])  # state from other data is discarded
    again.replay(ema.history)
    assert (again.min, again.max) == (ema.min, ema.max) and len(again.history) == 5


def test_minmax_and_moving_average() -> None:
    mm = MinMaxObserver()
    ch = MinMaxObserver(channels=2)
    ema = MovingAverageMinMaxObserver(averaging_constant=0.5)
    for batch in (torch.tensor([[1.0, -2.0], [0.5, 1.0]]), torch.tensor([[-4.0, 0.0], [3.0, 0.0]])):
        for obs in (mm, ch, ema):
            obs.add(batch)
    assert float(mm.absmax) == 4.0
    assert ch.absmax.tolist() == [4.0, 2.0]
    # min: -2 then -2 + 0.5 (-4 - -2) = -3; max: 1 then 1 + 0.5 (3 - 1) = 2
    assert (ema.min, ema.max, ema.absmax) == (-3.0, 2.0, 3.0)
    with pytest.raises(ValueError):
        MovingAverageMinMaxObserver(averaging_constant=0)


def _stats(seed: int) -> ActivationStats:
    stats = ActivationStats(16, 4 * 512, sample_tokens=256, seed=seed)
    g = torch.Generator().manual_seed(11)
    for _ in range(4):
        stats.add(torch.randn(2, 256, 16, generator=g) * torch.linspace(0.1, 8, 16))
    return stats


def test_observers_are_deterministic_for_a_seed() -> None:
    a, b, c = _stats(0), _stats(0), _stats(1)
    assert torch.equal(a.sampler.sample, b.sampler.sample)
    assert not torch.equal(a.sampler.sample, c.sampler.sample)
    for name in OBSERVERS:
        assert threshold_for(name, a) == threshold_for(name, b)
    assert threshold_for("minmax", a) >= max(threshold_for(n, a) for n in ("percentile", "kl"))
    with pytest.raises(ValueError, match="unknown observer 'entropy'"):
        threshold_for("entropy", a)
