"""GPTQ checkpoints: the AutoGPTQ / GPTQModel layout that transformers (optimum + gptqmodel), vLLM
and TGI load, with v1 zero points.

Layout per quantized ``nn.Linear`` with K inputs, N outputs, b bits and G groups (AutoGPTQ
``nn_modules/qlinear/qlinear_cuda_old.py`` ``pack()``; GPTQModel ``utils/model.py`` for the
v1/v2 zero convention; collected in ``/work/shared/docs/formats.md`` section 2a):

- ``<m>.qweight`` int32 ``[K*b/32, N]``: unsigned codes ``q + 2^(b-1)`` packed along the input
  dimension. Column n is one little-endian bit stream, element k at stream bits ``[k*b, (k+1)*b)``:
  for 2/4/8 bits, word ``k // (32/b)`` bits ``b*(k mod 32/b)``; for 3 bits, AutoGPTQ's layout of
  32 elements in 3 words, elements 10 and 21 straddling two words.
- ``<m>.qzeros`` int32 ``[G, N*b/32]``: unsigned zero points packed the same way along the output
  dimension. v1 (``checkpoint_format: gptq``, what transformers/vLLM/AutoGPTQ read) stores
  ``zero - 1``; readers add the 1 back. v2 (``gptq_v2``, GPTQModel only) stores ``zero``.
- ``<m>.scales`` float16 ``[G, N]``; ``<m>.g_idx`` int32 ``[K]``, the group of each input column
  (``k // g`` unless act-order formed groups along a permutation: ``desc_act``).

Dequantization: ``W[n, k] = scales[g_idx[k], n] * (q_u[k, n] - zero_u[g_idx[k], n])``, which is
optc's ``(q - z) * s`` with both codes shifted by ``2^(b-1)``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optc
from optc.errors import OptcError
from optc.export.files import (
    code_sparsity,
    dequantizing_reader,
    describe_safetensors,
    grid_bits_per_weight,
    one_scheme_summary,
    quant_method,
    read_config,
    read_tensors,
    write_config,
)
from optc.export.registry import Format
from optc.export.source import ExportSource, ModelSource, check_linear, integer_grid, refuse_activations, save_tokenizer, uniform_scheme

if TYPE_CHECKING:
    import torch

    from optc.compress.quant import QuantParams, QuantScheme

log = logging.getLogger(__name__)

FORMAT = "gptq"
GPTQ_BITS = (2, 3, 4, 8)
# Every reader agrees on the packed shapes only when both dimensions fill whole 32-element blocks
# (AutoGPTQ sizes qweight as K // 32 * b).
ALIGN = 32
DEFAULT_SHARD_BYTES = 2 * 1024**3


# --- groups -----------------------------------------------------------------------------------


def shared_group_size(qparams: dict[str, QuantParams]) -> int | None:
    """One group size every module can be stored with exactly (a config holds one).

    The common scheme's own size when it divides every K; otherwise the largest size that divides
    it and every K (finer groups repeat the scales, so nothing changes but the scale count).
    """
    from optc.export.packing import fit_group_size

    sizes = {p.scheme.group_size for p in qparams.values()}
    if len(sizes) != 1:
        raise OptcError(f"modules use different group sizes {sorted(sizes, key=str)}; the format holds one")
    return fit_group_size(sizes.pop(), [p.g_idx.numel() for p in qparams.values()])


# --- writer -----------------------------------------------------------------------------------


def gptq_config(scheme: QuantScheme, group_size: int | None, desc_act: bool, v1: bool = True) -> dict:
    """The ``quantization_config`` block (AutoGPTQ ``BaseQuantizeConfig`` and GPTQModel keys)."""
    fmt = "gptq" if v1 else "gptq_v2"
    return {
        "quant_method": FORMAT,
        "method": FORMAT,
        "bits": scheme.bits,
        "group_size": -1 if group_size is None else group_size,
        "desc_act": desc_act,
        "sym": scheme.symmetric,
        "static_groups": False,
        "true_sequential": True,
        "lm_head": False,
        "checkpoint_format": fmt,
        "format": fmt,
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"optc:{optc.__version__}"]},
    }


def write_gptq_source(src: ExportSource, directory: Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """Write ``src`` (fake-quantized Linears described by ``src.qparams``) as a GPTQ v1 checkpoint.

    Refused with the reason, before anything is written, when the grid does not fit the format:
    bits outside 2/3/4/8, mixed schemes, float Linears inside the decoder, non-Linear modules,
    dimensions not multiples of 32, or asymmetric zero points v1 cannot store.
    """
    import torch

    from optc.compress.quant import QuantScheme
    from optc.export.packing import grid_codes, pack_qweight, pack_qzeros, regroup, splice, v1_representable, write_weights

    qparams = src.qparams
    scheme = uniform_scheme(qparams, FORMAT)
    if scheme.bits not in GPTQ_BITS:
        raise OptcError(f"GPTQ holds {'/'.join(map(str, GPTQ_BITS))}-bit weights, not {scheme.bits}-bit")
    floats = [n for n in src.linears() if n != src.head and n not in qparams]
    if floats:
        raise OptcError(
            f"GPTQ quantizes every Linear of the decoder with one scheme, but {len(floats)} stay float "
            f"(e.g. {floats[0]}); export compressed-tensors for partial quantization"
        )
    actorder = any(p.actorder for p in qparams.values())
    group_size = scheme.group_size if actorder else shared_group_size(qparams)
    stored = set(src.keys())

    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in qparams.items():
        check_linear(src, name, FORMAT)
        n, k = src.spec(f"{name}.weight")[1]
        if n % ALIGN or k % ALIGN:
            raise OptcError(f"GPTQ needs both dimensions to be multiples of {ALIGN}; {name} is {n}x{k}")
        if f"{name}.weight" not in stored:
            raise OptcError(f"{name}.weight is tied to another tensor; a tied weight cannot be quantized alone")
        if not p.actorder and group_size != p.scheme.group_size:
            p = regroup(p, group_size)
        with torch.no_grad():
            q = grid_codes(name, src.tensor(f"{name}.weight"), p)
            if not scheme.symmetric:
                q, p = v1_representable(q, p, name)
            packed[name] = {
                "qweight": pack_qweight(q, scheme.bits),
                "qzeros": pack_qzeros(p.zero, scheme.bits),
                "scales": p.scale.t().contiguous().to(torch.float16),
                "g_idx": p.g_idx.to(torch.int32),
            }

    directory = Path(directory)
    files = write_weights(splice(src, packed), directory, max_shard_bytes)
    qc = gptq_config(scheme, group_size, desc_act=actorder)
    write_config(src, qc, directory)
    (directory / "quantize_config.json").write_text(json.dumps(qc, indent=2) + "\n")
    label = QuantScheme(bits=scheme.bits, symmetric=scheme.symmetric, group_size=group_size).label()
    summary = {
        "format": FORMAT,
        "scheme": label + ("-actorder" if actorder else ""),
        "modules": len(packed),
        "bytes": sum(f.stat().st_size for f in files),
        "files": [f.name for f in files],
    }
    log.info("gptq: %d modules (%s), %d bytes in %s", len(packed), label, summary["bytes"], directory)
    return summary


def write_gptq(
    model: torch.nn.Module,
    qparams: dict[str, QuantParams],
    directory: Path,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict:
    """:func:`write_gptq_source` of a model in memory."""
    return write_gptq_source(ModelSource(model, None, qparams), directory, max_shard_bytes=max_shard_bytes)


# --- reader -----------------------------------------------------------------------------------


def _pop(tensors: dict[str, torch.Tensor], key: str, directory: Path) -> torch.Tensor:
    if key not in tensors:
        raise OptcError(f"{directory}: {key} is missing")
    return tensors.pop(key)


def read_gptq(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantParams]]:
    """optc's own reader: dequantized float state dict and the params of a GPTQ checkpoint."""
    import torch

    from optc.compress.quant import QuantParams, QuantScheme, default_g_idx, dequantize
    from optc.export.packing import unpack_qweight, unpack_qzeros

    directory = Path(directory)
    qc = read_config(directory).get("quantization_config") or {}
    if qc.get("quant_method") != FORMAT:
        raise OptcError(f"{directory} is not a GPTQ checkpoint")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise OptcError(f"{directory}: GPTQ checkpoint_format {fmt!r} is not readable (gptq or gptq_v2)")
    if qc.get("dynamic"):
        raise OptcError(f"{directory}: per-module 'dynamic' GPTQ overrides are not readable")
    bits = int(qc.get("bits", 4))
    if bits not in GPTQ_BITS:
        raise OptcError(f"{directory}: GPTQ bits {bits} is not one of {GPTQ_BITS}")
    g = qc.get("group_size", -1)
    scheme = QuantScheme(bits=bits, symmetric=bool(qc.get("sym", True)), group_size=None if g in (-1, None) else g)
    tensors = read_tensors(directory)
    state: dict[str, torch.Tensor] = {}
    qparams: dict[str, QuantParams] = {}
    for name in [key.removesuffix(".qweight") for key in tensors if key.endswith(".qweight")]:
        qweight = _pop(tensors, f"{name}.qweight", directory)
        scales = _pop(tensors, f"{name}.scales", directory)
        qzeros = _pop(tensors, f"{name}.qzeros", directory)
        groups, n = scales.shape
        k = qweight.shape[0] * 32 // bits
        g_idx = tensors.pop(f"{name}.g_idx", None)
        g_idx = default_g_idx(k, scheme) if g_idx is None else g_idx.to(torch.int32)
        if g_idx.numel() != k or (groups and int(g_idx.max()) >= groups):
            raise OptcError(f"{directory}: {name}.g_idx does not match qweight {tuple(qweight.shape)} / scales {groups} groups")
        try:
            q = unpack_qweight(qweight, bits, k)
            zero = unpack_qzeros(qzeros, bits, n, v1=fmt == "gptq")
        except ValueError as exc:
            raise OptcError(f"{directory}: {name}: {exc}") from None
        p = QuantParams(scheme, scales.t().float().contiguous(), zero, g_idx)
        state[f"{name}.weight"] = dequantize(q, p, torch.float32)
        qparams[name] = p
    if not qparams:
        raise OptcError(f"{directory}: GPTQ config but no .qweight tensors")
    state.update(tensors)
    return state, qparams


