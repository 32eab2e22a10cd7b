"""GGUF export (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16): blocks proven by a reference decoder written
here from the ggml block definitions, by the ``gguf`` package's reader and by transformers' own
GGUF loader.

Block definitions (ggml ``ggml-common.h``): ``block_q4_0 {ggml_half d; uint8_t qs[16];}`` with
element ``j`` in the low nibble of ``qs[j]`` and element ``j + 16`` in its high nibble,
``x = d * (nibble - 8)``; ``block_q4_1 {ggml_half d, m; uint8_t qs[16];}``, ``x = d * nibble + m``;
``block_q5_0 {ggml_half d; uint8_t qh[4]; uint8_t qs[16];}``, the fifth bit of element ``j`` at
bit ``j`` of the little-endian ``qh``, ``x = d * (u - 16)``; ``block_q5_1 {ggml_half d, m;
uint8_t qh[4]; uint8_t qs[16];}``, ``x = d * u + m``; ``block_q8_0 {ggml_half d; int8_t qs[32];}``,
``x = d * q``. llama.cpp's
converter permutes the rows of ``q_proj``/``k_proj`` per head: ``w.reshape(heads, 2, rows // heads
// 2, K).swapaxes(1, 2)``.
"""

from __future__ import annotations

import re

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

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}


def ref_decode(raw: np.ndarray, kind: str, k: int) -> torch.Tensor:
    """Float weights [N, K] of raw blocks, read byte by byte from the block definition."""
    out = np.zeros((raw.shape[0], k), dtype=np.float32)
    size = BLOCK_BYTES[kind]
    for r, row in enumerate(raw):
        for b in range(k // 32):
            blk = row[b * size : (b + 1) * size].tobytes()
            half = np.frombuffer(blk[:4], dtype="<f2").astype(np.float32)
            d, m = float(half[0]), float(half[1])
            if kind == "Q8_0":
                vals = [d * v for v in np.frombuffer(blk[2:], dtype=np.int8)]
            else:
                with_min = kind in ("Q4_1", "Q5_1")
                rest = blk[4:] if with_min else blk[2:]
                qh = int.from_bytes(rest[:4], "little") if kind.startswith("Q5") else 0
                qs = rest[4:] if kind.startswith("Q5") else rest
                us = [x & 0xF for x in qs] + [x >> 4 for x in qs]
                us = [u | (((qh >> j) & 1) << 4) for j, u in enumerate(us)]
                offset = 0 if with_min else (16 if kind == "Q5_0" else 8)
                # float32 arithmetic, as ggml's dequantize computes it
                vals = [np.float32(d) * np.float32(u - offset) + (np.float32(m) if with_min else np.float32(0))
                        for u in us]
            out[r, b * 32 : (b + 1) * 32] = vals
    return torch.from_numpy(out)


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def expected_weight(w: torch.Tensor, p: QuantParams, with_min: bool = False) -> torch.Tensor:
    """optc's grid with float16 scales; for a type with a min, ``d * (q - qmin) + m`` with the
    min ``m = d * (qmin - z)`` rounded to float16 as the block stores it."""
    p16 = QuantParams(p.scheme, p.scale.half().float(), p.zero, p.g_idx)
    if not with_min:
        return dequantize(quantize(w, p), p16)
    g = p.g_idx.long()
    d = p16.scale[:, g]
    m = (d * (p.scheme.qmin - p.zero[:, g].float())).half().float()
    return (quantize(w, p).float() - p.scheme.qmin) * d + m


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
    ({"bits": 5, "symmetric": True, "group_size": 32}, "q5_0"),
    ({"bits": 4, "symmetric": False, "group_size": 64}, "q5_0"),  # q - z in [-15, 15] fits [-16, 15]
    ({"bits": 4, "symmetric": False, "group_size": 32}, "q4_1"),
    ({"bits": 4, "symmetric": True, "group_size": 64}, "q4_1"),
    ({"bits": 5, "symmetric": False, "group_size": 32}, "q5_1"),
    ({"bits": 3, "symmetric": False, "group_size": 96}, "q5_1"),
])
def test_other_exact_mappings(tiny_lm, tiny_tokenizer, tiny_ids, tmp_path, scheme, qtype) -> None:
    from gguf import dequantize as gguf_dequantize

    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, **scheme)
    summary = write_gguf(model, tiny_tokenizer, tmp_path / "m.gguf", qtype, qparams)
    assert summary["modules"] == {"exact": 14}
    with_min = qtype in ("q4_1", "q5_1")
    name = "model.layers.0.mlp.gate_proj"
    want = expected_weight(model.get_submodule(name).weight, qparams[name], with_min)
    t = gguf_tensors(tmp_path / "m.gguf")["blk.0.ffn_gate.weight"]
    assert t.tensor_type.name == qtype.upper()
    raw = np.asarray(t.data).reshape(want.shape[0], -1)
    assert raw.shape[1] == want.shape[1] // 32 * BLOCK_BYTES[qtype.upper()]
    assert torch.equal(ref_decode(raw, qtype.upper(), want.shape[1]), want)
    assert torch.equal(torch.from_numpy(gguf_dequantize(raw, t.tensor_type)).reshape(want.shape), want)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
    assert torch.equal(reloaded.get_submodule(name).weight, want)
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


@pytest.mark.parametrize(("fmt", "scheme", "reason"), [
    ("gguf-q4_1", {"bits": 5, "symmetric": False, "group_size": 32}, "need 5-bit integers, Q4_1 blocks hold 4"),
    ("gguf-q5_0", {"bits": 5, "symmetric": False, "group_size": 32}, r"\[-31, 31\], Q5_0 blocks hold \[-16, 15\]"),
    ("gguf-q5_1", {"bits": 5, "symmetric": False, "group_size": 16}, "groups of 16 split Q5_1's"),
    ("gguf-q5_1", {"bits": 5, "symmetric": False, "group_size": 64}, None),
    ("gguf-q4_1", {"bits": 4, "symmetric": True, "group_size": None}, None),
])
def test_schemes_each_block_type_holds_are_known_before_calibration(fmt, scheme, reason) -> None:
    from optc.compress.quant import QuantScheme
    from optc.export.formats import FORMATS

    got = FORMATS[fmt].fits(QuantScheme(**scheme), False)
    assert (got is None) if reason is None else re.search(reason, got), got
