"""Bit allocation under a budget: which scheme each Linear gets.

Each Linear ``l`` takes one candidate scheme ``s``, which stores it in ``size[l, s]`` bits and adds
an estimated loss ``err[l, s]``. The allocation minimises ``sum_l err[l, s_l]`` subject to
``sum_l size[l, s_l] <= budget``: a multiple-choice knapsack, solved exactly by dynamic
programming over the Linears (Kellerer, Pferschy and Pisinger, "Knapsack Problems", 2004,
section 11.5). The loss of a Linear is the second-order estimate of the output error its
rounding adds, ``||dW X||^2 = tr(dW H dW^T)`` with ``H = X X^T`` (the quantity GPTQ minimises:
Frantar et al. 2022, eq. (1)), optionally weighted per output channel by the mean squared
gradient of the model's loss at that output (the diagonal Fisher of Hessian-aware allocation,
HAWQ-V2: Dong et al. 2020, section 3).
"""

from __future__ import annotations

import math
from functools import reduce

import torch

# Budget cells of the dynamic programme: above this the sizes are rounded up to coarser units, so
# the allocation stays under the budget; each of L sizes then grows by less than a unit, which
# leaves at most L / MAX_CELLS of the spare budget unused (0.3% for 210 Linears).
MAX_CELLS = 1 << 16


def output_error(dW: torch.Tensor, H: torch.Tensor, gamma: torch.Tensor | None = None) -> float:
    """``sum_i gamma_i (dW H dW^T)_ii`` for a weight error ``dW`` ``[N, K]`` and input second
    moment ``H`` ``[K, K]`` (``gamma``: per-output weights ``[N]``; none: all ones)."""
    dW = dW.to(H.dtype)
    rows = ((dW @ H) * dW).sum(dim=1)
    if gamma is not None:
        rows = rows * gamma.to(rows.dtype)
    return float(rows.sum())


def allocate(err: torch.Tensor, size: torch.Tensor, budget: int) -> torch.Tensor:
    """The choice ``[L]`` (a column of ``err`` / ``size`` per Linear) of least summed ``err`` with
    summed ``size`` at most ``budget``.

    ``err`` ``[L, S]`` float (``inf``: not allowed), ``size`` ``[L, S]`` integer bits. Exact when
    the sizes, less each Linear's smallest, have a common divisor that leaves at most
    ``MAX_CELLS`` cells of budget; otherwise each is rounded up to a coarser unit. Raises
    ValueError when even the smallest sizes exceed the budget.
    """
    err = err.to(torch.float64)
    size = size.to(torch.int64)
    L, S = err.shape
    allowed = torch.isfinite(err)
    if not bool(allowed.any(dim=1).all()):
        raise ValueError("a Linear has no allowed candidate")
    big = torch.iinfo(torch.int64).max // (4 * max(1, L))
    masked = torch.where(allowed, size, torch.full_like(size, big))
    base = masked.min(dim=1).values
    spare = budget - int(base.sum())
    if spare < 0:
        raise ValueError(f"the smallest candidates take {int(base.sum())} bits, more than the budget's {budget}")
    extra = torch.where(allowed, size - base[:, None], torch.zeros_like(size))
    unit = reduce(math.gcd, extra.reshape(-1).tolist(), 0) or 1
    if spare // unit > MAX_CELLS:
        unit = math.ceil(spare / MAX_CELLS)
    cells = spare // unit
    steps = torch.where(allowed, -(-extra // unit), torch.full_like(extra, cells + 1))  # ceil
    # best[c]: least error of the Linears so far with at most c cells of extra size.
    best = torch.zeros(cells + 1, dtype=torch.float64)
    choice = torch.empty(L, cells + 1, dtype=torch.uint8 if S < 256 else torch.int16)
    inf = torch.tensor(math.inf, dtype=torch.float64)
    for l in range(L):
        options = torch.full((S, cells + 1), math.inf, dtype=torch.float64)
        for s in range(S):
            k = int(steps[l, s])
            if k <= cells and allowed[l, s]:
                options[s, k:] = best[: cells + 1 - k] + err[l, s]
        best, pick = options.min(dim=0)
        choice[l] = pick.to(choice.dtype)
        best = torch.where(torch.isfinite(best), best, inf)
    out = torch.empty(L, dtype=torch.int64)
    c = int(torch.argmin(best))
    for l in range(L - 1, -1, -1):
        s = int(choice[l, c])
        out[l] = s
        c -= int(steps[l, s])
    return out
