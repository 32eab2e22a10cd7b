"""GPTQ format (AutoGPTQ / GPTQModel v1): layout proven by a reference unpacker written here from
the published pack loop, and the reloaded model computing what optc's in-memory model computes.

The reference reads AutoGPTQ's ``QuantLinear.pack()`` backwards (``qlinear_cuda_old.py``): for 2/4/8
bits ``qweight[row] |= intweight[j] << (bits * (j - i))`` over ``32 / bits`` consecutive input rows;
for 3 bits the 10 / 1 / 10 / 1 / 10 sequence across three words; ``qzeros`` the same along the
output dimension after ``zeros -= 1`` (v1); dequantization ``scales[g_idx] * (q - (zeros + 1))``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from optc.compress.quant import QuantParams, QuantScheme, dequantize, quantize
from optc.errors import OptcError
from optc.export.convert import export_model
from optc.export.formats import FORMATS
from optc.export.gptq_format import write_gptq
from optc.export.load import load_checkpoint as load_model
from optc.export.packing import pack_qzeros, v1_representable
from optc.methods import Workspace
from optc.methods.gptq import GPTQStage, run_gptq
from test_formats_support import (  # noqa: F401 - fixtures
    fp16_tolerance,
    logits,
    quantize_rtn,
    tiny_ids,
    tiny_lm,
    tiny_tokenizer,
)


def _u32(word: int) -> int:
    return word & 0xFFFFFFFF


def ref_unpack_column(words: list[int], bits: int) -> list[int]:
    """Unsigned values of one packed column (consecutive words), as AutoGPTQ's pack wrote them."""
    mask = (1 << bits) - 1
    out: list[int] = []
    if bits in (2, 4, 8):
        for w in words:
            out += [(_u32(w) >> (bits * i)) & mask for i in range(32 // bits)]
        return out
    assert bits == 3
    for r in range(0, len(words), 3):
        w0, w1, w2 = (_u32(w) for w in words[r : r + 3])
        out += [(w0 >> (3 * j)) & 7 for j in range(10)]
        out.append((w0 >> 30) | ((w1 & 1) << 2))  # element 10: two bits, then one
        out += [(w1 >> (3 * j + 1)) & 7 for j in range(10)]
        out.append((w1 >> 31) | ((w2 & 3) << 1))  # element 21: one bit, then two
        out += [(w2 >> (3 * j + 2)) & 7 for j in range(10)]
    return out


def ref_dequantize(tensors: dict[str, torch.Tensor], name: str, bits: int) -> torch.Tensor:
    """W [N, K] from a GPTQ v1 module, following the reference PyTorch dequantization."""
    qweight, qzeros = tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"]
    scales, g_idx = tensors[f"{name}.scales"].float(), tensors[f"{name}.g_idx"].long()
    n = scales.shape[1]
    q = torch.tensor([ref_unpack_column(qweight[:, c].tolist(), bits) for c in range(n)])  # [N, K]
    zeros = torch.tensor([ref_unpack_column(row, bits)[:n] for row in qzeros.tolist()]) + 1  # [G, N]
    return (scales[g_idx].t() * (q - zeros[g_idx].t())).float()


def load_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def expected_weight(w: torch.Tensor, p: QuantParams) -> torch.Tensor:
    """optc's dequantized weight with the scales rounded to float16, as the format stores them."""
    p16 = QuantParams(p.scheme, p.scale.half().float(), p.zero, p.g_idx)
    return dequantize(quantize(w, p), p16)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_layout_matches_reference_unpacker(tiny_lm, tiny_tokenizer, tiny_ids, tmp_path, bits, symmetric) -> None:
    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, bits=bits, symmetric=symmetric, group_size=32)
    summary = write_gptq(model, qparams, tmp_path)
    assert summary["modules"] == 14
    tensors = load_tensors(tmp_path)
    for name, p in qparams.items():
        w = model.get_submodule(name).weight
        k = w.shape[1]
        assert tensors[f"{name}.qweight"].shape == (k * bits // 32, w.shape[0])
        assert tensors[f"{name}.scales"].dtype == torch.float16
        assert torch.equal(ref_dequantize(tensors, name, bits), expected_weight(w, p)), name
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((tmp_path / "quantize_config.json").read_text())
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == ("gptq", bits, 32, symmetric, False)
    assert qc["checkpoint_format"] == "gptq"

    # optc's own reader gives back a model computing the same logits.
    tiny_tokenizer.save_pretrained(tmp_path)
    reloaded = load_model(str(tmp_path))
    assert set(reloaded.qparams) == set(qparams)
    ref = logits(model, tiny_ids)
    assert (logits(reloaded.model, tiny_ids) - ref).abs().max() <= fp16_tolerance(ref)


def test_symmetric_4bit_zeros_are_0x77777777(tiny_lm, tiny_tokenizer, tmp_path) -> None:
    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, bits=4, symmetric=True, group_size=64)
    write_gptq(model, qparams, tmp_path)
    qzeros = load_tensors(tmp_path)["model.layers.0.mlp.up_proj.qzeros"]
    # v1: the symmetric zero 8 is stored as 7 in every nibble.
    assert {_u32(w) for w in qzeros.flatten().tolist()} == {0x77777777}


def test_act_order_permuted_groups_carry_g_idx(tiny_lm, tiny_tokenizer, tiny_ids, tmp_path) -> None:
    import copy

    from optc.testing import tiny_tokens

    model = copy.deepcopy(tiny_lm)
    ws = Workspace(model, tiny_tokenizer)
    ws._ids = tiny_tokens(8, 32) % len(tiny_tokenizer)
    run_gptq(ws, GPTQStage(type="gptq", scheme={"bits": 4, "group_size": 32}, groups="permuted"))
    assert any(p.actorder for p in ws.qparams.values())
    write_gptq(model, ws.qparams, tmp_path)
    tensors = load_tensors(tmp_path)
    name = next(n for n, p in ws.qparams.items() if p.actorder)
    g_idx = tensors[f"{name}.g_idx"]
    assert not torch.equal(g_idx, torch.arange(g_idx.numel(), dtype=torch.int32) // 32)
    assert torch.equal(ref_dequantize(tensors, name, 4), expected_weight(model.get_submodule(name).weight, ws.qparams[name]))
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["desc_act"] is True
    tiny_tokenizer.save_pretrained(tmp_path)
    ref = logits(model, tiny_ids)
    assert (logits(load_model(str(tmp_path)).model, tiny_ids) - ref).abs().max() <= fp16_tolerance(ref)


def _one_group(codes: list[int], zero: int, bits: int = 4) -> tuple[torch.Tensor, QuantParams]:
    scheme = QuantScheme(bits=bits, symmetric=False, group_size=len(codes))
    q = torch.tensor([codes], dtype=torch.int8)
    p = QuantParams(scheme, torch.ones(1, 1), torch.tensor([[zero]], dtype=torch.int32),
                    torch.zeros(len(codes), dtype=torch.int32))
    return q, p


def test_v1_zero_point_zero_is_shifted_exactly_or_refused() -> None:
    # Unsigned zero 0 (signed -8) cannot be stored as zero - 1; codes below the top shift exactly.
    q, p = _one_group([-8, -3, 6], zero=-8)
    q2, p2 = v1_representable(q, p, "m")
    assert int(p2.zero) == -7 and q2.tolist() == [[-7, -2, 7]]
    assert torch.equal(dequantize(q2, p2), dequantize(q, p))
    stored = pack_qzeros(p2.zero.expand(8, 1), 4)
    assert _u32(int(stored[0, 0])) == 0  # unsigned zero 1, stored as 0
    q, p = _one_group([-8, 7], zero=-8)  # uses the top code: no exact shift exists
    with pytest.raises(OptcError, match="zero point 0"):
        v1_representable(q, p, "m")


def test_zero_points_v1_cannot_hold_make_a_v2_checkpoint(tiny_lm, tiny_tokenizer, tiny_ids, tmp_path) -> None:
    """A group of non-negative weights has unsigned zero point 0 and uses the top code: v1's
    ``zero - 1`` cannot hold it, so the checkpoint is gptq_v2, zero points stored as they are."""
    import copy

    base = copy.deepcopy(tiny_lm)
    name = "model.layers.0.mlp.up_proj"
    with torch.no_grad():
        base.get_submodule(name).weight[0, :32].abs_()
    model, qparams = quantize_rtn(base, tiny_tokenizer, bits=4, symmetric=False, group_size=32)
    assert int(qparams[name].zero[0, 0]) == qparams[name].scheme.qmin
    summary = write_gptq(model, qparams, tmp_path)
    assert summary["format"] == "gptq/gptq_v2"
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["checkpoint_format"] == "gptq_v2"
    tensors = load_tensors(tmp_path)
    zeros = torch.tensor([ref_unpack_column(row, 4)[:qparams[name].scale.shape[0]] for row in tensors[f"{name}.qzeros"].tolist()])
    assert int(zeros[0, 0]) == 0  # stored as it is (v1 would store -1)
    tiny_tokenizer.save_pretrained(tmp_path)
    ref = logits(model, tiny_ids)
    assert (logits(load_model(str(tmp_path)).model, tiny_ids) - ref).abs().max() <= fp16_tolerance(ref)


def test_refusals_write_nothing(tiny_lm, tiny_tokenizer, tmp_path) -> None:
    from optc.export.checkpoint import staged_output

    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, bits=5, group_size=32)
    target = tmp_path / "five"
    with pytest.raises(OptcError, match="2/3/4/8-bit"):
        with staged_output(target, overwrite=False) as tmp:
            export_model(model, tiny_tokenizer, qparams, "gptq", tmp)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def ref_module_setting(qc: dict, name: str) -> tuple | None:
    """The published ``dynamic`` rule (GPTQModel ``dynamic_get``, vLLM ``get_dynamic_override``):
    the first key whose regex ``re.match``es the name; ``-:`` keys leave the module unquantized."""
    import re

    for key, overrides in (qc.get("dynamic") or {}).items():
        negative = key.startswith("-:")
        if re.match(key[2:] if key[:2] in ("-:", "+:") else key, name):
            if negative:
                return None
            qc = {**qc, **overrides}
            break
    return qc["bits"], qc["group_size"], qc["sym"]


def test_mixed_schemes_and_float_linears_go_in_the_dynamic_map(tiny_lm, tiny_tokenizer, tiny_ids, tmp_path) -> None:
    """A mix: most modules int4 g32, down_projs int8 g64, layer 1's q/k/v int2 g32 (one key that
    also names vLLM's fused qkv_proj), one o_proj left float; each module dequantizes, by the
    reference unpacker and the published matching rule, to what optc computed."""
    import re

    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, bits=4, group_size=32)
    _, eight = quantize_rtn(tiny_lm, tiny_tokenizer, bits=8, group_size=64)
    _, two = quantize_rtn(tiny_lm, tiny_tokenizer, bits=2, group_size=32)
    for name in qparams:
        source = eight if "down_proj" in name else two if re.search(r"layers\.1\.self_attn\.[qkv]_proj", name) else None
        if source is not None:
            qparams[name] = source[name]
            model.get_submodule(name).weight.data.copy_(dequantize(quantize(tiny_lm.get_submodule(name).weight, source[name]),
                                                                   source[name]))
    floating = "model.layers.0.self_attn.o_proj"
    del qparams[floating]
    model.get_submodule(floating).weight.data.copy_(tiny_lm.get_submodule(floating).weight)
    summary = write_gptq(model, qparams, tmp_path)
    assert summary["modules"] == 13 and summary["dynamic"] == 4
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["group_size"], qc["sym"]) == (4, 32, True)
    assert "+:" + re.escape("model.layers.1.self_attn") + r"\.(?:q_proj|k_proj|v_proj|qkv_proj)$" in qc["dynamic"]
    fused = next(k for k in qc["dynamic"] if "qkv" in k)
    assert re.match(fused[2:], "model.layers.1.self_attn.qkv_proj")  # the name vLLM asks with
    assert not re.match(fused[2:], "model.layers.11.self_attn.q_proj")
    tensors = load_tensors(tmp_path)
    assert ref_module_setting(qc, floating) is None and f"{floating}.qweight" not in tensors
    stored = tensors[f"{floating}.weight"]
    assert torch.equal(stored, tiny_lm.get_submodule(floating).weight.detach().to(stored.dtype))
    for name, p in qparams.items():
        bits, group, sym = ref_module_setting(qc, name)
        assert (bits, group, sym) == (p.scheme.bits, p.scheme.group_size, p.scheme.symmetric), name
        w = model.get_submodule(name).weight
        assert torch.equal(ref_dequantize(tensors, name, bits), expected_weight(w, p)), name
    tiny_tokenizer.save_pretrained(tmp_path)
    reloaded = load_model(str(tmp_path))
    assert set(reloaded.qparams) == set(qparams)
    ref = logits(model, tiny_ids)
    assert (logits(reloaded.model, tiny_ids) - ref).abs().max() <= fp16_tolerance(ref)
    info = FORMATS["gptq"].describe(tmp_path)
    assert info["bits"] == [2, 4, 8] and info["ignore"] == [re.escape(floating) + "$"]


