"""AWQ GEMM checkpoints: the AutoAWQ layout that transformers (``AwqConfig``) and vLLM (``awq``,
``awq_marlin``) load.

Layout per quantized ``nn.Linear`` with K inputs, N outputs, groups of g (AutoAWQ
``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear`` and ``awq/utils/packing_utils.py``;
``/work/shared/docs/formats.md`` section 2b); 4-bit only:

- ``<m>.qweight`` int32 ``[K, N/8]``: unsigned codes ``q + 8`` packed along the *output* dimension,
  interleaved: nibble ``i`` (bits ``4i..4i+3``) of word ``c`` holds output ``8c + ORDER[i]`` with
  ``ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``.
- ``<m>.qzeros`` int32 ``[K/g, N/8]``: unsigned zero points, same interleave, stored as they are
  (no v1-style ``- 1``).
- ``<m>.scales`` float16 ``[K/g, N]``. No ``g_idx``: groups are contiguous.

Dequantization ``W = (q_u - z_u) * s``. A symmetric optc grid is stored with ``z_u = 8``, which the
GEMM kernels read like any other zero point (they always apply one).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

FORMAT = "awq"
VERSION = "gemm"
BITS = 4
PACK = 32 // BITS  # outputs per int32 word
DEFAULT_SHARD_BYTES = 2 * 1024**3


def awq_config(group_size: int, modules_to_not_convert: list[str] | None) -> dict:
    """The ``quantization_config`` block AutoAWQ's ``to_transformers_dict`` writes."""
    return {
        "quant_method": FORMAT,
        "bits": BITS,
        "group_size": group_size,
        "zero_point": True,
        "version": VERSION,
        "modules_to_not_convert": modules_to_not_convert or None,
    }


def awq_group_size(qparams: dict[str, QuantParams]) -> int:
    """One group size that divides every K and re-expresses every module's groups exactly."""
    from optc.export.packing import fit_group_size

    sizes = set()
    for name, p in qparams.items():
        if p.actorder:
            raise OptcError(f"AWQ has no g_idx, but {name} uses act-order groups (a permuted g_idx)")
        k = p.g_idx.numel()
        sizes.add(k if p.scheme.group_size is None else p.scheme.group_size)
        sizes.add(k)
    return fit_group_size(min(sizes), sizes)


