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
from typing import Literal
from dataclasses import dataclass

import torch

from optc.compress.quant import (
    QuantParams,
    QuantScheme,
    block_reduce,
    choose_qparams,
    default_g_idx,
    quantize,
    quantize_column,
    round_scales,
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
    row_loss: torch.Tensor | None = None  # [N] the same terms per output row (rows are independent)


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
        del Hd  # K x K matrices: at most two alive at once (K = 5632 is 127 MB each)
        if info == 0:
            Hinv = torch.cholesky_inverse(L)
            del L
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            del Hinv
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


GroupMode = Literal["static", "lazy", "permuted"]


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    scheme: QuantScheme,
    *,
    block_size: int = 128,
    dampening: float = 0.01,
    actorder: bool = True,
    groups: GroupMode = "lazy",
    observer: str = "mse",
    name: str = "",
    refit: bool = True,
    mask: torch.Tensor | None = None,
    weighted_grid: bool = True,
) -> GPTQResult:
    """Quantize ``W`` ([N, K]) onto ``scheme``, minimising ``||W X - W_hat X||^2``.

    ``H`` is the input Hessian ``2 X X^T / n`` (see ``HessianAccumulator``). ``observer``
    (``mse`` or ``minmax``) picks each grid; ``name`` labels logs and errors. ``refit``
    re-solves the scales for the final integer codes (:func:`refit_scales`).
    ``weighted_grid`` weights each column's error by ``diag(H)`` in the MSE grid search.

    ``groups`` (with act-order): ``static`` fixes every grid from ``W`` before the sweep;
    ``lazy`` keeps groups as contiguous runs of columns but chooses each grid from the
    error-updated weights when the sweep first reaches the group (any runtime can load it);
    ``permuted`` forms groups along the processing order (AutoGPTQ ``desc_act``; needs a
    ``g_idx`` permutation on disk).

    ``mask`` ([N, K] bool, ``True`` = kept) quantizes only the kept weights of a pruned
    layer: pruned ones are forced to exactly 0 during the sweep (0 is on every grid) and
    their error is propagated like any rounding error, as SparseGPT's joint mode does.
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
    # The refit needs H as it is now; it is recovered exactly from the permuted copy below
    # (a permutation loses nothing), so only one K x K copy is kept through the sweep.
    # Column importance for the grid search: the input energy diag(H), in processing order
    # once permuted below (the activation-aware objective of llama.cpp's imatrix).
    imp = torch.diag(H).clone() if weighted_grid else None
    keep = None
    if mask is not None:
        if mask.shape != W.shape:
            raise ValueError(f"GPTQ {name}: mask {tuple(mask.shape)} does not match weight {tuple(W.shape)}")
        keep = mask.to(dev, torch.bool)
        Wf = Wf * keep

    num_groups = scheme.num_groups(k)
    scale = torch.ones(n, num_groups, device=dev)
    zero = torch.zeros(n, num_groups, dtype=torch.int32, device=dev)
    if groups not in ("static", "lazy", "permuted"):
        raise ValueError(f"unknown GPTQ group mode {groups!r}")
    # A k-quant grid's group scales share one float16 per 256 columns: it is chosen whole, up front.
    static_groups = groups == "static" or scheme.kquant_kind is not None
    permuted = groups == "permuted" and scheme.kquant_kind is None
    if not grouped or static_groups:
        # Per-channel, or static groups: the grid is fixed before any error feedback, so
        # act-order only changes the processing order and g_idx stays contiguous.
        p0 = choose_qparams(Wf, scheme, observer, importance=imp)
        scale, zero = p0.scale.float(), p0.zero

    # Act-order (the authors' later heuristic, not in the paper, where §4 Step 1 finds order
    # matters little at scale): quantize the columns with the largest input energy first,
    # while the most unquantized columns remain to absorb their error; helps with outliers.
    perm = torch.argsort(torch.diag(H), descending=True) if actorder else None
    if perm is not None:
        Wf = Wf[:, perm]
        H = H.index_select(0, perm).index_select(1, perm)  # 10x faster than H[p[:, None], p]
        if imp is not None:
            imp = imp[perm]
        if keep is not None:
            keep = keep[:, perm]

    # Group of each processing position: fixed groups follow the original column, dynamic
    # ones are formed along the processing order (AutoGPTQ's act-order layout).
    if not grouped:
        col_group = [0] * k
    elif not permuted and perm is not None:
        col_group = (perm // g).tolist()
    else:
        col_group = [c // g for c in range(k)]

    # Step 3 (Cholesky reformulation): the rows of H^{-1} needed by the sweep are the rows
    # of the upper Cholesky factor of H^{-1}, which is numerically far more robust than
    # repeatedly applying the OBS rank-1 downdate.
    Hinv = _inverse_hessian_factor(H, dampening, name)
    if not refit:
        del H

    # Processing positions of each group's columns (for choosing grids on first touch).
    col_group_t = torch.tensor(col_group, device=dev)
    members = {gi: (col_group_t == gi).nonzero().squeeze(1) for gi in set(col_group)} if grouped else {}
    chosen: set[int] = set()
    # The sweep works on W^T ([K, N], one contiguous row per input column): each step's
    # column ops then run on contiguous vectors in place, 2-3x faster on CPU than strided
    # columns of W (the same arithmetic per column).
    WT = Wf.T.contiguous()
    del Wf
    QT = torch.empty_like(WT)
    dropT = None if keep is None else ~keep.T.contiguous()
    row_loss = torch.zeros(n, device=dev)
    # Grids by group as contiguous rows ([G, N]), so switching groups (every few columns under
    # act-order) copies nothing; written back to scale/zero after the sweep.
    scaleT, zeroT = scale.T.contiguous(), zero.T.float().contiguous()
    s_col = z_col = None
    cur_group = -1
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        count = i2 - i1
        # Step 2 (lazy batch updates): sweep B columns in place, deferring the update of the
        # remaining K - i2 columns to one matmul per block.
        W1 = WT[i1:i2]
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        # Row views made once per block (per-column indexing was a tenth of a solve).
        w_rows, q_rows, err_rows = W1.unbind(0), QT[i1:i2].unbind(0), Err1.unbind(0)
        d_rows, h_tails = Hinv1.diagonal().tolist(), [Hinv1[i, i + 1:] for i in range(count)]
        for i in range(count):
            col = i1 + i
            gi = col_group[col]
            if grouped and not static_groups and gi not in chosen:
                # The group's grid is chosen when the sweep first reaches one of its columns,
                # from the error-updated weights as they stand now: in-block columns from W1,
                # later ones from W plus this block's pending update (the reference reads
                # stale in-block values here).
                pos = members[gi]
                inside, later = pos[(pos >= i1) & (pos < i2)], pos[pos >= i2]
                part = [W1[inside - i1]]
                if later.numel():
                    part.append(WT[later] - Hinv[i1:i2, later].T @ Err1)
                if dropT is not None:
                    # Pruned weights will be 0 whatever they drifted to; the grid is for the rest.
                    part = [p_.masked_fill(dropT[idx], 0.0) for p_, idx in zip(part, (inside, later))]
                p = choose_qparams(
                    torch.cat(part).T, scheme, observer,
                    importance=None if imp is None else imp[torch.cat([inside, later])],
                )
                scaleT[gi], zeroT[gi] = p.scale[:, 0], p.zero[:, 0]
                chosen.add(gi)
            if gi != cur_group:
                s_col, z_col, cur_group = scaleT[gi], None if scheme.symmetric else zeroT[gi], gi

            # Step 1 (arbitrary order, OBS update): quantize column i and spread its
            # error over the not-yet-quantized columns, weighted by the H^{-1} row.
            w, q, err = w_rows[i], q_rows[i], err_rows[i]
            quantize_column(w, s_col, z_col, scheme, out=q)
            if dropT is not None:
                q.masked_fill_(dropT[col], 0.0)
            torch.sub(w, q, out=err).div_(d_rows[i])
            W1[i + 1 :].addr_(h_tails[i], err, alpha=-1)
        # The OBS error (w - q)^2 / (2 [H_F^{-1}]_qq), with [H_F^{-1}]_qq = d^2 (reference Losses).
        row_loss += Err1.pow(2).sum(dim=0) / 2
        WT[i2:].addmm_(Hinv[i1:i2, i2:].T, Err1, alpha=-1)
    del Hinv, Hinv1, WT, W1  # the refit needs none of them (Hinv1 is a view of Hinv)

    if perm is None:
        g_idx = default_g_idx(k, scheme).to(dev)
    else:
        invperm = torch.argsort(perm)
        QT = QT[invperm]
        if grouped and permuted:
            # Original column j was processed at position invperm[j], in that position's group.
            g_idx = (invperm // g).to(torch.int32)
        else:
            g_idx = default_g_idx(k, scheme).to(dev)

    Q = QT.T.contiguous()
    del QT
    scale = scaleT.T.contiguous()
    zero = zeroT.T.contiguous() if scheme.offset_grid else zeroT.T.to(torch.int32).contiguous()
    params = QuantParams(scheme, scale, zero, g_idx)
    if refit and scheme.kquant_kind is None:  # free scales only (a k-quant's are codes of one float16)
        H_orig = H if perm is None else H.index_select(0, invperm).index_select(1, invperm)
        del H
        Q, params = refit_scales(W.detach().float(), H_orig, Q, params)
    seconds = time.perf_counter() - t0
    loss = float(row_loss.sum())
    if not math.isfinite(loss):
        raise OptcError(
            f"GPTQ failed for layer {name or '<unnamed>'}: non-finite error "
            "(NaN or Inf in the weights or the Hessian)"
        )
    log.debug("GPTQ %s [%dx%d] %s loss %.4g in %.2fs", name, n, k, scheme.label(), loss, seconds)
    return GPTQResult(weight=Q.to(W.dtype), params=params, loss=loss, seconds=seconds, row_loss=row_loss)


def refit_scales(
    W: torch.Tensor, H: torch.Tensor, W_hat: torch.Tensor, p: QuantParams, ridge: float = 1e-4
) -> tuple[torch.Tensor, QuantParams]:
    """Least-squares scales for fixed integer codes: min_s (w - C s)^T H (w - C s) per row.

    GPTQ fixes each group's scale before it knows the codes the sweep will choose. With the
    codes ``c = q - z`` fixed, ``W_hat[r] = C_r s_r`` is linear in the row's group scales, so
    the output error ``||W X - W_hat X||^2 ~ (w - C s)^T H (w - C s)`` has a closed-form
    minimiser: ``(C^T H C) s = C^T H w``, a G x G system per row. A ridge towards the old
    scales keeps empty or degenerate groups where they were; a row keeps its old scales
    unless the new ones lower its error, so the result is never worse than the input.
    """
    n, k = W.shape
    groups = p.scale.shape[1]
    g_idx = p.g_idx.long()
    c = (quantize(W_hat, p).float() - p.zero.float()[:, g_idx])  # codes relative to zero
    # Sums over each group's columns as a product with the [K, G] one-hot group matrix (a
    # small matmul, several times faster than index_add_ here).
    E = torch.nn.functional.one_hot(g_idx, groups).to(c.dtype)
    A = torch.empty(n, groups, groups, dtype=torch.float32, device=W.device)
    for b in range(groups):
        cols = (g_idx == b).nonzero().squeeze(1)
        Yb = c[:, cols] @ H[cols, :]  # [N, K]: sum over j in group b of c_rj H_j.
        A[:, :, b] = Yb.mul_(c) @ E
    v = (W @ H).mul_(c) @ E
    # Rows sharing their scales (a block scheme's tiles): one system per block, the rows' sums.
    rows = p.scheme.block_rows
    A, v = block_reduce(A, rows), block_reduce(v, rows)
    lam = ridge * A.diagonal(dim1=1, dim2=2).mean(dim=1).clamp_min(1e-12)  # [N]
    eye = torch.eye(groups, device=W.device)
    old = p.scale.float()
    s = torch.linalg.solve(A + lam[:, None, None] * eye, (v + lam[:, None] * old).unsqueeze(-1))[..., 0]

    A64, v64 = A.double(), v.double()

    def row_error(scales: torch.Tensor) -> torch.Tensor:
        # (w - C s)^T H (w - C s) = w^T H w - 2 s^T v + s^T A s: the constant w^T H w drops out
        # of the comparison, so it costs O(N G^2) instead of two N x K x K products (float64:
        # the two terms nearly cancel).
        s64 = scales.double()
        return torch.einsum("ng,ngh,nh->n", s64, A64, s64) - 2 * (s64 * v64).sum(dim=1)

    # A float grid's scales are stored as E4M3 or powers of two: the refit is rounded to them
    # before it is compared, so a row keeps whichever stored scales err less.
    s = torch.where(s > 0, round_scales(s.abs(), p.scheme), s)
    valid = torch.isfinite(s).all(dim=1) & (s > 0).all(dim=1)
    s = torch.where(valid[:, None], s, old)
    better = row_error(s) < row_error(old)  # with shared scales, the block's error on each of its rows
    s = torch.where(better[:, None], s, old)
    new = QuantParams(p.scheme, s.to(p.scale.dtype), p.zero, p.g_idx)
    return (c * s[:, g_idx]).to(W_hat.dtype), new