def test_dimensions_must_fill_32_element_blocks(tmp_path) -> None:
    from optc.testing import tiny_model

    model = tiny_model("llama")  # intermediate size 200
    _, qparams = quantize_rtn(model, None, bits=4, group_size=32)
    with pytest.raises(OptcError, match="multiples of 32"):
        write_gptq(model, qparams, tmp_path)


@pytest.mark.real_model
def test_real_model_gptq_checkpoint_reloads_with_same_logits(default_model, tmp_path) -> None:
    model, qparams = quantize_rtn(default_model.model, default_model.tokenizer, bits=4, group_size=128)
    summary = export_model(model, default_model.tokenizer, qparams, "gptq", tmp_path)
    # K=576 is not a multiple of 128: stored exactly with groups of 64, one group size for all.
    assert summary["scheme"] == "int4-sym-g64" and summary["modules"] == 210
    reloaded = load_model(str(tmp_path))
    ids = default_model.tokenizer("The capital of France is Paris, and", return_tensors="pt").input_ids
    ref = logits(model, ids)
    assert (logits(reloaded.model, ids) - ref).abs().max() <= fp16_tolerance(ref)
    tensors = load_tensors(tmp_path)
    name = "model.layers.3.self_attn.k_proj"
    assert torch.equal(ref_dequantize(tensors, name, 4), expected_weight(model.get_submodule(name).weight, qparams[name]))


