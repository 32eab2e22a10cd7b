"""Distributed calibration on torch.distributed: calibration batches split across processes.

``torchrun`` starts one process per rank and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``. Every rank loads the model and tokenizes the same
calibration text; the sequential engine then keeps only this rank's contiguous block of the
calibration batches (:func:`shard`: the very batches one process would form, so every
batch's forward is the same computation), and after each collect it calls :func:`reduce` on
every accumulator, so all ranks hold the statistics of all samples. Every rank solves the
layer on those identical statistics, rank 0's solved layer is broadcast
(:func:`broadcast_module`) so the activations fed to the next layer agree everywhere, and
only rank 0 evaluates and writes.

The accumulators themselves hold no distributed code: each kind has one reduction here
(:data:`REDUCERS`), chosen for what it holds (sums with their counts, minima, maxima,
gathered rows, replayed per-batch values).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from optc.calibrate.hessian import HessianAccumulator
from optc.calibrate.observers import (
    ActivationStats,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
)
from optc.calibrate.stats import FeatureNormAccumulator, GramAccumulator, InputSampler
from optc.errors import OptcError

log = logging.getLogger(__name__)

# Rank 0 evaluates the baseline and writes the checkpoint while the other ranks wait in a
# collective: torch's 30-minute default would abort a long evaluation of a large model.
TIMEOUT = timedelta(hours=4)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise OptcError(f"environment variable {name}={os.environ[name]!r} is not an integer") from None


def active() -> bool:
    """True inside a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else _env_int("RANK", 0)


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _env_int("WORLD_SIZE", 1)


def is_main_process() -> bool:
    """Rank 0 (or no distributed launch at all): the process that evaluates, writes, prints."""
    return rank() == 0


@contextmanager
def process_group(device: str = "cpu") -> Iterator[None]:
    """Join the ranks a launcher (torchrun) started, for the duration of the block.

    gloo on CPUs, NCCL with ``device == "cuda"`` (each rank on GPU ``LOCAL_RANK``). Nothing
    happens for a single process or when a group is already initialized (a caller's own).
    """
    if world_size() <= 1 or (dist.is_available() and dist.is_initialized()):
        yield
        return
    if not dist.is_available():
        raise OptcError("this torch build has no torch.distributed: run optc as one process")
    backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
    try:
        dist.init_process_group(backend, timeout=TIMEOUT)
    except (ValueError, RuntimeError) as exc:  # missing MASTER_ADDR, unreachable rendezvous
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise OptcError(f"cannot join the {world_size()} distributed processes ({backend}): {first}") from None
    log.info("rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend)
    try:
        yield
        # Leave together: a rank that ended early and joined a new group (a second run in the
        # same process) must not reach a store that another rank is about to tear down.
        dist.barrier()
    finally:
        dist.destroy_process_group()


FOLD = 8  # see fold_size


def fold_size(n_batches: int) -> int:
    """How many consecutive calibration batches an accumulator may sum in float32 before it
    adds the sum to its exact float64 total (see :class:`HessianAccumulator`): ``FOLD`` from
    ``FOLD * FOLD`` batches on, else 1. It depends on the batch count alone, and :func:`shard`
    starts every rank's share at a multiple of it, so one process and up to ``FOLD`` ranks
    sum the very same groups of batches."""
    return FOLD if n_batches >= FOLD * FOLD else 1


def share(n_batches: int, world: int, rank: int, fold: int) -> tuple[int, int]:
    """Batches ``[first, stop)`` of ``rank``: a contiguous run of whole groups of ``fold``
    batches, the first ranks one group more when the groups do not divide."""
    groups = math.ceil(n_batches / fold)
    per, extra = divmod(groups, world)
    first = rank * per + min(rank, extra)
    return min(n_batches, first * fold), min(n_batches, (first + per + (rank < extra)) * fold)


def shard(ids: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, int, int, int]:
    """This rank's block of the calibration samples: ``(ids, first token row, batch size,
    fold)`` (``fold``: :func:`fold_size`, the grouping accumulators may use).

    Samples are cut into the batches a single process would use and each rank takes a
    contiguous run of whole groups of ``fold`` batches (:func:`share`), so rank order is
    sample order. With fewer batches than ranks the batch size is lowered so every rank has
    at least one batch (and the statistics may then differ from one process's in the last
    bits, as they do when there are fewer groups than ranks and batches are shared one by one).
    """
    n, seqlen = ids.shape
    fold = fold_size(math.ceil(n / batch_size))
    if not active():
        return ids, 0, batch_size, fold
    w, r = dist.get_world_size(), dist.get_rank()
    if n < w:
        raise OptcError(f"distributed calibration over {w} processes needs at least {w} samples, got {n}")
    if math.ceil(n / batch_size) < w:
        batch_size = n // w
        log.info("calibration batch size lowered to %d so each of %d ranks has a batch", batch_size, w)
    n_batches = math.ceil(n / batch_size)
    if math.ceil(n_batches / fold) < w:
        log.info("%d ranks for %d groups of %d batches: batches shared one by one", w,
                 math.ceil(n_batches / fold), fold)
        fold = 1
    first, stop = share(n_batches, w, r, fold)
    return ids[first * batch_size : min(n, stop * batch_size)], first * batch_size * seqlen, batch_size, fold


# --------------------------------------------------------------------------------------------
# Collectives on the backend's device (NCCL reduces GPU tensors only)


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    buf = t.detach().to(_comm_device(), copy=True)
    dist.all_reduce(buf, op=op)
    return buf.to(t.device)


def _sum(t: torch.Tensor) -> torch.Tensor:
    return _all_reduce(t, dist.ReduceOp.SUM)


def _count(n: int) -> int:
    return int(_sum(torch.tensor([n], dtype=torch.int64)).item())


def _all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's rows (first dimension may differ), concatenated in rank order."""
    dev = _comm_device()
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    counts = [int(s.item()) for s in sizes]
    padded = torch.zeros((max(counts), *t.shape[1:]), dtype=t.dtype, device=dev)
    padded[: t.shape[0]] = t.to(dev)
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts)]).to(t.device)


