"""Fault injection: a run killed with SIGKILL (no cleanup of any kind) at each point where it has
something on disk, then continued. The next run resumes to a checkpoint byte-identical to an
uninterrupted run's, or runs again from the start; either way nothing the killed run left
(partial, moved-aside, resume state, lock) survives it, and the input's files never change.

Each run to kill is a process of its own, forked from one helper process that imported optc once
(a fresh interpreter per kill would spend most of this test on imports). The forked run wraps one
function of optc so that it kills itself at that point; everything before it runs as in a normal
run. Nothing in the helper touches torch's thread pools before forking, so the forks are safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optc.recipe import parse_recipe
from optc.run.pipeline import run_recipe
from optc.run.state import state_dir_for

# The helper: one job per line on stdin (point, output, recipe, overwrite), one line back on
# stdout with the signal that ended the forked run.
HELPER = r"""
import json, os, pathlib, signal, sys, traceback
import optc.compress.gptq as gptq
import optc.run.pipeline as pipeline
from optc.recipe import parse_recipe
from optc.run.state import LayerStore
# What a run imports on first use, imported once here rather than in every fork.
import optc.calibrate.sequential, optc.export.ct_pack, optc.methods.gptq, optc.evaluate.charts  # noqa: E401
import transformers.models.llama.modeling_llama, transformers.tokenization_utils_fast  # noqa: E401
import safetensors.torch, compressed_tensors, pydoc_data.topics  # noqa: E401

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def wrap(owner, name, before=None, after=None):
    original = getattr(owner, name)
    def hooked(*args, **kwargs):
        if before is not None and before(*args, **kwargs):
            die()
        result = original(*args, **kwargs)
        if after is not None and after(*args, **kwargs):
            die()
        return result
    setattr(owner, name, hooked)

def run(point, out, recipe, overwrite):
    if point == "calibration":  # inside the first layer's solve: nothing saved yet
        wrap(gptq, "gptq_quantize", before=lambda *a, **k: True)
    elif point.startswith("layer-"):  # layer i done; ".saved": its save committed, else racing the commit
        n, _, saved = point.removeprefix("layer-").partition(".")
        def done(store, i, *a, **k):
            if i == int(n) and saved:
                store.flush()
            return i == int(n)
        wrap(LayerStore, "done", after=done)
    elif point == "export":  # the checkpoint's weights are written in the staging directory
        wrap(pipeline, "export_checkpoint", after=lambda *a, **k: True)
    elif point == "report":  # everything but the report is staged
        wrap(pipeline, "write_report", before=lambda *a, **k: True)
    elif point == "rename":  # the old output moved aside, the new one not yet in its place
        wrap(pathlib.Path, "rename", before=lambda self, *a: self.name.startswith(f".{out.name}.partial-"))
    else:
        raise SystemExit(f"unknown point {point}")
    pipeline.run_recipe(parse_recipe(json.loads(recipe.read_text())), out, overwrite=overwrite)

for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.dup2(2, 1)  # stdout is the helper's answers
        try:
            run(job["point"], pathlib.Path(job["out"]), pathlib.Path(job["recipe"]), job["overwrite"])
            print("the run was not killed", file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}), flush=True)
"""


@pytest.fixture(scope="module")
def kill_at(tmp_path_factory: pytest.TempPathFactory):
    """``kill_at(point, out, recipe, overwrite)``: run the recipe in a process killed at ``point``;
    returns the signal that ended it."""
    log = tmp_path_factory.mktemp("faults") / "helper.log"
    with log.open("w") as err:
        helper = subprocess.Popen([sys.executable, "-c", HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=err, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})

    def kill(point: str, out: Path, recipe: Path, overwrite: bool) -> int | None:
        job = {"point": point, "out": str(out), "recipe": str(recipe), "overwrite": overwrite}
        helper.stdin.write(json.dumps(job) + "\n")
        helper.stdin.flush()
        answer = helper.stdout.readline()
        assert answer, log.read_text()[-3000:]
        got = json.loads(answer)["signal"]
        assert got == signal.SIGKILL, log.read_text()[-3000:]
        return got

    try:
        yield kill
    finally:
        helper.stdin.close()
        helper.wait(timeout=60)


POINTS = ["calibration", "layer-0", "layer-0.saved", "layer-1.saved", "export", "report", "rename"]


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _checkpoint(root: Path) -> dict[str, str]:
    # report.json / report.md hold timings; every other file is the same bytes
    return {k: v for k, v in _digest(root).items() if k not in ("report.json", "report.md")}


@pytest.fixture(scope="module")
def recipe_data(tiny_checkpoint: Path) -> dict:
    return parse_recipe({
        "version": 1, "model": str(tiny_checkpoint),
        "calibration": {"samples": 4, "seqlen": 32},
        # minmax grids, no scale refit: the cheapest GPTQ, still saving its layers for --resume
        "stages": [{"type": "gptq", "scheme": {"bits": 4, "group_size": 32}, "observer": "minmax", "refit_scales": False}],
        "evaluation": None, "export": {"format": "compressed-tensors"},
    }).model_dump(mode="json")


@pytest.fixture(scope="module")
def reference(recipe_data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("reference") / "out"
    run_recipe(parse_recipe(recipe_data), out)
    return _checkpoint(out)


@pytest.mark.parametrize("point", POINTS)
def test_killed_anywhere_then_continued(point: str, kill_at, recipe_data: dict, reference: dict,
                                        tiny_checkpoint: Path, tmp_path: Path) -> None:
    inputs = _digest(tiny_checkpoint)
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    overwrite = point == "rename"
    if overwrite:  # an earlier output to replace, so that the kill falls between the two renames
        run_recipe(parse_recipe(recipe_data), out)
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(recipe_data))
    kill_at(point, out, recipe, overwrite)
    assert _digest(tiny_checkpoint) == inputs
    left = {p.name for p in work.iterdir()}
    assert "out" not in left, left  # never a half-written output in place (the old one is moved aside)
    if point in ("export", "report", "rename"):
        assert any(name.startswith(".out.partial-") for name in left), left  # what the next run must clean

    # The next run: --resume where the killed one saved layers, else the same command again.
    resume = (state_dir_for(out) / "progress.json").is_file()
    if point == "calibration":
        assert not resume, left
    elif point != "layer-0":  # layer-0 died racing its own save: either state is consistent
        assert resume, left
    run_recipe(parse_recipe(recipe_data), out, resume=resume, overwrite=overwrite)
    assert _checkpoint(out) == reference
    assert sorted(p.name for p in work.iterdir()) == ["out"]  # no partial, old, state or lock left
    assert _digest(tiny_checkpoint) == inputs
