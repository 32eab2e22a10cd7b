"""FP8, NVFP4 and MXFP4: the grids against compressed-tensors' own quantize/dequantize, the
on-disk layout, loading in plain transformers, and the refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from optc.compress import fpquant
from optc.compress.actquant import ActivationScheme, InputQuant, dynamic_scale, fake_quantize_activation, quantize_input
from optc.compress.gptq import gptq_quantize
from optc.compress.quant import QuantScheme, choose_qparams, compute_qparams, fake_quantize, quantize
from optc.errors import OptcError
from optc.export.ct_float import pack_nibbles, unpack_nibbles
from optc.export.ct_int import read_compressed_tensors, write_int_quantized
from optc.export.formats import FORMATS
from optc.testing import tiny_model, tiny_tokens

sys.path.insert(0, str(Path(__file__).parent))
from test_compressed_tensors import fake_quantize_model  # noqa: E402

ct_args = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

FP8 = QuantScheme(type="float", bits=8, group_size=None)
NVFP4 = QuantScheme(type="float", bits=4, group_size=16)
MXFP4 = QuantScheme(type="float", bits=4, group_size=32)
CT_ARGS = {
    "fp8": dict(num_bits=8, type="float", strategy="channel", symmetric=True),
    "nvfp4": dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                  scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn),
    "mxfp4": dict(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                  scale_dtype=torch.uint8, zp_dtype=torch.uint8),
}
SCHEMES = {"fp8": FP8, "nvfp4": NVFP4, "mxfp4": MXFP4}


def weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 576, generator=g) * 0.04
    w[5, 17] = 0.8  # an outlier: one group's range far above the rest
    w[7, :32] = 0  # an all-zero group
    return w


def test_e2m1_rounding_matches_compressed_tensors() -> None:
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([ties, -ties, torch.linspace(-8, 8, 4001), torch.randn(5000) * 3])
    assert torch.equal(fpquant.round_e2m1_(x.clone()), cast_to_fp4(x.clone()))
    assert fpquant.round_e2m1_(ties.clone()).tolist() == [0, 1, 1, 2, 2, 4, 4]


def test_e4m3_rounding_saturates() -> None:
    x = torch.tensor([500.0, -1e6, 448.0, 0.1])
    out = fpquant.round_e4m3(x)
    assert out[:3].tolist() == [448.0, -448.0, 448.0]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kind", SCHEMES)
def test_fake_quantize_matches_compressed_tensors(kind: str) -> None:
    """Our scales are theirs (min-max), and our codes times our scales are their fake-quantization."""
    w = weight()
    p = compute_qparams(w, SCHEMES[kind])
    args = ct_args.QuantizationArgs(**CT_ARGS[kind])
    if kind == "nvfp4":
        gs = fpquant.nvfp4_global_scale(p.scale)
        stored = p.scale * gs
        assert torch.equal(fpquant.round_e4m3(stored), stored)  # the stored E4M3 scales are exact
        theirs = ct_fake_quantize(w, stored.to(torch.float8_e4m3fn).float(), torch.zeros_like(p.scale), args,
                                  global_scale=gs)
    else:
        g = args.group_size or w.shape[1]
        wg = w.reshape(w.shape[0], -1, g)
        ct_scale, _ = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
        assert torch.equal(ct_scale.reshape(p.scale.shape), p.scale)
        theirs = ct_fake_quantize(w, p.scale, torch.zeros_like(p.scale), args)
    assert torch.equal(fake_quantize(w, p), theirs)


def test_mx_scales_are_powers_of_two_and_fit() -> None:
    w = weight(1)
    p = compute_qparams(w, MXFP4)
    m, _ = torch.frexp(p.scale)
    assert torch.all(m == 0.5)
    assert torch.equal(fpquant.e8m0_decode(fpquant.e8m0_encode(p.scale)), p.scale)
    q = quantize(w, p)
    assert q.abs().max() <= 6


def test_nibble_packing_matches_compressed_tensors() -> None:
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

    values = fpquant.FP4_CODES
    g = torch.Generator().manual_seed(0)
    q = values[torch.randint(8, (6, 64), generator=g)] * (torch.randint(2, (6, 64), generator=g) * 2 - 1)
    q[q == 0] = 0.0  # no negative zeros: their sign bit would differ from ours, not their value
    packed = pack_nibbles(q)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 32)
    assert torch.equal(packed, pack_fp4_to_uint8(q))
    assert torch.equal(unpack_nibbles(packed), q)
    assert torch.equal(unpack_fp4_from_uint8(packed, 6, 64, dtype=torch.float32), q)
    # The published layout read literally: the even column in the low nibble, bit 3 the sign.
    assert pack_nibbles(torch.tensor([[0.5, -6.0]])).item() == 0x1 | (0x8 | 0x7) << 4


def test_fp8_activations_match_compressed_tensors() -> None:
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    x = torch.randn(4, 7, 64) * 3
    token = ct_args.QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    ct_scale, _ = compute_dynamic_scales_and_zp(x, token, module=torch.nn.Identity())
    ours = dynamic_scale(x, "token", float_grid=True)
    assert torch.allclose(ours, ct_scale, rtol=1e-6)
    assert torch.equal(fake_quantize_activation(x, ours, float_grid=True),
                       ct_fake_quantize(x, ours, None, token))


@pytest.mark.parametrize("kind", SCHEMES)
def test_gptq_on_float_grids_beats_round_to_nearest(kind: str) -> None:
    torch.manual_seed(0)
    w = torch.randn(32, 128)
    x = torch.randn(512, 128) * torch.linspace(0.2, 3, 128)
    H = 2 * x.T @ x / x.shape[0]
    scheme = SCHEMES[kind]
    res = gptq_quantize(w, H, scheme, actorder=False)
    rtn = fake_quantize(w, compute_qparams(w, scheme))

    def err(w_hat: torch.Tensor) -> float:
        return float(((w_hat - w) @ x.T).pow(2).sum())

    assert err(res.weight) < err(rtn)
    # GPTQ's weights lie exactly on the grid of the params it returns (scales stored exactly).
    assert torch.equal(fake_quantize(res.weight, res.params), res.weight)
    if kind == "nvfp4":
        assert torch.equal(fpquant.round_scale_e4m3(res.params.scale), res.params.scale)
    if kind == "mxfp4":
        assert torch.all(torch.frexp(res.params.scale)[0] == 0.5)


def _divisible(scheme: QuantScheme):
    # The tiny model's down_proj has K = 200, which groups of 16 or 32 do not divide.
    return lambda n: FP8 if "down_proj" in n and scheme.bits == 4 else scheme


@pytest.mark.parametrize("kind", SCHEMES)
def test_transformers_loads_float_export(kind: str, tmp_path: Path) -> None:
    model = tiny_model("llama")
    qparams = fake_quantize_model(model, _divisible(SCHEMES[kind]))
    summary = write_int_quantized(model, qparams, {}, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    formats = {g["format"] for g in qc["config_groups"].values()}
    expected = {"fp8": {"float-quantized"}, "nvfp4": {"nvfp4-pack-quantized", "float-quantized"},
                "mxfp4": {"mxfp4-pack-quantized", "float-quantized"}}[kind]
    assert formats == expected and summary["format"] == (expected.pop() if len(expected) == 1 else "mixed-precision")

    m = "model.layers.0.self_attn.q_proj"  # K = 96
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        if kind == "fp8":
            assert f.get_tensor(f"{m}.weight").dtype == torch.float8_e4m3fn
            assert f.get_tensor(f"{m}.weight_scale").shape == (96, 1)
        else:
            assert f.get_tensor(f"{m}.weight_packed").shape == (96, 48)
            scale = f.get_tensor(f"{m}.weight_scale")
            assert scale.dtype == (torch.float8_e4m3fn if kind == "nvfp4" else torch.uint8)
            assert scale.shape == (96, 96 // SCHEMES[kind].group_size)
            assert (f"{m}.weight_global_scale" in f.keys()) == (kind == "nvfp4")

    # optc's reader gives back the in-memory weights exactly.
    state, read, _ = read_compressed_tensors(tmp_path)
    modules = dict(model.named_modules())
    for name, p in qparams.items():
        assert torch.equal(state[f"{name}.weight"], modules[name].weight), name
        assert read[name].scheme == p.scheme

    # compressed-tensors decompresses the 4-bit floats in bfloat16 (the dtype optc stores a
    # GGUF source in); every value of these grids is exact there.
    dtype = torch.float32 if kind == "fp8" else torch.bfloat16
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    if kind != "fp8":
        # compressed-tensors' own dequantization of the tensors it loaded gives our weights exactly.
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
        from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

        params = {n: t for n, t in loaded.named_parameters() if n.startswith(f"{m}.")}
        packed = params[f"{m}.weight_packed"]
        codes = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
        scale = params[f"{m}.weight_scale"]
        assert scale.dtype == (torch.uint8 if kind == "mxfp4" else torch.float8_e4m3fn)  # kept as stored
        scale = fpquant.e8m0_decode(scale) if kind == "mxfp4" else scale.float()
        got = ct_dequantize(codes, scale, args=ct_args.QuantizationArgs(**CT_ARGS[kind]),
                            global_scale=params.get(f"{m}.weight_global_scale"), dtype=torch.float32)
        assert torch.equal(got, modules[m].weight)
    with torch.no_grad():
        ref = model.to(dtype)(tiny_tokens(2, 16)).logits
        out = loaded(tiny_tokens(2, 16)).logits
    assert (out - ref).abs().max().item() < (1e-4 if kind == "fp8" else 2e-2)


def test_fp8_activations_round_trip(tmp_path: Path) -> None:
    model = tiny_model("llama")
    qparams = fake_quantize_model(model, lambda n: FP8)
    static = ActivationScheme(type="float", strategy="tensor")
    dynamic = ActivationScheme(type="float", strategy="token", dynamic=True)
    iq = {n: InputQuant(static, torch.tensor([0.01])) if "mlp" in n else InputQuant(dynamic) for n in qparams}
    write_int_quantized(model, qparams, iq, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    acts = [g["input_activations"] for g in qc["config_groups"].values()]
    assert {(a["type"], a["strategy"], a["dynamic"]) for a in acts} == {("float", "tensor", False),
                                                                         ("float", "token", True)}
    _, _, read = read_compressed_tensors(tmp_path)
    assert {n: (r.scheme, None if r.scale is None else r.scale.tolist()) for n, r in read.items()} == \
        {n: (r.scheme, None if r.scale is None else r.scale.tolist()) for n, r in iq.items()}


def test_refusals() -> None:
    with pytest.raises(ValidationError, match="NVFP4 .* takes group_size 16, got 32"):
        QuantScheme(type="float", bits=4, group_size=32, scale_format="e4m3")
    with pytest.raises(ValidationError, match="MXFP4 .* takes group_size 32, got 64"):
        QuantScheme(type="float", bits=4, group_size=64, scale_format="e8m0")
    with pytest.raises(ValidationError, match="NVFP4 .* or MXFP4"):
        QuantScheme(type="float", bits=4, group_size=128)
    with pytest.raises(ValidationError, match="FP8 weights take float scales"):
        QuantScheme(type="float", bits=8, scale_format="e8m0")
    with pytest.raises(ValidationError, match="bits 8.* or FP4"):
        QuantScheme(type="float", bits=6)
    with pytest.raises(ValidationError, match="symmetric"):
        QuantScheme(type="float", bits=8, symmetric=False)
    with pytest.raises(ValidationError, match="kl observer searches an int8 grid"):
        ActivationScheme(type="float", observer="kl")
    for fmt in ("gptq", "awq", "gguf-q4_0"):
        assert "float grids" in FORMATS[fmt].fits(NVFP4, False)
    assert FORMATS["compressed-tensors"].fits(NVFP4, False) is None
    assert FORMATS["gguf-f16"].fits(NVFP4, False) is None  # dense values hold any grid


def test_non_dividing_rows_are_refused_when_written(tmp_path: Path) -> None:
    model = tiny_model("llama")
    qparams = fake_quantize_model(model, lambda n: NVFP4)  # down_proj: K = 200
    with pytest.raises(OptcError, match="down_proj: nvfp4-g16 needs in_features divisible by 16, got 200"):
        write_int_quantized(model, qparams, {}, tmp_path)


def test_stored_bits_count_the_file(tmp_path: Path) -> None:
    fmt = FORMATS["compressed-tensors"]
    model = tiny_model("llama")
    qparams = fake_quantize_model(model, _divisible(NVFP4))
    write_int_quantized(model, qparams, {}, tmp_path)
    modules = dict(model.named_modules())
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        for name, p in qparams.items():
            n, k = modules[name].weight.shape
            on_disk = sum(f.get_tensor(key).numel() * f.get_tensor(key).element_size() * 8
                          for key in f.keys() if key.startswith(f"{name}.weight"))
            assert fmt.stored_bits(p.scheme, n, k, 16, False) == on_disk, name



def test_non_dividing_rows_are_refused_before_calibration(default_tokenizer, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from optc.cli.main import app

    src = tmp_path / "tiny"  # down_proj is 200 wide: not a multiple of 16
    tiny_model("llama").save_pretrained(src)
    default_tokenizer.save_pretrained(src)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "version: 1\nname: nv\nstages:\n  - type: gptq\n    scheme: {type: float, bits: 4, group_size: 16}\n"
        "    ignore: [lm_head]\nexport: {format: compressed-tensors}\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(recipe), "--model", str(src), "--no-eval",
                                      "--output", str(tmp_path / "out"), "-q", "--samples", "2", "--seqlen", "16"])
    assert result.exit_code != 0
    assert "nvfp4-g16 needs in_features divisible by 16: model.layers.0.mlp.down_proj has 200" in result.output
    assert "(and 1 more Linears)" in result.output and "stage 0" not in result.output
    assert not (tmp_path / "out").exists()


NVFP4_ACT = ActivationScheme(bits=4, type="float", strategy="group", group_size=16, dynamic=True)


def test_nvfp4_activations_match_compressed_tensors() -> None:
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from optc.compress.actquant import fake_quantize_nvfp4, nvfp4_input_global_scale

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 96, generator=g) * 2
    x[0, 1, 16:32] = 0  # an all-zero group: compressed-tensors gives it E4M3's eps as its scale
    x[1, 2, 40] = 30.0  # above the calibrated range: its group scale saturates at 448
    gs = nvfp4_input_global_scale(12.0)
    assert torch.allclose(gs, torch.tensor([448 * 6 / 12.0]))
    args = ct_args.QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                                    symmetric=True, dynamic="local", scale_dtype=torch.float8_e4m3fn,
                                    zp_dtype=torch.float8_e4m3fn)
    scale, _ = compute_dynamic_scales_and_zp(x, args, module=torch.nn.Identity(), global_scale=gs)
    ours = fake_quantize_nvfp4(x, gs)
    assert torch.equal(ours, ct_fake_quantize(x, scale, None, args, global_scale=gs))
    assert ours[1, 2, 40] == pytest.approx(12.0)  # clipped at the calibrated amax
    assert ours[0, 1, 16:32].abs().sum() == 0
    with pytest.raises(ValueError, match="divisible by 16"):
        fake_quantize_nvfp4(torch.randn(2, 40), gs)


def test_nvfp4_activations_load_in_transformers(tmp_path: Path) -> None:
    """W4A4 NVFP4 written by optc: compressed-tensors' forward (its own dynamic group scales
    under our input_global_scale) gives the logits of optc's fake-quantized model."""
    from optc.compress.actquant import attach_input_quant, nvfp4_input_global_scale

    model = tiny_model("llama")
    qparams = fake_quantize_model(model, _divisible(NVFP4))
    modules = dict(model.named_modules())
    iq = {n: InputQuant(NVFP4_ACT, global_scale=nvfp4_input_global_scale(2.5 + i / 10))
          for i, n in enumerate(qparams) if qparams[n].scheme == NVFP4}
    for n, q in iq.items():
        attach_input_quant(modules[n], q)
    write_int_quantized(model, qparams, iq, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    acts = [g["input_activations"] for g in qc["config_groups"].values() if g["input_activations"]]
    assert [(a["num_bits"], a["strategy"], a["dynamic"], a["group_size"]) for a in acts] == \
        [(4, "tensor_group", "local", 16)]
    m = "model.layers.0.self_attn.q_proj"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor(f"{m}.input_global_scale"), iq[m].global_scale)
    _, _, read = read_compressed_tensors(tmp_path)
    assert {n: (r.scheme, r.global_scale.tolist()) for n, r in read.items()} == \
        {n: (r.scheme, r.global_scale.tolist()) for n, r in iq.items()}

    # compressed-tensors decompresses NVFP4 weights in bfloat16 and runs them there. Four-bit
    # inputs turn one bfloat16 ulp into another code, which two random layers amplify (optc's
    # own model in bfloat16 against float32: logits 0.1 apart), so each Linear is compared alone:
    # the same bfloat16 input gives the same output bit for bit.
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        loaded(tiny_tokens(1, 4))  # its Linears take their decompressed weights on a first forward
    theirs = dict(loaded.named_modules())
    x = torch.randn(2, 9, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16) * 3
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.gate_proj"):
        mod = modules[name]
        with torch.no_grad():
            want = torch.nn.functional.linear(quantize_input(x[..., :mod.in_features], iq[name]),
                                              mod.weight.to(torch.bfloat16))
            got = theirs[name](x[..., :mod.in_features])
            weights_only = torch.nn.functional.linear(x[..., :mod.in_features], mod.weight.to(torch.bfloat16))
        assert torch.equal(got, want), name
        assert not torch.allclose(weights_only, want, rtol=1e-2, atol=1e-2), name