def test_stored_bits_of_a_mix() -> None:
    """What a budget counts for one Linear in a GPTQ mix: codes, zero points and float16 scales
    per group, int32 g_idx; None for what the layout or GPTQModel's kernels cannot hold."""
    stored = FORMATS["gptq"].stored_bits
    s4 = QuantScheme(bits=4, group_size=64)
    assert stored(s4, 64, 128, 16, False) == 128 * 64 * 4 + 2 * 64 * (4 + 16) + 32 * 128
    assert stored(QuantScheme(bits=3, symmetric=False, group_size=None), 64, 128, 16, False) == 128 * 64 * 3 + 64 * 19 + 32 * 128
    assert stored(None, 64, 160, 16, False) == 64 * 160 * 16  # left float: the plain weight
    assert stored(s4, 64, 160, 16, False) is None  # groups of 64 do not divide 160 columns
    assert stored(QuantScheme(bits=4, group_size=96), 64, 192, 16, False) is None  # not a power of two
    assert stored(QuantScheme(bits=5, group_size=64), 64, 128, 16, False) is None
    assert stored(s4, 48, 128, 16, False) is None  # 48 outputs do not fill 32-element blocks


def test_warns_when_vllm_fused_shards_differ(tiny_lm, tiny_tokenizer, caplog) -> None:
    from optc.export.source import ModelSource, warn_unfused

    model, qparams = quantize_rtn(tiny_lm, tiny_tokenizer, bits=4, group_size=32)
    assert warn_unfused(ModelSource(model, None, qparams), "gptq") == 0
    _, eight = quantize_rtn(tiny_lm, tiny_tokenizer, bits=8, group_size=32)
    qparams["model.layers.1.self_attn.v_proj"] = eight["model.layers.1.self_attn.v_proj"]
    del qparams["model.layers.0.mlp.up_proj"]  # left float beside a quantized gate_proj
    with caplog.at_level("WARNING"):
        assert warn_unfused(ModelSource(model, None, qparams), "gptq") == 2
    assert "2 sets of Linears that vLLM fuses" in caplog.text and "gate_up_proj" in caplog.text
