"""AWQ GEMM format (AutoAWQ): layout proven by a reference unpacker written here from the published
layout, and the reloaded model computing what optc's in-memory model computes.

The reference reads AutoAWQ's ``WQLinear_GEMM.from_linear`` backwards: for each block of 8 output
columns, ``qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)`` with
``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``; ``qzeros`` the same, zero points stored as they are;
dequantization ``(q - z) * s`` per group of input rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from optc.compress.quant import QuantParams, dequantize, quantize
from optc.errors import OptcError
from optc.export.awq_format import write_awq
from optc.export.convert import export_model
from optc.export.load import load_checkpoint as load_model
from test_formats_support import (  # noqa: F401 - fixtures
    fp16_tolerance,
    logits,
    quantize_rtn,
    tiny_ids,
    tiny_lm,
    tiny_tokenizer,
)

ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


def ref_unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values [R, 8 * words] of AWQ-packed rows."""
    rows = []
    for words in packed.tolist():
        row = [0] * (8 * len(words))
        for col, w in enumerate(words):
            for i in range(8):
                row[col * 8 + ORDER_MAP[i]] = ((w & 0xFFFFFFFF) >> (4 * i)) & 0xF
        rows.append(row)
    return torch.tensor(rows)


def ref_dequantize(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    q = ref_unpack_rows(tensors[f"{name}.qweight"])  # [K, N]
    z = ref_unpack_rows(tensors[f"{name}.qzeros"])  # [G, N]
    s = tensors[f"{name}.scales"].float()  # [G, N]
    group = q.shape[0] // s.shape[0]
    rows = torch.arange(q.shape[0]) // group
    return ((q - z[rows]) * s[rows]).t()


def load_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def expected_weight(w: torch.Tensor, p: QuantParams) -> torch.Tensor:
    p16 = QuantParams(p.scheme, p.scale.half().float(), p.zero, p.g_idx)
    return dequantize(quantize(w, p), p16)


@pytest.mark.parametrize(("symmetric", "group_size"), [(False, 32), (True, 64), (False, None)])
def test_layout_matches_reference_unpacker(tiny_lm, tiny_tokenizer, tiny_ids, tmp_path, symmetric, group_size) -> None:
    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, bits=4, symmetric=symmetric, group_size=group_size)
    summary = write_awq(model, qparams, tmp_path)
    tensors = load_tensors(tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["version"], qc["bits"], qc["zero_point"]) == ("awq", "gemm", 4, True)
    # Per channel has no AWQ spelling: stored exactly as groups that divide every K (64 here).
    assert qc["group_size"] == (group_size or 64)
    assert summary["scheme"].endswith(f"g{qc['group_size']}")
    assert qc["modules_to_not_convert"] == ["lm_head"]
    for name, p in qparams.items():
        w = model.get_submodule(name).weight
        n, k = w.shape
        assert tensors[f"{name}.qweight"].shape == (k, n // 8)
        assert tensors[f"{name}.qzeros"].shape == (k // qc["group_size"], n // 8)
        assert torch.equal(ref_dequantize(tensors, name), expected_weight(w, p)), name
        if symmetric:
            assert (ref_unpack_rows(tensors[f"{name}.qzeros"]) == 8).all()
    tiny_tokenizer.save_pretrained(tmp_path)
    reloaded = load_model(str(tmp_path))
    ref = logits(model, tiny_ids)
    assert (logits(reloaded.model, tiny_ids) - ref).abs().max() <= fp16_tolerance(ref)


def test_interleave_known_word() -> None:
    from optc.export.packing import pack_awq

    # Columns 0..7 holding signed codes -8..-1 (unsigned 0..7): nibble i holds column ORDER_MAP[i].
    q = torch.arange(-8, 0, dtype=torch.int8)[None]
    word = int(pack_awq(q)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == ORDER_MAP


def test_float_linears_are_listed_not_converted(tiny_lm, tiny_tokenizer, tiny_ids, tmp_path) -> None:
    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, bits=4, group_size=32)
    for name in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"):
        model.get_submodule(name).weight.data.copy_(tiny_lm.get_submodule(name).weight)
        del qparams[name]
    write_awq(model, qparams, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert sorted(qc["modules_to_not_convert"]) == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"]
    tiny_tokenizer.save_pretrained(tmp_path)
    reloaded = load_model(str(tmp_path)).model
    assert torch.equal(reloaded.get_submodule("model.layers.0.mlp.down_proj").weight,
                       tiny_lm.get_submodule("model.layers.0.mlp.down_proj").weight)
    ref = logits(model, tiny_ids)
    assert (logits(reloaded, tiny_ids) - ref).abs().max() <= fp16_tolerance(ref)


@pytest.mark.parametrize(("scheme", "reason"), [
    ({"bits": 3, "group_size": 32}, "4-bit weights only"),
    ({"bits": 8, "group_size": None}, "4-bit weights only"),
])
def test_schemes_awq_cannot_hold_are_refused(tiny_lm, tiny_tokenizer, tmp_path, scheme, reason) -> None:
    from optc.export.checkpoint import staged_output

    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, **scheme)
    target = tmp_path / "out"
    with pytest.raises(OptcError, match=reason):
        with staged_output(target, overwrite=False) as tmp:
            export_model(model, tiny_tokenizer, qparams, "awq", tmp)
    assert list(tmp_path.iterdir()) == []


def test_act_order_groups_are_refused(tiny_lm, tiny_tokenizer, tmp_path) -> None:
    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, bits=4, group_size=32)
    name = "model.layers.0.mlp.up_proj"
    p = qparams[name]
    perm = torch.randperm(p.g_idx.numel(), generator=torch.Generator().manual_seed(0))
    qparams[name] = QuantParams(p.scheme, p.scale, p.zero, p.g_idx[perm])
    with pytest.raises(OptcError, match="act-order"):
        write_awq(model, qparams, tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.real_model
def test_real_model_awq_checkpoint_reloads_with_same_logits(default_model, tmp_path) -> None:
    model, qparams = quantize_rtn(default_model.model, default_model.tokenizer, bits=4, symmetric=False, group_size=64)
    summary = export_model(model, default_model.tokenizer, qparams, "awq", tmp_path)
    assert summary["modules"] == 210 and summary["scheme"] == "int4-asym-g64"
    reloaded = load_model(str(tmp_path))
    ids = default_model.tokenizer("The capital of France is Paris, and", return_tensors="pt").input_ids
    ref = logits(model, ids)
    assert (logits(reloaded.model, ids) - ref).abs().max() <= fp16_tolerance(ref)
    name = "model.layers.7.mlp.up_proj"
    tensors = load_tensors(tmp_path)
    assert torch.equal(ref_dequantize(tensors, name), expected_weight(model.get_submodule(name).weight, qparams[name]))
