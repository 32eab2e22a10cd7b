"""Confidence intervals of per-window metrics (Student's t, two-sided 95%)."""

from __future__ import annotations

import math

import torch

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
