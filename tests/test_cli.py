from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import optc
from optc.cli.main import app
from optc.errors import OptcError
from optc.model.load import load_model
from optc.recipe import load_recipe
from optc.methods import Workspace
from optc.methods.rtn import run_rtn

runner = CliRunner()
CHECKPOINT_FILES = {
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    "tokenizer_config.json", "recipe.yaml", "report.json", "report.md",
}


def _ok(args: list[str]):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def _error_line(args: list[str]) -> str:
    """Run a CLI call that must fail with exit 1 and exactly one error line, no traceback."""
    result = runner.invoke(app, args)
    assert result.exit_code == 1, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)  # a handled error, not a crash
    assert "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def test_version() -> None:
    assert _ok(["--version"]).output.strip() == f"optc {optc.__version__}"


def _command_paths(cmd, prefix: list[str]) -> list[list[str]]:
    paths = [prefix]
    for name, sub in getattr(cmd, "commands", {}).items():
        paths += _command_paths(sub, prefix + [name])
    return paths


def test_help_of_every_command() -> None:
    paths = _command_paths(typer.main.get_command(app), [])
    names = {" ".join(p) for p in paths}
    assert {"run", "quantize", "prune", "eval", "inspect", "recipes validate"} <= names
    for path in paths:
        result = _ok(path + ["--help"])
        assert "Usage:" in result.output and "Traceback" not in result.output


# --- optc run --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rtn_run(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("rtn") / "out"
    args = ["run", "w4a16-rtn", "--model", str(tiny_checkpoint), "--output", str(out), "--windows", "2"]
    return _ok(args + ["--format", "dense"]), out


def test_run_writes_checkpoint(rtn_run, tiny_checkpoint: Path) -> None:
    result, out = rtn_run
    assert CHECKPOINT_FILES <= {p.name for p in out.iterdir()}
    assert _siblings(out) == []
    assert f"wrote {out}" in result.output
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == str(tiny_checkpoint)
    assert [s["type"] for s in report["stages"]] == ["rtn"]
    assert len(report["stages"][0]["stats"]["modules"]) == 14  # 7 Linears x 2 layers
    metrics = report["metrics"]
    for key in ("perplexity_baseline", "perplexity_compressed"):
        assert metrics[key]["windows"] == 2 and metrics[key]["seqlen"] == 512
        assert math.isfinite(metrics[key]["perplexity"])
    assert report["checkpoint"]["format"] == "dense" and report["checkpoint"]["path"] == str(out)
    assert "Perplexity change" in (out / "report.md").read_text()
    recipe = load_recipe(str(out / "recipe.yaml"))
    assert recipe.model == str(tiny_checkpoint) and recipe.evaluation.windows == 2
    assert recipe.stages[0].scheme.bits == 4


def test_run_checkpoint_reloads_with_in_memory_logits(rtn_run, tiny_checkpoint: Path) -> None:
    _, out = rtn_run
    loaded = load_model(str(tiny_checkpoint))
    original = loaded.model.model.layers[0].mlp.down_proj.weight.detach().clone()
    run_rtn(Workspace(loaded.model, loaded.tokenizer), load_recipe("w4a16-rtn").stages[0])
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, loaded.model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, loaded.model(ids).logits, atol=1e-5, rtol=1e-5)
    w = reloaded.model.layers[0].mlp.down_proj.weight.detach()  # [64, 160]: groups of 64, 64, 32
    assert not torch.equal(w, original)
    for lo, hi in ((0, 64), (64, 128), (128, 160)):
        assert max(len(torch.unique(row)) for row in w[:, lo:hi]) <= 16  # 4-bit grid per group


