"""`optc prune` end to end on a tiny checkpoint: methods, metadata, structured, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from optc.cli.main import app
from optc.compress.masks import nm_violations
from optc.export.compressed_tensors import read_pack_quantized

runner = CliRunner()
FAST = ["--samples", "4", "--seqlen", "64", "--no-eval"]


def _ok(args: list[str]):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def _error_line(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 1, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def _decoder_linears(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_prune_nm_writes_dense_checkpoint_with_sparsity_metadata(
    tiny_checkpoint: Path, tmp_path: Path, method: str
) -> None:
    out = tmp_path / method
    text = _ok(["prune", "--method", method, "--pattern", "2:4", "--model", str(tiny_checkpoint),
                "--output", str(out), *FAST]).output
    assert "exactly 2:4 in every group" in text
    model = AutoModelForCausalLM.from_pretrained(out)
    for name, m in _decoder_linears(model).items():
        assert nm_violations(m.weight.detach(), 2, 4) == 0, name
        assert int((m.weight != 0).sum()) == m.weight.numel() // 2, name
    sc = json.loads((out / "config.json").read_text())["quantization_config"]["sparsity_config"]
    assert sc["format"] == "dense" and sc["sparsity_structure"] == "2:4"
    assert len(sc["targets"]) == 14 and "lm_head" in sc["ignore"]
    report = json.loads((out / "report.json").read_text())
    stats = report["stages"][0]["stats"]
    assert report["stages"][0]["type"] == method
    assert stats["nm_violations"] == 0 and stats["sparsity"] == pytest.approx(0.5)
    assert set(stats["layer_sparsity"]) == {"model.layers.0", "model.layers.1"}
    info = json.loads(_ok(["inspect", str(out), "--json"]).stdout)
    assert info["format"] == "dense" and info["sparsity_structure"] == "2:4"


def test_unstructured_wanda_without_metadata(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "version": 1, "stages": [{"type": "wanda", "sparsity": 0.4}],
        "export": {"format": "dense", "sparsity_metadata": False},
    }))
    out = tmp_path / "out"
    _ok(["run", str(recipe), "--model", str(tiny_checkpoint), "--output", str(out), *FAST])
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out)
    for name, m in _decoder_linears(model).items():
        assert ((m.weight == 0).sum(1) == int(m.in_features * 0.4)).all(), name


def test_sparse_then_gptq_exports_pack_quantized_with_zeros(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "version": 1,
        "stages": [{"type": "sparsegpt", "pattern": "2:4"},
                   {"type": "gptq", "scheme": {"bits": 4, "group_size": 32}}],
        "export": {"format": "compressed-tensors"},
    }))
    out = tmp_path / "out"
    _ok(["run", str(recipe), "--model", str(tiny_checkpoint), "--output", str(out), *FAST])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["sparsity_config"]["sparsity_structure"] == "2:4"
    state, qparams = read_pack_quantized(out)
    assert len(qparams) == 14
    for name in qparams:
        assert nm_violations(state[f"{name}.weight"], 2, 4) == 0, name
    model = AutoModelForCausalLM.from_pretrained(out)  # transformers + compressed-tensors
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    w = model.model.layers[0].mlp.down_proj.weight.detach()
    assert nm_violations(w, 2, 4) == 0
    info = json.loads(_ok(["inspect", str(out), "--json"]).stdout)
    assert info["format"] == "compressed-tensors/pack-quantized" and info["sparsity_structure"] == "2:4"


def test_structured_cli_shrinks_the_checkpoint(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "small"
    text = _ok(["prune", "--structured", "heads=0.5,mlp=0.25", "--model", str(tiny_checkpoint),
                "--output", str(out), *FAST]).output
    assert "removed" in text and "ms" in text
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 2, 16)
    assert config["intermediate_size"] == 120
    assert "quantization_config" not in config  # nothing unstructured: a plain config
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.model.layers[1].mlp.down_proj.weight.shape == (64, 120)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (32, 64)
    stats = json.loads((out / "report.json").read_text())["stages"][0]["stats"]
    assert stats["parameters_removed"] > 0 and stats["speedup"] > 0
    src = sum(p.stat().st_size for p in tiny_checkpoint.glob("*.safetensors"))
    assert sum(p.stat().st_size for p in out.glob("*.safetensors")) < src


BAD = [
    (["--pattern", "3:2"], "needs 0 < N < M"),
    (["--pattern", "0:4"], "needs 0 < N < M"),
    (["--pattern", "2:3", "--method", "wanda"], "divisible by 3"),
    (["--pattern", "2:3", "--method", "sparsegpt"], "divisible by 3"),
    (["--pattern", "2:3"], "divisible by 3"),
    (["--sparsity", "1.0", "--method", "wanda"], "sparsity"),
    (["--sparsity", "-0.1", "--method", "sparsegpt"], "sparsity"),
    (["--structured", "heads=0.9"], "every query head"),
    (["--structured", "kv_heads=0.75"], "every head"),
    (["--structured", "mlp=1.0"], "mlp"),
    (["--structured", "layers=0.5"], "expected heads=F"),
    (["--structured", "heads=lots"], "not a number"),
    (["--method", "obs"], "unknown pruning method"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_exits_one_and_writes_nothing(
    tiny_checkpoint: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "never"
    line = _error_line(["prune", *args, "--model", str(tiny_checkpoint), "--output", str(out), *FAST])
    assert message in line
    assert not out.exists() and list(tmp_path.iterdir()) == []
