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
import math
from pathlib import Path

import torch

import optc
from optc.compress.quant import QuantParams, QuantScheme, default_g_idx, dequantize, quantize
from optc.errors import OptcError
from optc.export.compressed_tensors import pack_int32, unpack_int32
from optc.model.safetensors_io import model_state_dict, write_safetensors

log = logging.getLogger(__name__)

FORMAT = "gptq"
GPTQ_BITS = (2, 3, 4, 8)
# Every reader agrees on the packed shapes only when both dimensions fill whole 32-element blocks
# (AutoGPTQ sizes qweight as K // 32 * b).
ALIGN = 32


# --- packing (pure tensor functions) ----------------------------------------------------------


def pack_qweight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes ``q`` ([N, K]) as GPTQ ``qweight`` ([K*b/32, N] int32)."""
    # pack_int32 writes q + 2^(b-1) as one little-endian stream per row, which is GPTQ's column
    # stream once transposed.
    return pack_int32(q, bits).t().contiguous()


def unpack_qweight(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Signed codes [N, K] of a GPTQ ``qweight``."""
    return unpack_int32(qweight.t().contiguous(), bits, k)


def pack_qzeros(zero: torch.Tensor, bits: int, v1: bool = True) -> torch.Tensor:
    """Signed zero points ([N, G]) as GPTQ ``qzeros`` ([G, N*b/32] int32); v1 stores zero - 1."""
    stored = zero.to(torch.int32) - (1 if v1 else 0)
    return pack_int32(stored.t().contiguous(), bits)


def unpack_qzeros(qzeros: torch.Tensor, bits: int, n: int, v1: bool = True) -> torch.Tensor:
    """Signed zero points [N, G] (int32) of a GPTQ ``qzeros``."""
    stored = unpack_int32(qzeros, bits, n).to(torch.int32)
    return (stored + (1 if v1 else 0)).t().contiguous()


def v1_representable(q: torch.Tensor, p: QuantParams, name: str = "") -> tuple[torch.Tensor, QuantParams]:
    """Codes and params with every zero point storable as v1's ``zero - 1``.

    An asymmetric group whose unsigned zero is 0 cannot be stored in v1 (``-1`` wraps to all
    ones and reads back as ``2^b``; GPTQModel: "v1 checkpoint format with sym=False ... will
    overflow"). When such a group never uses the top code, shifting its codes and its zero up
    by one is exact; otherwise the grid does not fit v1 and the export is refused.
    """
    low = p.zero == p.scheme.qmin  # [N, G]
    if not bool(low.any()):
        return q, p
    g_idx = p.g_idx.long()
    member = low[:, g_idx]  # [N, K]: column k's group has zero 0
    top = torch.zeros(low.shape, dtype=torch.int32, device=q.device).index_add_(
        1, g_idx, (q == p.scheme.qmax).to(torch.int32)
    ) > 0
    top &= low
    if bool(top.any()):
        raise OptcError(
            f"{name}: {int(top.sum())} asymmetric group(s) have zero point 0 and use the top code; "
            "GPTQ v1 stores zero - 1 and cannot hold them (export compressed-tensors, or quantize "
            "symmetric)"
        )
    log.info("%s: %d group(s) with zero point 0 shifted up by one code (exact)", name, int(low.sum()))
    shifted = QuantParams(p.scheme, p.scale, p.zero + low.to(p.zero.dtype), p.g_idx)
    return (q.to(torch.int16) + member.to(torch.int16)).to(torch.int8), shifted


# --- groups -----------------------------------------------------------------------------------


def regroup_exact(p: QuantParams, group_size: int | None) -> QuantParams:
    """``p`` with contiguous groups of ``group_size`` columns (``None``: one per row), exactly.

    Exact when every new group lies inside one old group, i.e. ``g_idx`` is constant on each run of
    ``group_size`` columns (a finer split of contiguous groups, or any split of per-channel).
    """
    k = p.g_idx.numel()
    scheme = QuantScheme(bits=p.scheme.bits, symmetric=p.scheme.symmetric, group_size=group_size)
    if group_size is None:
        if bool((p.g_idx != p.g_idx[0]).any()):
            raise ValueError(f"{p.scale.shape[1]} groups cannot become one per-channel scale")
        old = p.g_idx[:1].long()
    else:
        if k % group_size:
            raise ValueError(f"group size {group_size} does not divide K={k}")
        runs = p.g_idx.view(-1, group_size)
        if bool((runs != runs[:, :1]).any()):
            raise ValueError(f"groups of {group_size} columns would straddle the checkpoint's groups")
        old = runs[:, 0].long()
    return QuantParams(scheme, p.scale[:, old], p.zero[:, old], default_g_idx(k, scheme).to(p.g_idx.device))


def shared_group_size(qparams: dict[str, QuantParams]) -> int | None:
    """One group size every module can be stored with exactly (a config holds one).

    The common scheme's own size when it divides every K; otherwise the largest size that divides
    it and every K (finer groups repeat the scales, so nothing changes but the scale count).
    """
    sizes = {p.scheme.group_size for p in qparams.values()}
    if len(sizes) != 1:
        raise OptcError(f"modules use different group sizes {sorted(sizes, key=str)}; the format holds one")
    g = sizes.pop()
    if g is None:
        return None
    t = g
    for p in qparams.values():
        t = math.gcd(t, p.g_idx.numel())
    return t


