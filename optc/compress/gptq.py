"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers") as a pure function of a weight and its input Hessian.

Section numbers below refer to the paper. The column sweep, lazy batch updates and
Cholesky reformulation follow the authors' reference code; group handling (act-order,
static groups) follows AutoGPTQ so that its checkpoints and ours mean the same thing.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from optc.compress.quant import (
    QuantParams,
    QuantScheme,
    choose_qparams,
    default_g_idx,
    quantize_column,
)
from optc.errors import OptcError

log = logging.getLogger(__name__)

_DAMP_RETRIES = 4


@dataclass
class GPTQResult:
    weight: torch.Tensor  # W_hat [N, K], dequantized, in W's dtype
    params: QuantParams  # scale/zero [N, G], g_idx [K] over original column indices
    loss: float  # sum of the OBS error terms (the reference's ``Losses.sum()``)
    seconds: float


def _inverse_hessian_factor(H: torch.Tensor, dampening: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + lambda I)^{-1}`` (§4 "Step 3").

    Retries with stronger dampening because calibration Hessians of rarely-active layers
    are often only semi-definite in float32.
    """
    mean_diag = torch.diag(H).mean()
    k = H.shape[0]
    diag = torch.arange(k, device=H.device)
    damp = dampening
    for attempt in range(_DAMP_RETRIES + 1):
        Hd = H.clone()
        Hd[diag, diag] += damp * mean_diag
        L, info = torch.linalg.cholesky_ex(Hd)
        if info == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if info == 0 and torch.isfinite(U).all():
                return U
        if attempt < _DAMP_RETRIES:
            log.warning(
                "GPTQ %s: Hessian not positive definite with dampening %g; retrying with %g",
                name or "<layer>", damp, damp * 10,
            )
            damp *= 10
    raise OptcError(
        f"GPTQ failed for layer {name or '<unnamed>'}: the Hessian is not positive definite "
        f"even with dampening {damp:g} (check the calibration data reaches this layer)"
    )


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    scheme: QuantScheme,
    *,
    block_size: int = 128,
    dampening: float = 0.01,
    actorder: bool = True,
    static_groups: bool = False,
    observer: str = "mse",
    name: str = "",
) -> GPTQResult:
    """Quantize ``W`` ([N, K]) onto ``scheme``, minimising ``||W X - W_hat X||^2``.

    ``H`` is the input Hessian ``2 X X^T / n`` (see ``HessianAccumulator``). ``observer``
    (``mse`` or ``minmax``) picks each grid; ``name`` labels logs and errors.
    """
    t0 = time.perf_counter()
    n, k = W.shape
    if H.shape != (k, k):
        raise ValueError(
            f"GPTQ {name}: Hessian {tuple(H.shape)} does not match weight {tuple(W.shape)}"
        )
    dev = W.device
    Wf = W.detach().to(torch.float32).clone()
    H = H.detach().to(dev, torch.float32).clone()
    g = scheme.group_size
    grouped = g is not None

    # Inputs that never fired carry no information; zeroing their weights is free in the
    # output and keeps H invertible.
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    Wf[:, dead] = 0

    num_groups = scheme.num_groups(k)
    scale = torch.ones(n, num_groups, device=dev)
    zero = torch.zeros(n, num_groups, dtype=torch.int32, device=dev)
    if not grouped or static_groups:
        # Per-channel, or static groups: the grid is fixed before any error feedback, so
        # act-order only changes the processing order and g_idx stays contiguous.
        p0 = choose_qparams(Wf, scheme, observer)
        scale, zero = p0.scale.float(), p0.zero

    # Act-order (the authors' later heuristic, not in the paper, where §4 Step 1 finds order
    # matters little at scale): quantize the columns with the largest input energy first,
    # while the most unquantized columns remain to absorb their error; helps with outliers.
    perm = torch.argsort(torch.diag(H), descending=True) if actorder else None
    if perm is not None:
        Wf = Wf[:, perm]
        H = H[perm][:, perm]

    # Group of each processing position: fixed groups follow the original column, dynamic
    # ones are formed along the processing order (AutoGPTQ's act-order layout).
    if not grouped:
        col_group = [0] * k
    elif static_groups and perm is not None:
        col_group = (perm // g).tolist()
    else:
        col_group = [c // g for c in range(k)]

    # Step 3 (Cholesky reformulation): the rows of H^{-1} needed by the sweep are the rows
    # of the upper Cholesky factor of H^{-1}, which is numerically far more robust than
    # repeatedly applying the OBS rank-1 downdate.
    Hinv = _inverse_hessian_factor(H, dampening, name)

    Q = torch.zeros_like(Wf)
    loss_acc = torch.zeros((), device=dev)
    zf = zero.float()
    s_col = z_col = None
    cur_group = -1
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        count = i2 - i1
        # Step 2 (lazy batch updates): sweep B columns on a local copy, deferring the
        # update of the remaining K - i2 columns to one matmul per block.
        W1 = Wf[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(count):
            col = i1 + i
            gi = col_group[col]
            if grouped and not static_groups and col % g == 0:
                # The group's grid is chosen from the error-updated weights as they stand
                # now: in-block columns from W1, later ones from Wf plus this block's
                # pending update (the reference reads stale in-block values here).
                end = min(col + g, k)
                part = [W1[:, i : min(count, i + g)]]
                if end > i2:
                    part.append(Wf[:, i2:end] - Err1 @ Hinv[i1:i2, i2:end])
                p = choose_qparams(torch.cat(part, dim=1), scheme, observer)
                scale[:, gi], zero[:, gi] = p.scale[:, 0], p.zero[:, 0]
                zf[:, gi] = zero[:, gi].float()
            if gi != cur_group:
                s_col, z_col, cur_group = scale[:, gi], zf[:, gi], gi

            # Step 1 (arbitrary order, OBS update): quantize column i and spread its
            # error over the not-yet-quantized columns, weighted by the H^{-1} row.
            w = W1[:, i]
            d = Hinv1[i, i]
            q = quantize_column(w, s_col, z_col, scheme)
            Q1[:, i] = q
            err = (w - q) / d
            W1[:, i + 1 :] -= err.unsqueeze(1) * Hinv1[i, i + 1 :].unsqueeze(0)
            Err1[:, i] = err
        Q[:, i1:i2] = Q1
        # The OBS error (w - q)^2 / (2 [H_F^{-1}]_qq), with [H_F^{-1}]_qq = d^2 (reference Losses).
        loss_acc += Err1.pow(2).sum() / 2
        Wf[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    if perm is None:
        g_idx = default_g_idx(k, scheme).to(dev)
    else:
        invperm = torch.argsort(perm)
        Q = Q[:, invperm]
        if grouped and not static_groups:
            # Original column j was processed at position invperm[j], in that position's group.
            g_idx = (invperm // g).to(torch.int32)
        else:
            g_idx = default_g_idx(k, scheme).to(dev)

    params = QuantParams(scheme, scale, zero, g_idx)
    seconds = time.perf_counter() - t0
    loss = float(loss_acc)
    if not math.isfinite(loss):
        raise OptcError(
            f"GPTQ failed for layer {name or '<unnamed>'}: non-finite error "
            "(NaN or Inf in the weights or the Hessian)"
        )
    log.debug("GPTQ %s [%dx%d] %s loss %.4g in %.2fs", name, n, k, scheme.label(), loss, seconds)
    return GPTQResult(weight=Q.to(W.dtype), params=params, loss=loss, seconds=seconds)
