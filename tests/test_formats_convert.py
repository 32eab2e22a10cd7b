"""``optc export``: conversions between formats without calibration, refusals with the reason and
nothing written, the recipe pre-check, ``optc inspect`` on every format, and corrupt files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from optc.cli.main import app
from optc.errors import OptcError
from optc.export.convert import convert_checkpoint, export_model
from optc.export.inspect import inspect_checkpoint
from optc.export.load import load_checkpoint as load_model
from optc.run.pipeline import run_recipe
from optc.recipe import parse_recipe
from test_formats_support import (  # noqa: F401 - fixtures
    fp16_tolerance,
    logits,
    quantize_rtn,
    tiny_ids,
    tiny_lm,
    tiny_tokenizer,
)

runner = CliRunner()


@pytest.fixture(scope="module")
def sources(tiny_lm, tiny_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """Checkpoints written by optc's exporters: the inputs of the conversions."""
    root = tmp_path_factory.mktemp("sources")
    out: dict[str, Path] = {}
    for label, fmt, scheme in [
        ("gptq-sym", "gptq", {"bits": 4, "symmetric": True, "group_size": 32}),
        ("gptq-3bit", "gptq", {"bits": 3, "symmetric": True, "group_size": 32}),
        ("awq-asym", "awq", {"bits": 4, "symmetric": False, "group_size": 64}),
        ("ct-channel", "compressed-tensors", {"bits": 4, "symmetric": True, "group_size": None}),
        ("ct-asym", "compressed-tensors", {"bits": 4, "symmetric": False, "group_size": 32}),
    ]:
        model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, **scheme)
        out[label] = root / label
        out[label].mkdir()
        export_model(model, tiny_tokenizer, qparams, fmt, out[label])
    out["dense"] = root / "dense"
    export_model(tiny_lm, tiny_tokenizer, {}, "dense", out["dense"])
    return out


def same_logits(a: str | Path, b: str | Path, ids: torch.Tensor, exact: bool = False) -> None:
    ref = logits(load_model(str(a)).model, ids)
    got = logits(load_model(str(b)).model, ids)
    diff = float((got - ref).abs().max())
    assert diff == 0.0 if exact else diff <= fp16_tolerance(ref), diff


def test_gptq_to_compressed_tensors_and_back_is_lossless(sources, tiny_ids, tmp_path) -> None:
    ct = convert_checkpoint(str(sources["gptq-sym"]), tmp_path / "ct", "compressed-tensors")
    assert ct["format"] == "compressed-tensors/pack-quantized" and ct["modules_read"] == 14
    back = convert_checkpoint(str(tmp_path / "ct"), tmp_path / "gptq", "gptq")
    assert back["scheme"] == "int4-sym-g32"
    assert (sources["gptq-sym"] / "model.safetensors").read_bytes() == (tmp_path / "gptq" / "model.safetensors").read_bytes()
    same_logits(sources["gptq-sym"], tmp_path / "ct", tiny_ids, exact=True)
    # A foreign reader of the converted file: transformers with the compressed-tensors package.
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ct").eval()
    ref = logits(load_model(str(sources["gptq-sym"])).model, tiny_ids)
    assert (logits(hf, tiny_ids) - ref).abs().max() <= fp16_tolerance(ref)


def test_awq_asymmetric_to_gptq_and_compressed_tensors(sources, tiny_ids, tmp_path) -> None:
    from transformers import CompressedTensorsConfig

    convert_checkpoint(str(sources["awq-asym"]), tmp_path / "gptq", "gptq")
    same_logits(sources["awq-asym"], tmp_path / "gptq", tiny_ids, exact=True)
    convert_checkpoint(str(tmp_path / "gptq"), tmp_path / "ct", "compressed-tensors")
    same_logits(sources["awq-asym"], tmp_path / "ct", tiny_ids, exact=True)
    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ct", quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    ref = logits(load_model(str(sources["awq-asym"])).model, tiny_ids)
    assert (logits(hf, tiny_ids) - ref).abs().max() <= fp16_tolerance(ref)


def test_per_channel_compressed_tensors_to_awq_and_q4_0(sources, tiny_ids, tmp_path) -> None:
    awq = convert_checkpoint(str(sources["ct-channel"]), tmp_path / "awq", "awq")
    assert awq["scheme"] == "int4-sym-g64"  # one scale per row, repeated over groups of 64
    same_logits(sources["ct-channel"], tmp_path / "awq", tiny_ids)
    # Every 32-weight block of a row shares the row's scale: Q4_0 holds per-channel exactly.
    q4 = convert_checkpoint(str(sources["ct-channel"]), tmp_path / "q4", "gguf-q4_0")
    assert q4["modules"] == {"exact": 14}
    same_logits(sources["ct-channel"], tmp_path / "q4", tiny_ids)


@pytest.mark.parametrize(("source", "fmt", "reason"), [
    ("gptq-3bit", "awq", "AWQ GEMM holds 4-bit weights only, not 3-bit"),
    ("ct-asym", "gguf-q4_0", r"int4-asym-g32 weights need integers in \[-15, 15\]"),
    ("dense", "gptq", "holds no quantized weights"),
])
def test_impossible_conversions_are_refused_and_write_nothing(sources, tmp_path, source, fmt, reason) -> None:
    with pytest.raises(OptcError, match=reason):
        convert_checkpoint(str(sources[source]), tmp_path / "out", fmt)
    assert list(tmp_path.iterdir()) == []


