"""Every checkpoint holds a model card (README.md) the hub's parser reads; ``optc report --card``
regenerates it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from optc.cli.main import app
from optc.model.load import model_origin

ModelCard = pytest.importorskip("huggingface_hub").ModelCard


def _run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def _source_with_card(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """The tiny model with a model card naming its origin and license, as a hub download has."""
    src = tmp_path / "src"
    src.mkdir()
    for f in tiny_checkpoint.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "README.md").write_text("---\nlicense: mit\nbase_model: example-org/tiny-llama\n---\n# tiny\n")
    return src


def test_card_front_matter_and_sections(tiny_checkpoint: Path, tmp_path: Path) -> None:
    src = _source_with_card(tiny_checkpoint, tmp_path)
    out = tmp_path / "out"
    _run("quantize", "--model", str(src), "--output", str(out), "--format", "compressed-tensors", "-q",
         "--samples", "4", "--seqlen", "32", "--windows", "2", "--eval-dataset", "builtin")
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "example-org/tiny-llama"
    assert data["license"] == "mit"
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "text-generation"
    assert {"optc", "rtn", "4-bit", "quantized", "compressed-tensors"} <= set(data["tags"])
    text = card.text
    for section in ("## What was done", "## Accuracy", "## How to load it", "## Calibration data"):
        assert section in text
    assert "perplexity, this checkpoint" in text and "95% CI" in text
    assert "compression vs float16" in text and "bits per weight" in text
    assert "```yaml\n" + (out / "recipe.yaml").read_text().rstrip() in text  # the recipe as applied
    assert "from vllm import LLM" in text and "AutoModelForCausalLM.from_pretrained" in text
    assert "needs no calibration data" in text  # round-to-nearest reads none

    # optc report --card makes the same card again from report.json and recipe.yaml
    original = (out / "README.md").read_text()
    (out / "README.md").unlink()
    _run("report", str(out), "--card")
    assert (out / "README.md").read_text() == original


def test_gguf_card_and_calibrated_recipe(tiny_checkpoint: Path, tmp_path: Path) -> None:
    data_file = tmp_path / "calib.txt"
    data_file.write_text(" ".join(f"word{i}" for i in range(3000)))
    out = tmp_path / "gguf"
    _run("quantize", "--model", str(tiny_checkpoint), "--method", "gptq", "--output", str(out), "--format", "gguf-q4_0",
         "--bits", "4", "--group-size", "32", "--dataset", str(data_file), "--no-eval", "-q", "--samples", "4", "--seqlen", "32")
    card = ModelCard.load(out / "README.md")
    assert card.data.to_dict()["library_name"] == "gguf"
    assert "gguf-q4_0" in card.data.to_dict()["tags"]
    assert "llama-cli -m" in card.text and "gguf_file=" in card.text
    assert f"4 samples of 32 tokens from `{data_file}`" in card.text
    assert "No perplexity evaluation was run" in card.text and "size on disk" in card.text


def test_report_card_needs_a_report(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path), "--card"])
    assert result.exit_code == 1
    assert "no report.json" in result.output


def test_model_origin(tmp_path: Path) -> None:
    assert model_origin("smollm2-135m") == ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")
    assert model_origin(None) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")
    assert model_origin("org/model") == ("org/model", None)
    assert model_origin(str(tmp_path)) == (None, None)


def test_chat_calibrated_example_recipe(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The README's chat-calibrated recipe runs (a mix with the built-in chat part) and its card says so."""
    recipe = Path(__file__).parents[1] / "examples" / "w4a16-gptq-chat.yaml"
    out = tmp_path / "chat"
    _run("run", str(recipe), "--model", str(tiny_checkpoint), "--output", str(out), "--no-eval", "-q",
         "--samples", "4", "--seqlen", "32")
    text = ModelCard.load(out / "README.md").text
    assert "a mix of `builtin` (rendering chat" not in text  # rendering is said in words
    assert "4 samples of 32 tokens from a mix of `builtin` (rendered with the model's chat template) (75%)" in text
    assert "`builtin` (25%)" in text and "used by gptq" in text


def test_readme_recipes_parse() -> None:
    """Every recipe shown in the README or docs/ (a ```yaml block with ``version:``) is a valid recipe."""
    import re

    from optc.recipe import parse_recipe, safe_load_unique

    root = Path(__file__).parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    found = {}
    for page in pages:
        text = page.read_text()
        found[page.name] = [b for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S) if b.startswith("version:")]
    # the README's own recipe and docs/data.md's chat recipe: a regex that stops matching must fail here
    assert found["README.md"] and found["data.md"]
    for name, blocks in found.items():
        for block in blocks:
            parse_recipe(safe_load_unique(block), name)