# --- the registry entry -----------------------------------------------------------------------


def _fits(scheme: QuantScheme | None, permuted: bool) -> str | None:
    if refusal := integer_grid(scheme, "GPTQ"):
        return refusal
    if scheme is not None and scheme.bits not in GPTQ_BITS:
        return f"GPTQ holds {'/'.join(map(str, GPTQ_BITS))}-bit weights, not {scheme.bits}-bit"
    return None


def _write(src: ExportSource, directory: Path, *, max_shard_bytes: int | None = None, requantize: bool = False) -> dict:
    refuse_activations(src, FORMAT)
    summary = write_gptq_source(src, directory, max_shard_bytes=DEFAULT_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes)
    save_tokenizer(src, directory)
    return summary


def _qweight_values(fh: Any, key: str, bits: int) -> int | None:
    """Weights of a ``qweight`` [K*b/32, N]: K from its rows, N from the ``scales`` beside it."""
    scales = f"{key.removesuffix('.qweight')}.scales"
    if scales not in fh.keys():
        return None
    return fh.get_slice(key).get_shape()[0] * 32 // bits * fh.get_slice(scales).get_shape()[1]


def _describe(path: Path) -> dict:
    qc = read_config(path).get("quantization_config") or {}
    bits = int(qc.get("bits", 4))
    summary = one_scheme_summary(qc, f"{FORMAT}/{qc.get('checkpoint_format', qc.get('format', 'gptq'))}")
    info = describe_safetensors(path, summary, skip=(".qzeros", ".scales", ".g_idx"),
                                packed={".qweight": lambda fh, key: _qweight_values(fh, key, bits)})
    state, qparams = read_gptq(path)
    info["sparsity"] = code_sparsity(state, qparams)
    return info


GPTQ = Format(
    name=FORMAT,
    description="GPTQ v1, one 2/3/4/8-bit scheme (AutoGPTQ/GPTQModel layout), loaded by transformers (optimum), vLLM and TGI",
    fits=_fits,
    write=_write,
    read=dequantizing_reader(read_gptq),
    detect=lambda path: quant_method(path) == FORMAT,
    describe=_describe,
    bits_per_weight=grid_bits_per_weight,
    one_scheme=True,
    needs_quantized=True,
    usage="""transformers (with `optimum` and `gptqmodel` installed):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{path}")
tokenizer = AutoTokenizer.from_pretrained("{path}")
```

vLLM (GPTQ kernels, from config.json):

```python
from vllm import LLM

llm = LLM(model="{path}")
print(llm.generate("The capital of France is")[0].outputs[0].text)
```
""",
)
