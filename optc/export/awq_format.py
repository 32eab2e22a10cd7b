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
import math
from pathlib import Path

import torch

from optc.compress.quant import QuantParams, QuantScheme, default_g_idx, dequantize
from optc.errors import OptcError
from optc.export.compressed_tensors import pack_int32, unpack_int32
from optc.export.gptq_format import (
    check_linear,
    grid_codes,
    read_quantization_config,
    read_tensors,
    regroup_exact,
    uniform_scheme,
    write_config,
)
from optc.model.safetensors_io import model_state_dict, write_safetensors

log = logging.getLogger(__name__)

FORMAT = "awq"
VERSION = "gemm"
BITS = 4
PACK = 32 // BITS
# Nibble i of each word holds column ORDER[i] of its 8-column block (AutoAWQ's order_map).
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _interleave_index(n: int, device: torch.device) -> torch.Tensor:
    """Column read into each packed position: position 8c + i holds column 8c + ORDER[i]."""
    base = torch.arange(0, n, PACK, device=device).unsqueeze(1)
    return (base + torch.tensor(ORDER, device=device)).reshape(-1)


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit codes ``[R, N]`` (rows = input columns, or groups) packed ``[R, N/8]`` with AWQ's interleave."""
    if q.shape[1] % PACK:
        raise ValueError(f"AWQ packs outputs in words of {PACK}; N={q.shape[1]}")
    return pack_int32(q[:, _interleave_index(q.shape[1], q.device)], BITS)


def unpack_awq(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_awq`: signed codes ``[R, n]`` (int8)."""
    interleaved = unpack_int32(packed, BITS, n)
    out = torch.empty_like(interleaved)
    out[:, _interleave_index(n, packed.device)] = interleaved
    return out


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
    sizes = set()
    for name, p in qparams.items():
        if p.actorder:
            raise OptcError(f"AWQ has no g_idx, but {name} uses act-order groups (a permuted g_idx)")
        k = p.g_idx.numel()
        sizes.add(k if p.scheme.group_size is None else p.scheme.group_size)
        sizes.add(k)
    t = 0
    for s in sizes:
        t = math.gcd(t, s)
    return t


def write_awq(
    model: torch.nn.Module,
    qparams: dict[str, QuantParams],
    directory: Path,
    *,
    max_shard_bytes: int = 2 * 1024**3,
) -> dict:
    """Write ``model`` (fake-quantized Linears described by ``qparams``) as an AWQ GEMM checkpoint.

    Refused with the reason, before anything is written, unless every quantized module is a 4-bit
    ``nn.Linear`` with contiguous groups and N a multiple of 8. Per-channel or uneven groups are
    stored exactly with the finest group size they share with every K (scales repeated).
    """
    scheme = uniform_scheme(qparams, FORMAT)
    if scheme.bits != BITS:
        raise OptcError(f"AWQ GEMM holds 4-bit weights only, not {scheme.bits}-bit")
    group_size = awq_group_size(qparams)
    state = model_state_dict(model)
    # Loaders match these by substring, so full names keep layer 1 apart from layer 10.
    floats = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in qparams]
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in qparams.items():
        module = check_linear(model, name, FORMAT)
        n = module.weight.shape[0]
        if n % PACK:
            raise OptcError(f"AWQ packs {PACK} outputs per word; {name} has {n}")
        if f"{name}.weight" not in state:
            raise OptcError(f"{name}.weight is tied to another tensor; a tied weight cannot be quantized alone")
        if group_size != p.scheme.group_size:
            p = regroup_exact(p, group_size)
        with torch.no_grad():
            q = grid_codes(name, module.weight, p)
        packed[name] = {
            "qweight": pack_awq(q.t().contiguous()),
            "qzeros": pack_awq(p.zero.t().contiguous()),
            "scales": p.scale.t().contiguous().to(torch.float16),
        }
    tensors: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        mod, _, leaf = key.rpartition(".")
        if leaf == "weight" and mod in packed:
            tensors.update({f"{mod}.{k}": v for k, v in packed[mod].items()})
        else:
            tensors[key] = t
    directory = Path(directory)
    files = write_safetensors(tensors, directory, max_shard_bytes=max_shard_bytes)
    write_config(model, awq_config(group_size, floats), directory)
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


def read_awq(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantParams]]:
    """optc's own reader: dequantized float state dict and the params of an AWQ GEMM checkpoint."""
    directory = Path(directory)
    qc = read_quantization_config(directory)
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