def test_quantize_flags_override_recipe(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "q3"
    _ok(["quantize", "--bits", "3", "--group-size", "32", "--model", str(tiny_checkpoint), "--output", str(out), "--no-eval", "--format", "dense"])
    recipe = load_recipe(str(out / "recipe.yaml"))
    assert (recipe.stages[0].scheme.bits, recipe.stages[0].scheme.group_size) == (3, 32)
    assert recipe.evaluation is None
    w = AutoModelForCausalLM.from_pretrained(out).model.layers[1].self_attn.q_proj.weight.detach()
    assert max(len(torch.unique(row)) for row in w[:, :32]) <= 8
    line = _error_line(["quantize", "--bits", "9", "--model", str(tiny_checkpoint), "--no-eval"])
    assert "bits must be between 2 and 8" in line


def test_existing_output_refused_then_replaced(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("keep me")
    (out / "report.json").write_text("{}")  # an earlier optc output (any other directory: tests/test_hardening.py)
    args = ["prune", "--pattern", "2:4", "--model", str(tiny_checkpoint), "--output", str(out), "--no-eval"]
    assert "already exists" in _error_line(args) and "--overwrite" in _error_line(args)
    assert (out / "stale.txt").read_text() == "keep me"
    _ok(args + ["--overwrite"])
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert _siblings(out) == []


def test_output_is_file_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "file"
    out.write_text("x")
    for extra in ([], ["--overwrite"]):
        line = _error_line(["run", "w4a16-rtn", "--model", str(tiny_checkpoint), "--output", str(out), "--no-eval", *extra])
        assert "exists and is a file" in line
    assert out.read_text() == "x"


def test_output_inside_input_model_refused(tiny_checkpoint: Path) -> None:
    before = sorted(p.name for p in tiny_checkpoint.iterdir())
    line = _error_line(["run", "w4a16-rtn", "--model", str(tiny_checkpoint), "--output", str(tiny_checkpoint / "out"), "--no-eval"])
    assert "inside the input model directory" in line
    assert sorted(p.name for p in tiny_checkpoint.iterdir()) == before


def test_failed_run_leaves_nothing(tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_args, **_kwargs):
        raise OptcError("disk full (simulated)")

    monkeypatch.setattr("optc.run.pipeline.write_report", fail)
    out = tmp_path / "out"
    args = ["run", "w4a16-rtn", "--model", str(tiny_checkpoint), "--output", str(out), "--no-eval", "--format", "dense"]
    assert "disk full" in _error_line(args)
    assert not out.exists() and _siblings(out) == []
    # With --overwrite, a failure keeps the previous output intact.
    out.mkdir()
    (out / "recipe.yaml").write_text("previous")  # an earlier optc output: --overwrite may replace it
    assert "disk full" in _error_line(args + ["--overwrite"])
    assert [p.name for p in out.iterdir()] == ["recipe.yaml"] and _siblings(out) == []


def test_missing_model(tmp_path: Path) -> None:
    line = _error_line(["run", "w4a16-rtn", "--model", str(tmp_path / "nope"), "--no-eval", "--no-save"])
    assert "model not found" in line and "nope" in line
    assert "no config.json" in _error_line(["eval", str(tmp_path)])


def test_bad_datasets(tiny_checkpoint: Path, tmp_path: Path) -> None:
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_text("\n")
    short.write_text("Only a handful of tokens here.")
    out = tmp_path / "out"
    base = ["run", "w4a16-rtn", "--model", str(tiny_checkpoint), "--output", str(out), "--windows", "1"]
    assert "is empty" in _error_line(base + ["--eval-dataset", str(empty)])
    assert "shorter than one window of 512" in _error_line(base + ["--eval-dataset", str(short)])
    assert "same file" in _error_line(base + ["--dataset", str(short), "--eval-dataset", str(short)])
    assert "not found" in _error_line(base + ["--eval-dataset", str(tmp_path / "missing.txt")])
    assert not out.exists() and _siblings(out) == []
    line = _error_line(["eval", str(tiny_checkpoint), "--dataset", str(short), "--seqlen", "64"])
    assert "shorter than one window of 64" in line


def test_calibration_data_too_short_or_empty(tiny_checkpoint: Path, tmp_path: Path) -> None:
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_text(" \n")
    short.write_text("Only a handful of tokens here, far too few for fifty samples.")
    out = tmp_path / "out"
    base = ["run", "w4a16-gptq", "--model", str(tiny_checkpoint), "--output", str(out), "--no-eval", "--seqlen", "16"]
    assert "fewer than the 50 samples" in _error_line(base + ["--dataset", str(short), "--samples", "50"])
    assert "is empty" in _error_line(base + ["--dataset", str(empty)])
    assert not out.exists() and _siblings(out) == []


def test_unsupported_gguf(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "unsupportedarch")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    line = _error_line(["eval", str(path)])
    assert "cannot load GGUF file" in line and "unsupportedarch" in line
    info = json.loads(_ok(["inspect", str(path), "--json"]).stdout)
    assert info["format"] == "gguf" and info["architecture"] == "unsupportedarch" and info["parameters"] == 32
    assert "model file not found" in _error_line(["eval", str(tmp_path / "absent.gguf")])


# --- prune, inspect, eval --------------------------------------------------------------


def test_prune_2of4_and_inspect(tiny_checkpoint: Path, rtn_run, tmp_path: Path) -> None:
    out = tmp_path / "pruned"
    _ok(["prune", "--pattern", "2:4", "--model", str(tiny_checkpoint), "--output", str(out), "--no-eval"])
    model = AutoModelForCausalLM.from_pretrained(out)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    assert len(linears) == 14
    for name, m in linears.items():
        groups = m.weight.detach().reshape(m.out_features, -1, 4)
        assert ((groups != 0).sum(-1) == 2).all(), name
    assert torch.count_nonzero(model.model.embed_tokens.weight) == model.model.embed_tokens.weight.numel()

    params = json.loads((out / "report.json").read_text())["metrics"]["parameters"]
    info = json.loads(_ok(["inspect", str(out), "--json"]).stdout)
    assert info["format"] == "dense" and info["architecture"] == "LlamaForCausalLM"
    assert info["parameters"] == params and info["sparsity"] == pytest.approx(0.5, abs=1e-4)
    assert info["bytes"] > 4 * params  # float32

    dense = json.loads(_ok(["inspect", str(rtn_run[1]), "--json"]).stdout)
    assert dense["format"] == "dense" and dense["parameters"] == params and dense["sparsity"] < 0.4
    table = _ok(["inspect", str(out)]).output
    assert "sparsity" in table and "0.5" in table
    unstructured = tmp_path / "unstructured"
    _ok(["prune", "--sparsity", "0.25", "--model", str(tiny_checkpoint), "--output", str(unstructured), "--no-eval"])
    assert json.loads(_ok(["inspect", str(unstructured), "--json"]).stdout)["sparsity"] == pytest.approx(0.25, abs=1e-3)
    assert "not a checkpoint directory" in _error_line(["inspect", str(tmp_path)])
    assert "checkpoint not found" in _error_line(["inspect", str(tmp_path / "nope")])


def _strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_eval_prints_perplexity(tiny_checkpoint: Path) -> None:
    args = ["eval", str(tiny_checkpoint), "--seqlen", "64", "--windows", "2"]
    text = _ok(args).output
    assert "perplexity" in text and "2 x 64" in text and "95% CI" in text
    report = _strict_json(_ok(args + ["--json"]).stdout)
    ppl = report["metrics"]["perplexity_model"]
    assert (ppl["windows"], ppl["seqlen"], ppl["tokens"]) == (2, 64, 126)
    assert 1 < ppl["perplexity"] < 10 * 49152 and math.isfinite(ppl["perplexity"])
    assert report["metrics"]["parameters"] > 0 and report["model"] == str(tiny_checkpoint)


def test_eval_single_window_is_strict_json(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    args = ["eval", str(tiny_checkpoint), "--seqlen", "32", "--windows", "1", "--output", str(out)]
    report = _strict_json(_ok(args + ["--json"]).stdout)
    assert report["metrics"]["perplexity_model"]["ci95"] == [None, None]  # no interval from 1 window
    _strict_json((out / "report.json").read_text())
    assert "[-, -]" in (out / "report.md").read_text()


def test_bad_device(tiny_checkpoint: Path) -> None:
    base = ["run", "w4a16-rtn", "--model", str(tiny_checkpoint), "--no-eval"]
    assert "unknown device 'tpu'" in _error_line(base + ["--device", "tpu"])
    if not torch.cuda.is_available():
        assert "no CUDA device" in _error_line(base + ["--device", "cuda"])


def test_eval_against_baseline(rtn_run, tiny_checkpoint: Path) -> None:
    args = ["eval", str(rtn_run[1]), "--baseline", str(tiny_checkpoint), "--seqlen", "64", "--windows", "2"]
    assert "perplexity change:" in _ok(args).output
    metrics = _strict_json(_ok(args + ["--json"]).stdout)["metrics"]
    base, comp = metrics["perplexity_baseline"], metrics["perplexity_compressed"]
    assert base["window_nll"] != comp["window_nll"] and base["tokens"] == comp["tokens"] == 126
    assert metrics["bytes_on_disk"] > 0
