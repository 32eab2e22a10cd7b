"""Wanda (Sun et al., 2023, "A Simple and Effective Pruning Approach for Large Language
Models") as pure functions of a weight and its input feature norms.

Section numbers refer to the paper. Wanda needs no weight update: it only changes which
weights are removed, scoring each by its magnitude times the norm of the input feature it
multiplies, and comparing scores within each output row.
"""

from __future__ import annotations

import torch

from optc.compress.masks import nm_mask, unstructured_mask
from optc.errors import OptcError


def wanda_scores(W: torch.Tensor, sq_norm: torch.Tensor) -> torch.Tensor:
    """``S_ij = |W_ij| * ||X_j||_2`` (§3, Eq. 1).

    ``W`` is ``[N, K]``; ``sq_norm`` is ``||X_j||_2^2`` per input feature ``[K]`` (any common
    scale, e.g. a mean over tokens: scores are only ever compared within a row).
    """
    if sq_norm.shape != (W.shape[1],):
        raise ValueError(f"feature norms {tuple(sq_norm.shape)} do not match weight {tuple(W.shape)}")
    return W.detach().float().abs() * sq_norm.to(W.device, torch.float32).clamp_min(0).sqrt()[None, :]


def wanda_mask(
    W: torch.Tensor,
    sq_norm: torch.Tensor,
    *,
    sparsity: float = 0.5,
    nm: tuple[int, int] | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keep-mask of ``W`` (``True`` = kept) at ``sparsity`` or N:M ``nm``.

    Unstructured sparsity compares weights per output row (§3 "comparison group": the paper
    finds per-output comparison clearly better than per-layer for LLMs); N:M keeps the ``n``
    best of every ``m`` consecutive inputs of a row (§4, "structured N:M sparsity").
    ``keep`` is an earlier mask: weights it removed stay removed (masks never regrow).
    """
    scores = wanda_scores(W, sq_norm)
    if keep is not None:
        # -inf ranks already-pruned weights below everything, so they are dropped first.
        scores = scores.masked_fill(~keep.to(scores.device), float("-inf"))
    if nm is not None:
        mask = nm_mask(scores, *nm)
    else:
        if not 0 <= sparsity < 1:
            raise OptcError(f"sparsity must be in [0, 1), got {sparsity}")
        mask = unstructured_mask(scores, sparsity, per_row=True)
    return mask if keep is None else mask & keep.to(mask.device)