def test_nvfp4_activation_refusals() -> None:
    from optc.methods.w8a8 import W8A8Stage

    with pytest.raises(ValidationError, match="4-bit activations are NVFP4"):
        ActivationScheme(bits=4, type="float", strategy="token", dynamic=True)
    with pytest.raises(ValidationError, match="per-group ones"):
        ActivationScheme(type="float", strategy="group", group_size=128, dynamic=True)
    with pytest.raises(ValidationError, match="4-bit activations are NVFP4"):
        ActivationScheme(bits=4, type="float", strategy="group", group_size=32, dynamic=True)
    with pytest.raises(ValidationError, match="mse observer searches an int8 grid"):
        ActivationScheme(bits=4, type="float", strategy="group", group_size=16, dynamic=True, observer="mse")
    with pytest.raises(ValidationError, match="weights are NVFP4 too; scheme is int8"):
        W8A8Stage(type="w8a8", activations=NVFP4_ACT)
    W8A8Stage(type="w8a8", activations=NVFP4_ACT, scheme=NVFP4)


FP8_BLOCK = QuantScheme(type="float", bits=8, group_size=128, block_rows=128)


def _tiles_shared(scale: torch.Tensor, rows: int) -> bool:
    from optc.compress.quant import block_reduce

    return torch.equal(block_reduce(scale, rows, "amax"), scale) and torch.equal(block_reduce(scale, rows, "amin"), scale)


