"""SmoothQuant (Xiao et al., 2022, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models") as a pure function, plus the choice of where to fold.

Section numbers refer to the paper. Activation outliers live in a few fixed input channels
(§3), which per-tensor activation scales cannot absorb. SmoothQuant divides each input
channel ``j`` by ``s_j`` and multiplies the matching weight column by ``s_j``
(``Y = (X diag(s)^-1)(diag(s) W)``), moving quantization difficulty from activations to
weights with migration strength ``alpha`` (§4). ``diag(s)^-1`` is folded into the preceding
normalization's weight (and bias), so the float model computes the same function.

Folding reuses AWQ's :func:`optc.compress.awq.apply_scale` and its per-architecture mappings
(:func:`optc.compress.awq.resolve_mappings`): the operation is the same, only ``s`` differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from optc.model.anatomy import is_linear
from optc.compress.awq import Mapping, apply_scale, resolve_mappings
from optc.errors import OptcError


def smoothquant_scale(
    act_absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float
) -> torch.Tensor:
    """Per-input-channel smoothing factor ``s`` [K] (§4, Eq. 4).

    ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``, the weight maximum taken over the rows of
    every Linear reading ``X`` (``weights`` are ``[N_i, K]``). Both maxima are floored at 1e-5
    as in the authors' code, so dead channels keep a finite, positive factor.
    """
    if not 0 <= alpha <= 1:
        raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    a = act_absmax.detach().float().flatten()
    w_max = torch.stack([w.detach().float().abs().amax(dim=0).to(a.device) for w in weights]).amax(dim=0)
    if w_max.numel() != a.numel():
        raise ValueError(f"weights have {w_max.numel()} input channels, activations {a.numel()}")
    s = a.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


Scope = Literal["norms", "all"]


def smoothing_mappings(layer: nn.Module, layer_name: str, scope: Scope = "norms") -> list[Mapping]:
    """Where a decoder layer's smoothing factors fold: ``norms`` gives the paper's choice
    (the norms before q/k/v and before the MLP's first Linears); ``all`` adds the
    Linear -> Linear pairs AWQ also uses (``v -> o`` without GQA, ``up -> down``).

    Raises naming the layer when no normalization feeds its Linears directly (e.g. a
    post-LN layer, where the norm follows the projections), since then nothing can absorb
    ``1/s`` and smoothing would change the model.
    """
    try:
        mappings = resolve_mappings(layer)
    except OptcError as exc:
        raise OptcError(f"SmoothQuant cannot smooth {layer_name}: {exc}") from None
    norms = [m for m in mappings if not is_linear(m.prev)]
    if not norms:
        raise OptcError(
            f"SmoothQuant cannot smooth {layer_name} ({type(layer).__name__}): no normalization "
            "layer feeds its Linears directly (post-norm layout), so the scales cannot be folded"
        )
    return mappings if scope == "all" else norms


def fold_smoothing(layer_name: str, mapping: Mapping, s: torch.Tensor) -> None:
    """Apply ``s``: the preceding module's outputs divided by it, the Linears' columns
    multiplied by it."""
    try:
        apply_scale(mapping.prev, mapping.linears, s)
    except OptcError:
        raise OptcError(
            f"SmoothQuant cannot fold scales into {layer_name}.{mapping.prev_name} "
            f"({type(mapping.prev).__name__}): its output is not proportional to its weight"
        ) from None
