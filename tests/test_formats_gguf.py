"""GGUF export (Q4_0, Q8_0, F16): blocks proven by a reference decoder written here from the ggml
block definitions, by the ``gguf`` package's reader and by transformers' own GGUF loader.

Block definitions (ggml ``ggml-common.h``): ``block_q4_0 {ggml_half d; uint8_t qs[16];}`` with
element ``j`` in the low nibble of ``qs[j]`` and element ``j + 16`` in its high nibble,
``x = d * (nibble - 8)``; ``block_q8_0 {ggml_half d; int8_t qs[32];}``, ``x = d * q``. llama.cpp's
converter permutes the rows of ``q_proj``/``k_proj`` per head: ``w.reshape(heads, 2, rows // heads
// 2, K).swapaxes(1, 2)``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from optc.compress.quant import QuantParams, dequantize, quantize
from optc.errors import OptcError
from optc.export.convert import export_model
from optc.export.gguf_format import write_gguf
from test_formats_support import (  # noqa: F401 - fixtures
    TEXT,
    fp16_tolerance,
    logits,
    quantize_rtn,
    tiny_ids,
    tiny_lm,
    tiny_tokenizer,
)

BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34}


def ref_decode(raw: np.ndarray, kind: str, k: int) -> torch.Tensor:
    """Float weights [N, K] of raw blocks, read byte by byte from the block definition."""
    out = np.zeros((raw.shape[0], k), dtype=np.float32)
    size = BLOCK_BYTES[kind]
    for r, row in enumerate(raw):
        for b in range(k // 32):
            blk = row[b * size : (b + 1) * size]
            d = float(np.frombuffer(blk[:2].tobytes(), dtype="<f2")[0])
            if kind == "Q4_0":
                qs = [int(x) for x in blk[2:]]
                vals = [(x & 0xF) - 8 for x in qs] + [(x >> 4) - 8 for x in qs]
            else:
                vals = list(np.frombuffer(blk[2:].tobytes(), dtype=np.int8))
            out[r, b * 32 : (b + 1) * 32] = [d * v for v in vals]
    return torch.from_numpy(out)


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def expected_weight(w: torch.Tensor, p: QuantParams) -> torch.Tensor:
    p16 = QuantParams(p.scheme, p.scale.half().float(), p.zero, p.g_idx)
    return dequantize(quantize(w, p), p16)


def gguf_tensors(path) -> dict:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(str(path)).tensors}


def test_q4_0_from_symmetric_4bit_is_exact(tiny_lm, tiny_tokenizer, tiny_ids, tmp_path) -> None:
    from gguf import dequantize as gguf_dequantize

    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, bits=4, symmetric=True, group_size=64)
    summary = write_gguf(model, tiny_tokenizer, tmp_path / "m.gguf", "q4_0", qparams)
    assert summary["modules"] == {"exact": 14} and not summary["requantized"]

    # The gguf package's reader, and the block definition decoded by hand.
    tensors = gguf_tensors(tmp_path / "m.gguf")
    assert "output.weight" not in tensors  # tied head
    assert tensors["token_embd.weight"].tensor_type.name == "F16"
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    cfg = model.config
    for hf, gg, heads in [("model.layers.0.self_attn.q_proj", "blk.0.attn_q", cfg.num_attention_heads),
                          ("model.layers.1.self_attn.k_proj", "blk.1.attn_k", cfg.num_key_value_heads),
                          ("model.layers.1.mlp.down_proj", "blk.1.ffn_down", 0)]:
        t = tensors[f"{gg}.weight"]
        assert t.tensor_type.name == "Q4_0"
        want = expected_weight(model.get_submodule(hf).weight, qparams[hf])
        if heads:
            want = llama_cpp_permute(want, heads)
        k = want.shape[1]
        raw = np.asarray(t.data).reshape(want.shape[0], -1)
        assert torch.equal(ref_decode(raw, "Q4_0", k), want), hf
        assert torch.equal(torch.from_numpy(gguf_dequantize(raw, t.tensor_type)).reshape(want.shape), want)

    # transformers' GGUF loader: weights exactly optc's grid (scales in float16), same logits.
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
    for name, p in qparams.items():
        assert torch.equal(reloaded.get_submodule(name).weight, expected_weight(model.get_submodule(name).weight, p)), name
    ref = logits(model, tiny_ids)
    assert (logits(reloaded, tiny_ids) - ref).abs().max() <= fp16_tolerance(ref)
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert tok(TEXT).input_ids == tiny_tokenizer(TEXT).input_ids


@pytest.mark.parametrize(("scheme", "qtype"), [
    ({"bits": 4, "symmetric": False, "group_size": 32}, "q8_0"),  # q - z in [-15, 15] fits int8
    ({"bits": 8, "symmetric": True, "group_size": None}, "q8_0"),  # per channel: one d for all blocks
    ({"bits": 3, "symmetric": True, "group_size": 128}, "q4_0"),
])
def test_other_exact_mappings(tiny_lm, tiny_tokenizer, tiny_ids, tmp_path, scheme, qtype) -> None:
    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, **scheme)
    summary = write_gguf(model, tiny_tokenizer, tmp_path / "m.gguf", qtype, qparams)
    assert summary["modules"] == {"exact": 14}
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
    name = "model.layers.0.mlp.gate_proj"
    assert torch.equal(reloaded.get_submodule(name).weight, expected_weight(model.get_submodule(name).weight, qparams[name]))
    ref = logits(model, tiny_ids)
    assert (logits(reloaded, tiny_ids) - ref).abs().max() <= fp16_tolerance(ref)


def test_float_model_q4_0_is_llama_cpp_rounding_and_f16_is_float16(tiny_lm, tiny_tokenizer, tiny_ids, tmp_path) -> None:
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize
    from gguf import quantize as gguf_quantize

    summary = write_gguf(tiny_lm, tiny_tokenizer, tmp_path / "rtn.gguf", "q4_0")
    assert summary["modules"] == {"rounded": 14}
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="rtn.gguf").eval()
    w = tiny_lm.get_submodule("model.layers.0.mlp.up_proj").weight.detach().numpy()
    rtn = gguf_dequantize(gguf_quantize(w, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    assert torch.equal(reloaded.get_submodule("model.layers.0.mlp.up_proj").weight, torch.from_numpy(rtn))

    write_gguf(tiny_lm, tiny_tokenizer, tmp_path / "f16.gguf", "f16")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="f16.gguf").eval()
    ref = logits(tiny_lm, tiny_ids)
    assert (logits(reloaded, tiny_ids) - ref).abs().max() <= fp16_tolerance(ref)


@pytest.mark.parametrize(("scheme", "reason"), [
    ({"bits": 4, "symmetric": False, "group_size": 32}, r"\[-15, 15\], Q4_0 blocks hold \[-8, 7\]"),
    ({"bits": 8, "symmetric": True, "group_size": 32}, r"\[-128, 127\], Q4_0"),
    ({"bits": 4, "symmetric": True, "group_size": 16}, "split Q4_0's 32-weight blocks"),
])
def test_grids_q4_0_cannot_hold_are_refused_or_requantized(tiny_lm, tiny_tokenizer, tmp_path, scheme, reason) -> None:
    from optc.export.checkpoint import staged_output

    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, **scheme)
    with pytest.raises(OptcError, match=reason):
        with staged_output(tmp_path / "out", overwrite=False) as tmp:
            export_model(model, tiny_tokenizer, qparams, "gguf-q4_0", tmp)
    assert list(tmp_path.iterdir()) == []
    summary = write_gguf(model, tiny_tokenizer, tmp_path / "m.gguf", "q4_0", qparams, requantize=True)
    assert summary["modules"] == {"requantized": 14} and len(summary["requantized"]) == 14


def test_architectures_without_llama_layout_are_refused(tmp_path, tiny_tokenizer) -> None:
    from optc.testing import tiny_model

    with pytest.raises(OptcError, match="Llama-family"):
        write_gguf(tiny_model("opt"), tiny_tokenizer, tmp_path / "m.gguf", "f16")
    assert not (tmp_path / "m.gguf").exists()


def _pre_type(path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["tokenizer.ggml.pre"]
    return bytes(field.parts[field.data[0]]).decode()


def test_pre_tokenizer_is_a_name_llama_cpp_knows(tiny_lm, tiny_tokenizer, tmp_path) -> None:
    """A plain byte-level tokenizer is llama.cpp's ``gpt-2`` (it refuses ``gpt2``); a GGUF source's
    own name (kept by the loader in the tokenizer's config) wins over the guess."""
    write_gguf(tiny_lm, tiny_tokenizer, tmp_path / "a.gguf", "f16")
    assert _pre_type(tmp_path / "a.gguf") == "gpt-2"
    tiny_tokenizer.init_kwargs["gguf_pre_tokenizer"] = "smollm"
    try:
        write_gguf(tiny_lm, tiny_tokenizer, tmp_path / "b.gguf", "f16")
    finally:
        del tiny_tokenizer.init_kwargs["gguf_pre_tokenizer"]
    assert _pre_type(tmp_path / "b.gguf") == "smollm"


def test_default_model_keeps_its_gguf_pre_tokenizer(default_tokenizer) -> None:
    from optc.export.gguf_format import tokenizer_metadata

    assert tokenizer_metadata(default_tokenizer)["pre"] == "smollm"


@pytest.mark.real_model
def test_real_model_q4_0_reloads_with_same_logits(default_model, tmp_path) -> None:
    model, qparams = quantize_rtn(default_model.model, default_model.tokenizer, bits=4, group_size=32)
    summary = export_model(model, default_model.tokenizer, qparams, "gguf-q4_0", tmp_path)
    assert summary["modules"] == {"exact": 210}
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=summary["file"]).eval()
    ids = default_model.tokenizer("The capital of France is Paris, and", return_tensors="pt").input_ids
    ref = logits(model, ids)
    assert (logits(reloaded, ids) - ref).abs().max() <= fp16_tolerance(ref)
    name = "model.layers.11.self_attn.q_proj"
    assert torch.equal(reloaded.get_submodule(name).weight, expected_weight(model.get_submodule(name).weight, qparams[name]))