def test_fp8_block_scales_match_compressed_tensors() -> None:
    """One scale per 128 x 128 tile, short tiles where 128 divides neither 200 rows nor 576
    columns: our min-max scales and fake quantization are compressed-tensors' (which pads)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(200, 576, generator=g) * 0.04
    w[150, 530] = 0.9  # an outlier in the short corner tile
    p = compute_qparams(w, FP8_BLOCK)
    assert p.scale.shape == (200, 5) and _tiles_shared(p.scale, 128)
    assert p.scale[199, 4] == pytest.approx(0.9 / 448)
    args = ct_args.QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[128, 128],
                                    symmetric=True)
    tiles = p.scale[::128]
    assert torch.equal(fake_quantize(w, p), ct_fake_quantize(w, tiles, torch.zeros_like(tiles), args))
    mse = choose_qparams(w, FP8_BLOCK, "mse")
    assert _tiles_shared(mse.scale, 128)
    assert (fake_quantize(w, mse) - w).pow(2).sum() <= (fake_quantize(w, p) - w).pow(2).sum()


def test_gptq_and_refit_keep_fp8_tiles() -> None:
    from optc.compress.gptq import refit_scales

    torch.manual_seed(0)
    w = torch.randn(40, 96)
    x = torch.randn(512, 96) * torch.linspace(0.2, 3, 96)
    H = 2 * x.T @ x / x.shape[0]
    scheme = QuantScheme(type="float", bits=8, group_size=32, block_rows=16)
    res = gptq_quantize(w, H, scheme, actorder=False)
    rtn = fake_quantize(w, compute_qparams(w, scheme))
    err = lambda w_hat: float(((w_hat - w) @ x.T).pow(2).sum())  # noqa: E731
    assert err(res.weight) < err(rtn)
    assert _tiles_shared(res.params.scale, 16)
    assert torch.equal(fake_quantize(res.weight, res.params), res.weight)
    w_hat, p = refit_scales(w, H, res.weight, res.params)
    assert _tiles_shared(p.scale, 16) and err(w_hat) <= err(res.weight) * (1 + 1e-6)


def test_fp8_block_export_loads_in_transformers(tmp_path: Path) -> None:
    model = tiny_model("llama")
    scheme = QuantScheme(type="float", bits=8, group_size=32, block_rows=40)  # short tiles
    qparams = fake_quantize_model(model, lambda n: scheme)
    write_int_quantized(model, qparams, {}, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group["weights"]["strategy"] == "block" and group["weights"]["block_structure"] == [40, 32]
    m = "model.layers.0.mlp.down_proj"
    n, k = dict(model.named_modules())[m].weight.shape
    assert k % 32 and n % 40  # short tiles both ways
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor(f"{m}.weight_scale").shape == (-(-n // 40), -(-k // 32))
    state, read, _ = read_compressed_tensors(tmp_path)
    modules = dict(model.named_modules())
    for name, p in qparams.items():
        assert torch.equal(state[f"{name}.weight"], modules[name].weight), name
        assert read[name].scheme == scheme
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (loaded(tiny_tokens(2, 16)).logits - model(tiny_tokens(2, 16)).logits).abs().max() < 1e-4


def test_block_rows_refusals() -> None:
    with pytest.raises(ValidationError, match="block_rows .* is for FP8 weights"):
        QuantScheme(bits=4, group_size=128, block_rows=128)
    with pytest.raises(ValidationError, match="block_rows .* is for FP8 weights"):
        QuantScheme(type="float", bits=8, group_size=None, block_rows=128)
    assert FP8_BLOCK.label() == "fp8-e4m3-b128x128"