def test_cli_export_converts_and_refuses(sources, tmp_path) -> None:
    result = runner.invoke(app, ["export", str(sources["gptq-sym"]), "--format", "gguf-q8_0", "--output", str(tmp_path / "q8")])
    assert result.exit_code == 0, result.output
    assert "gguf/q8_0" in result.output and (tmp_path / "q8" / "model-q8_0.gguf").is_file()
    result = runner.invoke(app, ["export", str(sources["gptq-3bit"]), "--format", "awq", "--output", str(tmp_path / "awq")])
    assert result.exit_code == 1
    assert "4-bit weights only" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "awq").exists()
    result = runner.invoke(app, ["export", str(sources["gptq-sym"]), "--format", "exl2", "--output", str(tmp_path / "x")])
    assert result.exit_code == 1 and "unknown export format" in result.output


def test_recipe_refuses_impossible_export_before_calibration(tmp_path) -> None:
    recipe = parse_recipe({
        "version": 1, "model": str(tmp_path / "never-loaded"),
        "stages": [{"type": "gptq", "scheme": {"bits": 3, "group_size": 32}}],
        "evaluation": None, "export": {"format": "awq"},
    })
    with pytest.raises(OptcError, match="stage 0 \\(gptq\\) scheme: AWQ GEMM holds 4-bit"):
        run_recipe(recipe, tmp_path / "out")
    mixed = parse_recipe({
        "version": 1, "model": str(tmp_path / "never-loaded"),
        "stages": [{"type": "rtn", "scheme": {"bits": 4},
                    "overrides": [{"pattern": "down", "scheme": {"bits": 4, "symmetric": False}}]}],
        "evaluation": None, "export": {"format": "awq"},
    })
    with pytest.raises(OptcError, match="one scheme per checkpoint"):
        run_recipe(mixed, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_run_recipe_writes_gguf(tiny_lm, tiny_tokenizer, tiny_ids, tmp_path) -> None:
    tiny_lm.save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    recipe = parse_recipe({
        "version": 1, "model": str(tmp_path / "model"),
        "stages": [{"type": "rtn", "scheme": {"bits": 4, "group_size": 64}}],
        "evaluation": None, "export": {"format": "gguf-q4_0"},
    })
    report = run_recipe(recipe, tmp_path / "out")
    assert report["checkpoint"]["format"] == "gguf/q4_0"
    assert (tmp_path / "out" / "model-q4_0.gguf").is_file() and (tmp_path / "out" / "report.json").is_file()
    info = inspect_checkpoint(tmp_path / "out")
    assert info["optc_scheme"] == "int4-sym-g64" and info["optc_exact_modules"] == 14
    loaded = load_model(str(tmp_path / "out"))  # a GGUF directory evaluates like any model
    assert logits(loaded.model, tiny_ids).shape[-1] == len(tiny_tokenizer)


def test_inspect_reports_every_format(sources, tmp_path) -> None:
    convert_checkpoint(str(sources["gptq-sym"]), tmp_path / "q4", "gguf-q4_0")
    expected = {
        "gptq-sym": ("gptq/gptq", [4], [32], [True]),
        "gptq-3bit": ("gptq/gptq", [3], [32], [True]),
        "awq-asym": ("awq/gemm", [4], [64], [False]),
        "ct-channel": ("compressed-tensors/pack-quantized", [4], [None], [True]),
    }
    dense = inspect_checkpoint(sources["dense"])
    for label, (fmt, bits, group, sym) in expected.items():
        info = inspect_checkpoint(sources[label])
        assert (info["format"], info["bits"], info["group_size"], info["symmetric"]) == (fmt, bits, group, sym), label
        assert info["act_order"] == ["False"] or info["act_order"] == ["None"]
        assert info["parameters"] == dense["parameters"], label  # packed weights counted as weights
        assert 0 < info["ratio_to_fp16"] and "sparsity" in info and info["bytes"] > 0
    q4 = inspect_checkpoint(tmp_path / "q4")
    assert (q4["format"], q4["bits"], q4["group_size"], q4["symmetric"]) == ("gguf", [4], [32], [True])
    assert q4["parameters"] == dense["parameters"] and q4["tensor_types"]["Q4_0"] == 14
    # Sparsity counts weights whose code equals the zero point, the same in both files.
    assert q4["sparsity"] == inspect_checkpoint(sources["gptq-sym"])["sparsity"] > 0
    # 4.5 bits per decoder weight (the float16 embeddings dominate this tiny model).
    assert q4["bytes"] < inspect_checkpoint(sources["gptq-sym"])["bytes"]
    result = runner.invoke(app, ["inspect", str(sources["awq-asym"]), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["format"] == "awq/gemm"


@pytest.mark.parametrize("source", ["gptq-sym", "awq-asym", "ct-asym", "dense"])
def test_truncated_checkpoint_is_an_error_naming_the_file(sources, tmp_path, source) -> None:
    import shutil

    broken = tmp_path / source
    shutil.copytree(sources[source], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    for command in (["inspect", str(broken)], ["eval", str(broken), "--windows", "1"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 1, command
        assert str(weights) in result.output.replace("\n", "") and "Traceback" not in result.output


def test_truncated_gguf_is_an_error_naming_the_file(sources, tmp_path) -> None:
    convert_checkpoint(str(sources["gptq-sym"]), tmp_path / "q4", "gguf-q4_0")
    path = tmp_path / "q4" / "model-q4_0.gguf"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for command in (["inspect", str(path)], ["eval", str(path), "--windows", "1"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 1, command
        assert str(path) in result.output.replace("\n", "") and "Traceback" not in result.output
