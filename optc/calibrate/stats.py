"""Small activation accumulators fed by the sequential runner's hooks."""

from __future__ import annotations

import math

import torch

from optc.calibrate.hessian import HessianAccumulator


def _mix(seed: int, row: int) -> int:
    """One 63-bit generator seed from (seed, row), distinct for distinct rows."""
    return (seed * 0x9E3779B97F4A7C15 + row) % (1 << 63)


class InputSampler:
    """Per-channel mean |x| over every token, plus a fixed-size, seeded sample of token rows.

    AWQ needs the mean magnitude of each input channel (over all data) and real rows to
    measure quantized output error on; a bounded sample keeps that memory independent of the
    calibration set size.
    """

    def __init__(
        self, in_features: int, total_tokens: int, max_tokens: int, seed: int = 0, first_row: int = 0
    ) -> None:
        self.in_features = in_features
        self.keep_fraction = min(1.0, max_tokens / max(1, total_tokens))
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.count = 0
        self.rows: list[torch.Tensor] = []
        self.seed = seed
        self.next_row = first_row  # index of the next row among all calibration tokens

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.in_features).float()
        self.abs_sum += x.abs().sum(dim=0).double().cpu()
        self.count += x.shape[0]
        k = max(1, math.ceil(x.shape[0] * self.keep_fraction))
        # Each batch draws from a generator seeded by its first row's global index, so the
        # same rows are kept however the batches are split over processes.
        gen = torch.Generator().manual_seed(_mix(self.seed, self.next_row))
        self.next_row += x.shape[0]
        idx = torch.randperm(x.shape[0], generator=gen)[:k].sort().values
        self.rows.append(x[idx.to(x.device)].clone())

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(1, self.count)).float()

    @property
    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


class FeatureNormAccumulator:
    """Mean squared value of each input feature over every token, ``||X_j||_2^2 / n``.

    Wanda's (and OWL's) only statistic: a ``[K]`` vector, so it costs nothing next to a
    Hessian. Summed in float64 because it runs over millions of tokens.
    """

    def __init__(self, in_features: int) -> None:
        self.in_features = in_features
        self.sq_sum = torch.zeros(in_features, dtype=torch.float64)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.in_features)
        self.sq_sum += x.float().pow(2).sum(dim=0).double().cpu()
        self.count += x.shape[0]

    @property
    def sq_norm(self) -> torch.Tensor:
        return (self.sq_sum / max(1, self.count)).float()


class GramAccumulator:
    """AWQ's statistics of one input over every token: ``H`` (a :class:`HessianAccumulator`)
    and the per-channel mean ``|x|``.

    With the Gram matrix the output error of any weight error ``D`` over all calibration
    tokens is ``tr(D G D^T)``, ``G = X^T X / T``: every candidate of a search is measured on all
    the data at ``K / T`` of the cost of multiplying by ``X``, and memory does not grow with
    the calibration set.
    """

    def __init__(self, in_features: int, matmul_dtype: torch.dtype | None = None, fold: int = 1) -> None:
        self.in_features = in_features
        self.hessian = HessianAccumulator(in_features, matmul_dtype=matmul_dtype, fold=fold)
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.in_features)
        self.hessian.add(x)
        self.abs_sum += x.float().abs().sum(dim=0).double().cpu()
        self.count += x.shape[0]

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(1, self.count)).float()

    @property
    def gram(self) -> torch.Tensor:
        """``X^T X / T`` (the Hessian accumulator keeps GPTQ's ``2 / T`` convention)."""
        return self.hessian.H.mul_(0.5)
