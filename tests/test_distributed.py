"""Distributed calibration: two gloo processes compute what one process computes.

Each test starts two real ranks (``torch.multiprocessing`` with the spawn method, the
environment torchrun would set) on this machine's CPU.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from optc.calibrate import distributed
from optc.calibrate.hessian import HessianAccumulator
from optc.calibrate.observers import ActivationStats, HistogramObserver, MinMaxObserver, MovingAverageMinMaxObserver
from optc.calibrate.stats import FeatureNormAccumulator, GramAccumulator, InputSampler
from optc.run.pipeline import run_recipe
from optc.recipe import parse_recipe

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, port: int, fn, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    fn(rank, *args)


def _spawn(fn, *args) -> None:
    """Run ``fn(rank, *args)`` on WORLD ranks; a failure on any rank fails the test."""
    mp.start_processes(_entry, args=(_free_port(), fn, args), nprocs=WORLD, start_method="spawn")


# --- every accumulator kind ------------------------------------------------------------------

K = 12


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 16, K, generator=g) * torch.linspace(0.5, 4, K) * (1 + i) for i in range(5)]


def _accumulators(tokens: int, first_row: int) -> dict:
    return {
        "hessian": HessianAccumulator(K),
        "norms": FeatureNormAccumulator(K),
        "sampler": InputSampler(K, tokens, max_tokens=40, seed=3, first_row=first_row),
        "gram": GramAccumulator(K),
        "minmax": MinMaxObserver(K),
        "moving": MovingAverageMinMaxObserver(0.3),
        "histogram": HistogramObserver(64),
        "stats": ActivationStats(K, tokens, bins=64, sample_tokens=40, seed=5, first_row=first_row,
                                 extra=(HessianAccumulator(K),)),
    }


def _reduce_worker(rank: int) -> None:
    batches = _batches()
    tokens = sum(b.shape[0] * b.shape[1] for b in batches)
    single = _accumulators(tokens, 0)
    for b in batches:
        for acc in single.values():
            acc.add(b)
    with distributed.process_group("cpu"):
        ids = torch.arange(10 * 16).view(10, 16)  # 10 samples, batches of 2: the same 5 batches
        local, first_row, batch_size, fold = distributed.shard(ids, 2)
        start = first_row // 16
        assert batch_size == 2 and fold == 1 and (rank, start, local.shape[0]) in ((0, 0, 6), (1, 6, 4))
        mine = _accumulators(tokens, first_row)
        for b in batches[start // 2 : (start + local.shape[0]) // 2]:
            for acc in mine.values():
                acc.add(b)
        distributed.reduce_all(mine)
    s, d = single, mine
    assert d["hessian"].nsamples == s["hessian"].nsamples == tokens
    assert torch.equal(d["hessian"].H, s["hessian"].H)  # exact float64 sums: order-free
    torch.testing.assert_close(d["norms"].sq_norm, s["norms"].sq_norm, rtol=1e-12, atol=0)
    assert torch.equal(d["sampler"].sample, s["sampler"].sample)  # the very same rows
    torch.testing.assert_close(d["sampler"].mean_abs, s["sampler"].mean_abs, rtol=1e-12, atol=0)
    assert torch.equal(d["gram"].gram, s["gram"].gram) and d["gram"].count == s["gram"].count == tokens
    torch.testing.assert_close(d["gram"].mean_abs, s["gram"].mean_abs, rtol=1e-12, atol=0)
    assert torch.equal(d["minmax"].min, s["minmax"].min) and torch.equal(d["minmax"].max, s["minmax"].max)
    assert (d["moving"].min, d["moving"].max) == (s["moving"].min, s["moving"].max)
    assert d["histogram"].width == s["histogram"].width
    assert torch.equal(d["histogram"].counts, s["histogram"].counts)
    a, b = d["stats"], s["stats"]
    assert torch.equal(a.histogram.counts, b.histogram.counts) and a.moving.max == b.moving.max
    assert torch.equal(a.sampler.sample, b.sampler.sample) and torch.equal(a.channel.max, b.channel.max)
    assert torch.equal(a.extra[0].H, b.extra[0].H)


def test_shares_are_whole_fold_groups_covering_every_batch() -> None:
    for n_batches in range(1, 160):
        fold = distributed.fold_size(n_batches)
        assert fold == (distributed.FOLD if n_batches >= 64 else 1)
        for world in range(1, distributed.FOLD + 1):
            if world > n_batches:
                continue
            shares = [distributed.share(n_batches, world, r, fold) for r in range(world)]
            assert shares[0][0] == 0 and shares[-1][1] == n_batches
            assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))  # contiguous, in rank order
            assert all(first % fold == 0 and stop > first for first, stop in shares)
            sizes = [stop - first for first, stop in shares]
            assert max(sizes) - min(sizes) < 2 * fold  # one group, and a short last one


def test_folded_hessian_is_exact_however_the_batches_are_shared() -> None:
    """Summing groups of 8 batches in float32 first: one accumulator over 72 batches equals two
    fed the two ranks' shares and merged, bit for bit (the exactness distributed runs rely on)."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 40, generator=g) * torch.linspace(0.1, 30, 40) for _ in range(72)]
    fold = distributed.fold_size(len(batches))
    single, per_batch = HessianAccumulator(40, fold=fold), HessianAccumulator(40)
    for b in batches:
        single.add(b)
        per_batch.add(b)
    ranks = []
    for r in range(3):
        first, stop = distributed.share(len(batches), 3, r, fold)
        acc = HessianAccumulator(40, fold=fold)
        for b in batches[first:stop]:
            acc.add(b)
        ranks.append(acc)
    ranks[0].merge(ranks[1])
    ranks[0].merge(ranks[2])
    assert single.nsamples == ranks[0].nsamples == 72 * 16
    assert torch.equal(single.H, ranks[0].H)
    scale = float(per_batch.H.abs().max())
    torch.testing.assert_close(single.H, per_batch.H, rtol=1e-5, atol=1e-6 * scale)  # the same matrix
    state = single.state_dict()  # with a partial group pending: folded before it is read
    single.add(batches[0])
    single.load_state_dict(state)
    assert torch.equal(single.H, ranks[0].H)


