"""Sparsity masks from importance scores (shared by magnitude, Wanda and SparseGPT).

A mask is a bool tensor shaped like the weight ``[N, K]``; ``True`` marks a kept weight.
N:M sparsity keeps ``n`` weights in every group of ``m`` consecutive input columns, the
layout sparse tensor cores need.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, MutableMapping

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


_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as bits, eight per ``uint8`` (little-endian within a byte, flattened in row-major
    order, the tail padded with False): an eighth of the bool tensor's memory."""
    flat = mask.detach().reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=flat.device)
    return (flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_mask(bits: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The bool mask of ``shape`` that :func:`pack_mask` packed into ``bits``."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=bits.device)
    flat = (bits[:, None] & weights).ne(0).reshape(-1)
    return flat[: math.prod(shape)].reshape(shape)


class PackedMasks(MutableMapping):
    """Module name -> keep mask, stored packed (:func:`pack_mask`): a pruned model's masks of
    every Linear, held for the whole run, cost a bit per weight instead of a byte (106 MB as
    bools for the default model). Reading a mask unpacks a new bool tensor."""

    def __init__(self, masks: Mapping[str, torch.Tensor] | None = None) -> None:
        self._bits: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {}
        self.update(masks or {})

    def __getitem__(self, name: str) -> torch.Tensor:
        bits, shape = self._bits[name]
        return unpack_mask(bits, shape)

    def __setitem__(self, name: str, mask: torch.Tensor) -> None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask of {name} must be bool, got {mask.dtype}")
        self._bits[name] = (pack_mask(mask), tuple(mask.shape))

    def __delitem__(self, name: str) -> None:
        del self._bits[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._bits)

    def __len__(self) -> int:
        return len(self._bits)
