"""Sparsity masks from importance scores (shared by magnitude, Wanda and SparseGPT).

A mask is a bool tensor shaped like the weight ``[N, K]``; ``True`` marks a kept weight.
N:M sparsity keeps ``n`` weights in every group of ``m`` consecutive input columns, the
layout sparse tensor cores need.
"""

from __future__ import annotations

import torch

from optc.compress.schemes import parse_pattern  # noqa: F401 - defined torch-free, re-exported
from optc.errors import OptcError


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the ``n`` highest scores in each group of ``m`` input columns."""
    rows, cols = scores.shape
    if cols % m:
        raise OptcError(f"N:M pattern {n}:{m} needs in_features divisible by {m}, got {cols}")
    groups = scores.reshape(rows, cols // m, m)
    keep = groups.topk(n, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(rows, cols)


def unstructured_mask(scores: torch.Tensor, sparsity: float, per_row: bool = False) -> torch.Tensor:
    """Drop the ``sparsity`` fraction of lowest scores (over the whole tensor or per row)."""
    if not 0 <= sparsity < 1:
        raise OptcError(f"sparsity must be in [0, 1), got {sparsity}")
    if per_row:
        k = int(scores.shape[1] * sparsity)
        mask = torch.ones_like(scores, dtype=torch.bool)
        if k:
            drop = scores.topk(k, dim=1, largest=False).indices
            mask.scatter_(1, drop, False)
        return mask
    k = int(scores.numel() * sparsity)
    mask = torch.ones_like(scores, dtype=torch.bool)
    if k:
        drop = scores.flatten().topk(k, largest=False).indices
        mask.view(-1)[drop] = False
    return mask


def nm_violations(weight: torch.Tensor, n: int, m: int) -> int:
    """Groups of ``m`` consecutive input columns holding more than ``n`` non-zeros (0 when the
    weight is exactly N:M sparse, as sparse tensor cores require)."""
    rows, cols = weight.shape
    if cols % m:
        raise OptcError(f"N:M pattern {n}:{m} needs in_features divisible by {m}, got {cols}")
    nonzero = (weight.reshape(rows, cols // m, m) != 0).sum(dim=-1)
    return int((nonzero > n).sum())