# --- whole recipes on a tiny checkpoint --------------------------------------------------------

CALIBRATION = {"dataset": "builtin", "samples": 8, "seqlen": 64, "batch_size": 2}
RECIPES = {
    "gptq": ({"type": "gptq", "scheme": {"bits": 4, "group_size": 32}}, "dense"),
    "awq": ({"type": "awq", "scheme": {"bits": 4, "group_size": 32}, "grid": 8}, "dense"),
    # Static activation scales from the order-dependent observers (KL histogram, moving average).
    "w8a8": ({"type": "w8a8", "method": "rtn", "activations": {"observer": "kl"},
              "activation_overrides": [{"pattern": "mlp", "activations": {"observer": "moving_minmax"}}]},
             "compressed-tensors"),
    "sparsegpt": ({"type": "sparsegpt", "sparsity": 0.5}, "dense"),
}


def _recipe(model: Path, name: str):
    stage, fmt = RECIPES[name]
    return parse_recipe({"version": 1, "model": str(model), "calibration": CALIBRATION, "stages": [stage],
                         "evaluation": None, "export": {"format": fmt}})


def _recipes_worker(rank: int, model: Path, out: Path, names: list[str], ports: list[int]) -> None:
    if "gptq" in names:  # the accumulator checks ride along, saving two process starts
        _reduce_worker(rank)
    for name, port in zip(names, ports):
        os.environ["MASTER_PORT"] = str(port)  # one rendezvous per run, as torchrun would start them
        report = run_recipe(_recipe(model, name), out / name)
        assert ("checkpoint" in report and report["checkpoint"] is not None) == (rank == 0)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("names", [["gptq"], pytest.param(["awq", "sparsegpt", "w8a8"], marks=pytest.mark.slow)])
def test_two_gloo_ranks_give_the_single_process_checkpoints(tiny_checkpoint: Path, tmp_path: Path,
                                                            names: list[str]) -> None:
    """GPTQ (and, slow, AWQ, SparseGPT, W8A8) on two ranks; with GPTQ also every accumulator
    kind reduced across the ranks against one process fed all batches (_reduce_worker)."""
    _spawn(_recipes_worker, tiny_checkpoint, tmp_path / "dist", names, [_free_port() for _ in names])
    # One thread, as each rank has (_entry): MKL's Cholesky factorisations, which GPTQ and
    # SparseGPT solve with, round differently with another thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in names:
            run_recipe(_recipe(tiny_checkpoint, name), tmp_path / "single" / name)
    finally:
        torch.set_num_threads(threads)
    for name in names:
        one, two = _tensors(tmp_path / "single" / name), _tensors(tmp_path / "dist" / name)
        assert one.keys() == two.keys(), name
        diff = total = 0.0
        for key, t in one.items():
            u = two[key]
            if name != "awq" or not t.is_floating_point():
                # The same Hessians (exact sums), so the same GPTQ / SparseGPT solutions; RTN
                # weights and activation scales from the same histograms and moving averages.
                assert torch.equal(t, u), f"{name}: {key}"
                continue
            # AWQ's channel magnitudes summed in another order differ by float rounding
            # (~1e-7), and so do its scales; a rare weight may cross a rounding boundary.
            d, n = float((t.float() - u.float()).norm()), float(t.float().norm())
            assert d <= 1e-2 * n, f"{name}: {key}: relative difference {d / n:.2e}"
            diff, total = diff + d**2, total + n**2
        assert diff <= 1e-6 * total, f"{name}: relative difference {(diff / total) ** 0.5:.2e} overall"


@pytest.mark.slow
def test_torchrun_command_line(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The documented launch: torchrun starts the ranks, rank 0 alone writes and prints."""
    import subprocess
    import sys

    from typer.testing import CliRunner

    from optc.cli.main import app

    args = ["quantize", "--model", str(tiny_checkpoint), "--method", "gptq", "--samples", "8", "--seqlen", "64",
            "--no-eval", "--format", "dense"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "optc",
         *args, "--output", str(tmp_path / "two")],
        capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1, proc.stdout  # one report, from rank 0
    assert CliRunner().invoke(app, [*args, "--output", str(tmp_path / "one"), "--quiet"]).exit_code == 0
    one, two = _tensors(tmp_path / "one"), _tensors(tmp_path / "two")
    assert one.keys() == two.keys()
    for key, t in one.items():
        assert float((t - two[key]).norm()) <= 1e-2 * float(t.norm()), key