def write_awq_source(src: ExportSource, directory: Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """Write ``src`` (fake-quantized Linears described by ``src.qparams``) as an AWQ GEMM checkpoint.

    Refused with the reason, before anything is written, unless every quantized module is a 4-bit
    ``nn.Linear`` with contiguous groups and N a multiple of 8. Per-channel or uneven groups are
    stored exactly with the finest group size they share with every K (scales repeated).
    """
    import torch

    from optc.compress.quant import QuantScheme
    from optc.export.packing import grid_codes, pack_awq, regroup, splice, write_weights

    qparams = src.qparams
    scheme = uniform_scheme(qparams, FORMAT)
    if scheme.bits != BITS:
        raise OptcError(f"AWQ GEMM holds 4-bit weights only, not {scheme.bits}-bit")
    group_size = awq_group_size(qparams)
    stored = set(src.keys())
    # Loaders match these by substring, so full names keep layer 1 apart from layer 10.
    floats = [n for n in src.linears() if n not in qparams]
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in qparams.items():
        check_linear(src, name, FORMAT)
        n = src.spec(f"{name}.weight")[1][0]
        if n % PACK:
            raise OptcError(f"AWQ packs {PACK} outputs per word; {name} has {n}")
        if f"{name}.weight" not in stored:
            raise OptcError(f"{name}.weight is tied to another tensor; a tied weight cannot be quantized alone")
        if group_size != p.scheme.group_size:
            p = regroup(p, group_size)
        with torch.no_grad():
            q = grid_codes(name, src.tensor(f"{name}.weight"), p)
        packed[name] = {
            "qweight": pack_awq(q.t().contiguous()),
            "qzeros": pack_awq(p.zero.t().contiguous()),
            "scales": p.scale.t().contiguous().to(torch.float16),
        }
    directory = Path(directory)
    files = write_weights(splice(src, packed), directory, max_shard_bytes)
    write_config(src, awq_config(group_size, floats), directory)
    label = QuantScheme(bits=BITS, symmetric=scheme.symmetric, group_size=group_size).label()
    summary = {
        "format": f"{FORMAT}/{VERSION}",
        "scheme": label,
        "modules": len(packed),
        "bytes": sum(f.stat().st_size for f in files),
        "files": [f.name for f in files],
    }
    log.info("awq: %d modules (%s), %d bytes in %s", len(packed), label, summary["bytes"], directory)
    return summary


def write_awq(
    model: torch.nn.Module,
    qparams: dict[str, QuantParams],
    directory: Path,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict:
    """:func:`write_awq_source` of a model in memory."""
    return write_awq_source(ModelSource(model, None, qparams), directory, max_shard_bytes=max_shard_bytes)


def read_awq(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantParams]]:
    """optc's own reader: dequantized float state dict and the params of an AWQ GEMM checkpoint."""
    import torch

    from optc.compress.quant import QuantParams, QuantScheme, default_g_idx, dequantize
    from optc.export.packing import unpack_awq

    directory = Path(directory)
    qc = read_config(directory).get("quantization_config") or {}
    if qc.get("quant_method") != FORMAT:
        raise OptcError(f"{directory} is not an AWQ checkpoint")
    version = str(qc.get("version", VERSION)).lower()
    if version != VERSION:
        raise OptcError(f"{directory}: AWQ version {version!r} is not readable (only {VERSION!r})")
    bits = int(qc.get("bits", qc.get("w_bit", BITS)))
    if bits != BITS:
        raise OptcError(f"{directory}: AWQ GEMM is 4-bit, config says {bits}")
    tensors = read_tensors(directory)
    state: dict[str, torch.Tensor] = {}
    qparams: dict[str, QuantParams] = {}
    for name in [key.removesuffix(".qweight") for key in tensors if key.endswith(".qweight")]:
        qweight = tensors.pop(f"{name}.qweight")
        scales = tensors.pop(f"{name}.scales", None)
        qzeros = tensors.pop(f"{name}.qzeros", None)
        if scales is None or qzeros is None:
            raise OptcError(f"{directory}: {name} lacks scales or qzeros")
        k = qweight.shape[0]
        groups, n = scales.shape
        if groups == 0 or k % groups:
            raise OptcError(f"{directory}: {name}: {groups} groups do not split K={k}")
        scheme = QuantScheme(bits=BITS, symmetric=False, group_size=k // groups)
        try:
            q = unpack_awq(qweight, n).t().contiguous()
            zero = unpack_awq(qzeros, n).t().to(torch.int32).contiguous()
        except ValueError as exc:
            raise OptcError(f"{directory}: {name}: {exc}") from None
        if bool((zero == 0).all()):
            scheme = QuantScheme(bits=BITS, symmetric=True, group_size=k // groups)
        p = QuantParams(scheme, scales.t().float().contiguous(), zero, default_g_idx(k, scheme))
        state[f"{name}.weight"] = dequantize(q, p, torch.float32)
        qparams[name] = p
    if not qparams:
        raise OptcError(f"{directory}: AWQ config but no .qweight tensors")
    state.update(tensors)
    return state, qparams


# --- the registry entry -----------------------------------------------------------------------


def _fits(scheme: QuantScheme | None, permuted: bool) -> str | None:
    if scheme is None:
        return None
    if refusal := integer_grid(scheme, "AWQ"):
        return refusal
    if scheme.bits != BITS:
        return f"AWQ GEMM holds 4-bit weights only, not {scheme.bits}-bit"
    if permuted:
        return "AWQ has no g_idx for act-order (permuted) groups"
    return None


def _write(src: ExportSource, directory: Path, *, max_shard_bytes: int | None = None, requantize: bool = False) -> dict:
    refuse_activations(src, FORMAT)
    summary = write_awq_source(src, directory, max_shard_bytes=DEFAULT_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes)
    save_tokenizer(src, directory)
    return summary


def _qweight_values(fh: Any, key: str) -> int | None:
    """Weights of a ``qweight`` [K, N/8]: K from its rows, N from the ``scales`` beside it."""
    scales = f"{key.removesuffix('.qweight')}.scales"
    if scales not in fh.keys():
        return None
    return fh.get_slice(key).get_shape()[0] * fh.get_slice(scales).get_shape()[1]


def _describe(path: Path) -> dict:
    qc = read_config(path).get("quantization_config") or {}
    summary = one_scheme_summary(qc, f"{FORMAT}/{qc.get('version', 'gemm')}")
    info = describe_safetensors(path, summary, skip=(".qzeros", ".scales"), packed={".qweight": _qweight_values})
    # AWQ always stores zero points: zero points all 8 are a symmetric grid in that layout.
    state, qparams = read_awq(path)
    sym = all(p.scheme.symmetric for p in qparams.values())
    info.update({
        "sparsity": code_sparsity(state, qparams),
        "symmetric": [sym],
        "scheme": f"int4-{'sym' if sym else 'asym'}-g{next(iter(qparams.values())).scheme.group_size}",
    })
    return info


AWQ = Format(
    name=FORMAT,
    description="AWQ GEMM, 4-bit with contiguous groups (AutoAWQ layout), loaded by transformers and vLLM",
    fits=_fits,
    write=_write,
    read=dequantizing_reader(read_awq),
    detect=lambda path: quant_method(path) == FORMAT,
    describe=_describe,
    bits_per_weight=grid_bits_per_weight,
    one_scheme=True,
    needs_quantized=True,
    usage="""transformers (with an AWQ kernel package installed):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{path}")
tokenizer = AutoTokenizer.from_pretrained("{path}")
```

vLLM (AWQ kernels, from config.json):

```python
from vllm import LLM

llm = LLM(model="{path}")
print(llm.generate("The capital of France is")[0].outputs[0].text)
```
""",
)
