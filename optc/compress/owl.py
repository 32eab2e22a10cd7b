"""OWL (Yin et al., 2024, "Outlier Weighed Layerwise Sparsity (OWL): A Missing Secret Sauce
for Pruning LLMs to High Sparsity") as pure functions: per-layer sparsity from outliers.

Section numbers refer to the paper. Layers holding more outlier features lose less: their
sparsity is lowered in proportion to their share of outliers, within ``[S - lambda, S + lambda]``
and with the same mean ``S``, so the overall sparsity is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def outlier_ratio(scores: Sequence[torch.Tensor], threshold: float = 5.0) -> float:
    """Layerwise Outlier Distribution ``D_l`` (§3.1): the fraction of a decoder layer's
    Wanda scores ``|W_ij| ||X_j||`` above ``threshold`` (``M``) times their mean.

    ``scores`` holds one tensor per Linear of the layer; all of them form one population,
    as in the reference code.
    """
    flat = torch.cat([s.detach().flatten().float() for s in scores])
    if flat.numel() == 0:
        return 0.0
    return float((flat > threshold * flat.mean()).float().mean())


def owl_sparsities(ratios: Sequence[float], sparsity: float, lam: float = 0.08) -> list[float]:
    """Per-layer sparsity ``S_l`` from outlier ratios ``D_l`` (§3.2).

    ``1 - S_l`` is ``D_l`` rescaled linearly onto ``[0, 2 lambda]`` and shifted to mean
    ``1 - sparsity`` (the reference code's normalisation), so ``S_l`` lies in
    ``[sparsity - lambda, sparsity + lambda]`` and averages to ``sparsity``. Equal ratios
    (or a single layer) give the uniform allocation. Results are clamped to ``[0, 1)``.
    """
    if not ratios:
        return []
    d = torch.tensor(list(ratios), dtype=torch.float64)
    spread = float(d.max() - d.min())
    if spread <= 0:
        return [sparsity] * len(ratios)
    density = (d - d.min()) / spread * (2 * lam)
    density = density - density.mean() + (1 - sparsity)
    return [min(max(1 - float(x), 0.0), 0.999) for x in density]