# --------------------------------------------------------------------------------------------
# One reduction per accumulator kind


def _reduce_hessian(acc: HessianAccumulator) -> None:
    # A plain (float64, exact) sum over tokens, whatever each rank's share: the one-process H.
    state = acc.state_dict()
    s = state["S"]
    assert isinstance(s, torch.Tensor)
    acc.load_state_dict({"S": _sum(s), "nsamples": _count(int(state["nsamples"]))})


def _reduce_feature_norm(acc: FeatureNormAccumulator) -> None:
    acc.sq_sum = _sum(acc.sq_sum)
    acc.count = _count(acc.count)


def _reduce_gram(acc: GramAccumulator) -> None:
    _reduce_hessian(acc.hessian)
    acc.abs_sum = _sum(acc.abs_sum)
    acc.count = _count(acc.count)


def _reduce_sampler(acc: InputSampler) -> None:
    acc.abs_sum = _sum(acc.abs_sum)
    acc.count = _count(acc.count)
    # Rows were drawn per batch from the batch's global position (see InputSampler), so the
    # gathered sample in rank order is the single-process sample.
    if acc.rows:
        acc.rows = [_all_gather_rows(torch.cat(acc.rows))]
    else:
        acc.rows = [_all_gather_rows(torch.zeros(0, acc.in_features))]


def _reduce_minmax(acc: MinMaxObserver) -> None:
    if acc.min is None or acc.max is None:
        raise OptcError("a min/max observer saw no data on this rank")
    acc.min = _all_reduce(acc.min, dist.ReduceOp.MIN)
    acc.max = _all_reduce(acc.max, dist.ReduceOp.MAX)


def _reduce_moving(acc: MovingAverageMinMaxObserver) -> None:
    # An exponential moving average depends on batch order: gather every batch's range in
    # sample order and fold them again.
    local = torch.tensor(acc.history, dtype=torch.float64).reshape(-1, 2)
    acc.replay([(float(lo), float(hi)) for lo, hi in _all_gather_rows(local)])


def _reduce_histogram(acc: HistogramObserver) -> None:
    # Widths are powers of two chosen from the largest value seen, so every rank can merge
    # its bins up to the widest rank's width exactly; then the counts add.
    width = float(_all_reduce(torch.tensor([acc.width or 0.0], dtype=torch.float64), dist.ReduceOp.MAX))
    if width > 0:
        acc.rebin(width)
    n = int(_all_reduce(torch.tensor([acc.counts.numel()], dtype=torch.int64), dist.ReduceOp.MAX))
    counts = torch.cat([acc.counts, acc.counts.new_zeros(n - acc.counts.numel())])
    acc.counts = _sum(counts)


def _reduce_activation_stats(acc: ActivationStats) -> None:
    for part in (acc.channel, acc.moving, acc.histogram, acc.sampler, *acc.extra):
        reduce(part)


REDUCERS: dict[type, Callable[[Any], None]] = {
    HessianAccumulator: _reduce_hessian,
    FeatureNormAccumulator: _reduce_feature_norm,
    InputSampler: _reduce_sampler,
    GramAccumulator: _reduce_gram,
    MinMaxObserver: _reduce_minmax,
    MovingAverageMinMaxObserver: _reduce_moving,
    HistogramObserver: _reduce_histogram,
    ActivationStats: _reduce_activation_stats,
}


def reduce(acc: Any) -> None:
    """Combine ``acc`` in place with the same accumulator on every other rank."""
    fn = REDUCERS.get(type(acc))
    if fn is None:
        raise OptcError(f"{type(acc).__name__} has no distributed reduction: run this stage as one process")
    fn(acc)


def reduce_all(accs: Mapping[str, Any]) -> None:
    """:func:`reduce` every accumulator, in name order (the same collectives on every rank)."""
    if not active():
        return
    for name in sorted(accs):
        reduce(accs[name])


@torch.no_grad()
def broadcast_module(module: nn.Module) -> None:
    """Overwrite every parameter and buffer of ``module`` with rank 0's."""
    if not active():
        return
    dev = _comm_device()
    for t in (*module.parameters(), *module.buffers()):
        if t.device == dev:
            dist.broadcast(t.data, src=0)
        else:
            buf = t.data.to(dev)
            dist.broadcast(buf, src=0)
            t.data.copy_(buf)