def uniform_scheme(qparams: dict[str, QuantParams], fmt: str) -> QuantScheme:
    """The one scheme of every module, or a refusal naming the first module that differs."""
    if not qparams:
        raise OptcError(f"{fmt} export needs quantized weights; this model has none")
    items = iter(qparams.items())
    first_name, first = next(items)
    for name, p in items:
        if (p.scheme.bits, p.scheme.symmetric) != (first.scheme.bits, first.scheme.symmetric):
            raise OptcError(
                f"{fmt} holds one scheme per checkpoint, but {first_name} is {first.scheme.label()} "
                f"and {name} is {p.scheme.label()} (mixed precision: export compressed-tensors)"
            )
    return first.scheme


def grid_codes(name: str, weight: torch.Tensor, p: QuantParams) -> torch.Tensor:
    """Signed codes of ``weight`` on ``p``; warns when the weight is not on its grid (then the file
    holds the nearest codes, not the weight)."""
    q = quantize(weight, p)
    off = float((dequantize(q, p, weight.dtype) != weight).float().mean())
    if off:
        log.warning("%s: %.2f%% of weights are not on their quantization grid", name, 100 * off)
    return q


def check_linear(model: torch.nn.Module, name: str, fmt: str) -> torch.nn.Linear:
    module = dict(model.named_modules()).get(name)
    if not isinstance(module, torch.nn.Linear):
        kind = type(module).__name__ if module is not None else "missing"
        raise OptcError(f"{fmt} stores nn.Linear weights only; {name!r} is {kind}")
    return module


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


def write_gptq(
    model: torch.nn.Module,
    qparams: dict[str, QuantParams],
    directory: Path,
    *,
    max_shard_bytes: int = 2 * 1024**3,
) -> dict:
    """Write ``model`` (fake-quantized Linears described by ``qparams``) as a GPTQ v1 checkpoint.

    Refused with the reason, before anything is written, when the grid does not fit the format:
    bits outside 2/3/4/8, mixed schemes, float Linears inside the decoder, non-Linear modules,
    dimensions not multiples of 32, or asymmetric zero points v1 cannot store.
    """
    scheme = uniform_scheme(qparams, FORMAT)
    if scheme.bits not in GPTQ_BITS:
        raise OptcError(f"GPTQ holds {'/'.join(map(str, GPTQ_BITS))}-bit weights, not {scheme.bits}-bit")
    head = model.get_output_embeddings()
    floats = [n for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and m is not head and n not in qparams]
    if floats:
        raise OptcError(
            f"GPTQ quantizes every Linear of the decoder with one scheme, but {len(floats)} stay float "
            f"(e.g. {floats[0]}); export compressed-tensors for partial quantization"
        )
    actorder = any(p.actorder for p in qparams.values())
    group_size = scheme.group_size if actorder else shared_group_size(qparams)
    state = model_state_dict(model)

    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in qparams.items():
        module = check_linear(model, name, FORMAT)
        n, k = module.weight.shape
        if n % ALIGN or k % ALIGN:
            raise OptcError(f"GPTQ needs both dimensions to be multiples of {ALIGN}; {name} is {n}x{k}")
        if f"{name}.weight" not in state:
            raise OptcError(f"{name}.weight is tied to another tensor; a tied weight cannot be quantized alone")
        if not p.actorder and group_size != p.scheme.group_size:
            p = regroup_exact(p, group_size)
        with torch.no_grad():
            q = grid_codes(name, module.weight, p)
            if not scheme.symmetric:
                q, p = v1_representable(q, p, name)
            packed[name] = {
                "qweight": pack_qweight(q, scheme.bits),
                "qzeros": pack_qzeros(p.zero, scheme.bits),
                "scales": p.scale.t().contiguous().to(torch.float16),
                "g_idx": p.g_idx.to(torch.int32),
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
    qc = gptq_config(scheme, group_size, desc_act=actorder)
    write_config(model, qc, directory)
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


def write_config(model: torch.nn.Module, quantization_config: dict, directory: Path) -> None:
    """``config.json`` with the quantization block, plus the generation config."""
    config = model.config.to_dict()
    config["dtype"] = str(model.dtype).removeprefix("torch.")
    config["quantization_config"] = quantization_config
    (Path(directory) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


# --- reader -----------------------------------------------------------------------------------


def read_quantization_config(directory: Path) -> dict:
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text()).get("quantization_config") or {}
    except json.JSONDecodeError as exc:
        raise OptcError(f"{path}: not valid JSON ({exc.msg})") from None
    except OSError as exc:
        raise OptcError(f"cannot read {path}: {exc.strerror}") from None


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """All safetensors of a checkpoint; a corrupt or truncated file is an error naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise OptcError(f"{directory} holds no .safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise OptcError(f"cannot read checkpoint file {f}: {exc}") from None
    return out


def _pop(tensors: dict[str, torch.Tensor], key: str, directory: Path) -> torch.Tensor:
    if key not in tensors:
        raise OptcError(f"{directory}: {key} is missing")
    return tensors.pop(key)


def read_gptq(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, QuantParams]]:
    """optc's own reader: dequantized float state dict and the params of a GPTQ checkpoint."""
    directory = Path(directory)
    qc = read_quantization_config(directory)
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
