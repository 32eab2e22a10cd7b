"""Stored dtype of the tensors that are not quantized: the source's, bfloat16 for a GGUF source,
or what ``export.dtype`` / ``--dtype`` chooses; the report says which."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from optc.cli.main import app
from optc.export.source import stored_dtype
from optc.model.gguf_index import read_gguf_index
from test_formats_support import make_model, make_tokenizer

RUN = ["--no-eval", "-q", "--samples", "4", "--seqlen", "32"]


def _header(path: Path) -> dict:
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return {k: v for k, v in json.loads(fh.read(n)).items() if k != "__metadata__"}


def _run(*args: str) -> None:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 Llama directory with a 320-token tokenizer: loading a GGUF file costs what
    its tokenizer's arrays cost (transformers reads them with gguf-py, several times per load)."""
    tokenizer = make_tokenizer()
    path = tmp_path_factory.mktemp("small") / "small-llama"
    make_model(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_gguf(small_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    from optc.export.gguf_format import write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(AutoModelForCausalLM.from_pretrained(small_checkpoint).eval(), AutoTokenizer.from_pretrained(small_checkpoint),
               path, "f16")
    return path


def test_auto_rule() -> None:
    assert stored_dtype("auto", "float32", True, torch.float32) == torch.bfloat16  # GGUF source
    assert stored_dtype("auto", "float32", False, torch.float32) == torch.float32
    assert stored_dtype("auto", "bfloat16", False, torch.float32) == torch.bfloat16
    assert stored_dtype("auto", None, False, torch.float16) == torch.float16  # hub id: as loaded
    assert stored_dtype("float16", "float32", True, torch.float32) == torch.float16


def test_gguf_source_defaults_to_bfloat16(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "w4"
    _run("quantize", "--model", str(tiny_gguf), "--output", str(out), "--format", "compressed-tensors", *RUN)
    header = _header(out / "model.safetensors")
    assert header["model.embed_tokens.weight"]["dtype"] == "BF16"
    assert header["model.norm.weight"]["dtype"] == "BF16"
    assert header["model.layers.0.self_attn.q_proj.weight_packed"]["dtype"] == "I32"
    assert header["model.layers.0.self_attn.q_proj.weight_scale"]["dtype"] == "BF16"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    report = json.loads((out / "report.json").read_text())
    assert report["metrics"]["size"]["dtype"] == "bfloat16"
    assert "unquantized tensors in bfloat16" in (out / "report.md").read_text()
    # transformers loads it (compressed-tensors decompresses it) in the declared dtype
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16


def test_dtype_flag_chooses(tiny_gguf: Path, small_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "f32"
    _run("quantize", "--model", str(tiny_gguf), "--output", str(out), "--format", "compressed-tensors",
         "--dtype", "float32", *RUN)
    assert _header(out / "model.safetensors")["model.embed_tokens.weight"]["dtype"] == "F32"
    # A float32 Hugging Face source stays float32 by default (the pinned recipe bytes)...
    out = tmp_path / "same"
    _run("quantize", "--model", str(small_checkpoint), "--output", str(out), "--format", "compressed-tensors", *RUN)
    assert _header(out / "model.safetensors")["model.embed_tokens.weight"]["dtype"] == "F32"
    # ... and a dense export casts every float tensor, fake-quantized weights included.
    out = tmp_path / "dense16"
    _run("quantize", "--model", str(small_checkpoint), "--output", str(out), "--format", "dense", "--dtype", "float16", *RUN)
    header = _header(out / "model.safetensors")
    assert {v["dtype"] for v in header.values()} == {"F16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.float16


def test_bfloat16_source_keeps_its_dtype(small_checkpoint: Path, tmp_path: Path) -> None:
    src = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(small_checkpoint, dtype=torch.bfloat16).save_pretrained(src)
    for f in small_checkpoint.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (src / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "out"
    _run("quantize", "--model", str(src), "--output", str(out), "--format", "compressed-tensors", *RUN)
    assert _header(out / "model.safetensors")["model.embed_tokens.weight"]["dtype"] == "BF16"


def test_bad_dtype_is_one_line(small_checkpoint: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["quantize", "--model", str(small_checkpoint), "--output", str(tmp_path / "x"),
                                      "--dtype", "int8", *RUN])
    assert result.exit_code == 1
    assert "export.dtype" in result.output


def _recipe(tmp_path: Path, fmt: str) -> str:
    path = tmp_path / f"emb8-{fmt}.yaml"
    path.write_text(
        "version: 1\nstages:\n  - type: rtn\n    scheme: {bits: 4, symmetric: true, group_size: 32}\n"
        f"    ignore: [lm_head]\nevaluation: null\nexport: {{format: {fmt}, embedding_bits: 8}}\n")
    return str(path)


def test_8bit_embedding_in_gguf_and_refused_elsewhere(small_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "gguf"
    _run("run", _recipe(tmp_path, "gguf-q4_0"), "--model", str(small_checkpoint), "--output", str(out), *RUN)
    (file,) = out.glob("*.gguf")
    types = {t.name: t.type_name for t in read_gguf_index(file).tensors}
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == "Q4_0"
    reloaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=file.name)  # transformers reads Q8_0 too
    want = AutoModelForCausalLM.from_pretrained(small_checkpoint).model.embed_tokens.weight.detach()
    got = reloaded.model.embed_tokens.weight.detach().float()
    assert float((got - want).abs().max()) <= float(want.abs().max()) / 127 + 1e-6  # one Q8_0 step
    result = CliRunner().invoke(app, ["run", _recipe(tmp_path, "compressed-tensors"), "--model", str(small_checkpoint),
                                      "--output", str(tmp_path / "ct"), *RUN])
    assert result.exit_code == 1
    assert "embedding_bits 8 is refused" in result.output and "GGUF stores it as Q8_0" in result.output
    assert not (tmp_path / "ct").exists()


def test_cast_tensors_are_converted_only_when_written() -> None:
    """A cast export holds one converted tensor at a time: CastSource hands out lazy entries,
    which make the same tensor the cast would."""
    from optc.export.source import CastSource, ModelSource
    from optc.model.safetensors_io import Lazy
    from optc.testing import tiny_model

    model = tiny_model("llama")
    src = CastSource(ModelSource(model), torch.bfloat16, keep={"model.layers.0.mlp.up_proj.weight"})
    for key in src.keys():
        e = src.entry(key)
        if key == "model.layers.0.mlp.up_proj.weight":
            assert isinstance(e, torch.Tensor) and e.dtype == torch.float32
            continue
        assert isinstance(e, Lazy) and (e.dtype, e.shape) == (torch.bfloat16, tuple(src.tensor(key).shape))
        assert torch.equal(e.make(), model.state_dict()[key].to(torch.bfloat16))
