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

Per-module schemes (a budget's mix, or Linears left float) go in GPTQModel's ``dynamic`` map of the
config: regex -> overrides of ``bits``/``group_size``/``sym``/``desc_act``; a ``-:`` key leaves the
modules it matches unquantized. Readers take the first key whose pattern ``re.match``es the module
name (GPTQModel ``quantization/config.py`` ``dynamic_get``; vLLM ``gptq_utils.get_dynamic_override``,
which asks with the name of the fused module it builds, e.g. ``qkv_proj``).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import Counter
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
from optc.export.source import (
    ExportSource,
    ModelSource,
    check_linear,
    integer_grid,
    refuse_activations,
    save_tokenizer,
    warn_unfused,
)
from optc.model.patterns import FUSED_SHARDS, fused_groups, fused_module

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


# --- groups and per-module schemes ---------------------------------------------------------------


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


# One module's stored settings: (bits, group_size or -1, sym, desc_act); None: kept float.
Setting = tuple[int, int, bool, bool]


def _setting(p: QuantParams, group_size: int | None) -> Setting:
    return (p.scheme.bits, -1 if group_size is None else group_size, p.scheme.symmetric, p.actorder)


def _overrides(setting: Setting) -> dict:
    bits, group, sym, desc_act = setting
    return {"bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act}


def dynamic_config(settings: dict[str, Setting | None]) -> tuple[Setting, dict[str, dict]]:
    """The base settings (the most modules') and the ``dynamic`` map that gives every other module
    its own: one exact key per module, or per fused set whose shards agree (so vLLM's fused name
    matches too); ``-:`` keys for the float ones."""
    counts = Counter(s for s in settings.values() if s is not None)
    base = counts.most_common(1)[0][0]
    dynamic: dict[str, dict] = {}
    for group in fused_groups(settings):
        fused = fused_module(group[0])
        shards = FUSED_SHARDS.get(fused, ())
        if fused is not None and len(group) == len(shards) and len({settings[n] for n in group}) == 1:
            parent = group[0].rpartition(".")[0]
            keys = {rf"{re.escape(parent)}\.(?:{'|'.join((*shards, fused))})$": group[0]}
        else:
            keys = {re.escape(n) + "$": n for n in group}
        for key, name in keys.items():
            setting = settings[name]
            if setting != base:
                dynamic[("-:" if setting is None else "+:") + key] = {} if setting is None else _overrides(setting)
    return base, dynamic


def module_setting(qc: dict, name: str) -> Setting | None:
    """The settings a GPTQ config gives module ``name``: the first ``dynamic`` key whose pattern
    matches it (None for a ``-:`` key: left float), else the base ones."""
    base = {"bits": int(qc.get("bits", 4)), "group_size": qc.get("group_size", -1),
            "sym": bool(qc.get("sym", True)), "desc_act": bool(qc.get("desc_act", False))}
    for key, overrides in (qc.get("dynamic") or {}).items():
        if re.match(key[2:] if key.startswith(("+:", "-:")) else key, name):
            if key.startswith("-:"):
                return None
            base.update(overrides or {})
            break
    group = base["group_size"]
    return int(base["bits"]), -1 if group in (-1, None) else int(group), bool(base["sym"]), bool(base["desc_act"])


def _stored_bits(scheme: QuantScheme | None, out_features: int, in_features: int, float_bits: int,
                 permuted: bool = False) -> int | None:
    """What the writer stores for one Linear in a mix: int32 words of codes down each column,
    packed zero points and float16 scales per group, int32 ``g_idx``; None where the layout or
    GPTQModel cannot hold it as its own grid (bits, a dimension not filling 32-element blocks,
    groups not dividing K or not a power of two). A float Linear is the float tensor (a ``-:``
    key)."""
    if scheme is None:
        return out_features * in_features * float_bits
    if _fits(scheme, permuted) or out_features % ALIGN or in_features % ALIGN:
        return None
    group = scheme.group_size or in_features
    if scheme.group_size is not None and group & (group - 1):
        return None  # GPTQModel's kernels, the loader of a dynamic map, take power-of-two groups only
    if in_features % group and not permuted:
        return None
    groups = math.ceil(in_features / group)
    return in_features * out_features * scheme.bits + groups * out_features * (scheme.bits + 16) + 32 * in_features


# --- writer -----------------------------------------------------------------------------------


def gptq_config(scheme: QuantScheme, group_size: int | None, desc_act: bool, v1: bool = True,
                dynamic: dict[str, dict] | None = None) -> dict:
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
        **({"dynamic": dynamic} if dynamic else {}),
        "meta": {"quantizer": [f"optc:{optc.__version__}"]},
    }


def _module_groups(qparams: dict[str, QuantParams]) -> dict[str, int | None]:
    """The group size each module is stored with. One scheme for all: one size that fits every
    K, so the config needs no ``dynamic`` map; a mix: each module's own, fit to its K."""
    from optc.export.packing import even_group_size

    schemes = {(p.scheme.bits, p.scheme.symmetric, p.scheme.group_size) for p in qparams.values()}
    if len(schemes) == 1 and not any(p.actorder for p in qparams.values()):
        size = shared_group_size(qparams)
        return dict.fromkeys(qparams, size)
    return {name: p.scheme.group_size if p.actorder else even_group_size(p.scheme.group_size, p.g_idx.numel())
            for name, p in qparams.items()}


def write_gptq_source(src: ExportSource, directory: Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """Write ``src`` (fake-quantized Linears described by ``src.qparams``) as a GPTQ v1 checkpoint.

    Modules on other schemes than the most common one, and decoder Linears left float, get
    GPTQModel ``dynamic`` entries; asymmetric zero points v1 cannot store make it a v2 checkpoint.
    Refused with the reason, before anything is written, when a grid does not fit the format: bits
    outside 2/3/4/8, non-Linear modules, dimensions not multiples of 32.
    """
    import torch

    from optc.compress.quant import QuantScheme
    from optc.export.packing import grid_codes, pack_qweight, pack_qzeros, regroup, splice, v1_representable, write_weights

    qparams = src.qparams
    if not qparams:
        raise OptcError(f"{FORMAT} export needs quantized weights; this model has none")
    for name, p in qparams.items():
        if p.scheme.bits not in GPTQ_BITS:
            raise OptcError(f"GPTQ holds {'/'.join(map(str, GPTQ_BITS))}-bit weights, not {p.scheme.bits}-bit ({name})")
    groups = _module_groups(qparams)
    stored = set(src.keys())

    codes: dict[str, tuple[torch.Tensor, QuantParams]] = {}
    for name, p in qparams.items():
        check_linear(src, name, FORMAT)
        n, k = src.spec(f"{name}.weight")[1]
        if n % ALIGN or k % ALIGN:
            raise OptcError(f"GPTQ needs both dimensions to be multiples of {ALIGN}; {name} is {n}x{k}")
        if f"{name}.weight" not in stored:
            raise OptcError(f"{name}.weight is tied to another tensor; a tied weight cannot be quantized alone")
        if not p.actorder and groups[name] != p.scheme.group_size:
            p = regroup(p, groups[name])
        with torch.no_grad():
            codes[name] = (grid_codes(name, src.tensor(f"{name}.weight"), p), p)
    # v1 (what every GPTQ reader takes) when it holds every zero point; otherwise v2, which stores
    # them as they are and which GPTQModel and vLLM read.
    v1 = True
    shifted: dict[str, tuple[torch.Tensor, QuantParams]] = {}
    for name, (q, p) in codes.items():
        if not p.scheme.symmetric:
            try:
                shifted[name] = v1_representable(q, p, name)
            except OptcError as exc:
                log.warning("gptq: %s; written as checkpoint_format gptq_v2 (GPTQModel and vLLM read it)", exc)
                v1 = False
                break
    if v1:
        codes.update(shifted)
    packed = {
        name: {
            "qweight": pack_qweight(q, p.scheme.bits),
            "qzeros": pack_qzeros(p.zero, p.scheme.bits, v1=v1),
            "scales": p.scale.t().contiguous().to(torch.float16),
            "g_idx": p.g_idx.to(torch.int32),
        }
        for name, (q, p) in codes.items()
    }

    settings: dict[str, Setting | None] = {}
    for name in src.linears():
        if name != src.head:
            settings[name] = _setting(qparams[name], groups[name]) if name in qparams else None
    base, dynamic = dynamic_config(settings)
    warn_unfused(src, FORMAT)
    odd = sorted({s[1] for s in settings.values() if s is not None and s[1] != -1 and s[1] & (s[1] - 1)})
    if odd:
        log.warning("gptq: group sizes %s are not powers of two: GPTQModel's kernels will not load them",
                    ", ".join(map(str, odd)))
    bits, group, sym, desc_act = base
    scheme = QuantScheme(bits=bits, symmetric=sym, group_size=None if group == -1 else group)
    directory = Path(directory)
    files = write_weights(splice(src, packed), directory, max_shard_bytes)
    qc = gptq_config(scheme, scheme.group_size, desc_act=desc_act, v1=v1, dynamic=dynamic)
    write_config(src, qc, directory)
    (directory / "quantize_config.json").write_text(json.dumps(qc, indent=2) + "\n")
    labels = Counter(QuantScheme(bits=s[0], symmetric=s[2], group_size=None if s[1] == -1 else s[1]).label()
                     + ("-actorder" if s[3] else "") if s else "float" for s in settings.values())
    summary = {
        "format": FORMAT if v1 else f"{FORMAT}/gptq_v2",
        "scheme": ", ".join(labels) if len(labels) > 1 else next(iter(labels)),
        "modules": len(packed),
        "bytes": sum(f.stat().st_size for f in files),
        "files": [f.name for f in files],
    }
    if dynamic:
        summary["dynamic"] = len(dynamic)
    log.info("gptq: %d modules (%s), %d bytes in %s", len(packed), summary["scheme"], summary["bytes"], directory)
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
    """optc's own reader: dequantized float state dict and the params of a GPTQ checkpoint
    (``dynamic`` per-module settings included)."""
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
    tensors = read_tensors(directory)
    state: dict[str, torch.Tensor] = {}
    qparams: dict[str, QuantParams] = {}
    for name in [key.removesuffix(".qweight") for key in tensors if key.endswith(".qweight")]:
        try:
            setting = module_setting(qc, name)
        except (re.error, TypeError, ValueError) as exc:
            raise OptcError(f"{directory}: GPTQ dynamic config: {exc}") from None
        if setting is None:
            raise OptcError(f"{directory}: {name} has packed weights but a '-:' dynamic key leaves it float")
        bits, g, sym, _ = setting
        if bits not in GPTQ_BITS:
            raise OptcError(f"{directory}: GPTQ bits {bits} ({name}) is not one of {GPTQ_BITS}")
        scheme = QuantScheme(bits=bits, symmetric=sym, group_size=None if g == -1 else g)
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
    fmt = f"{FORMAT}/{qc.get('checkpoint_format', qc.get('format', 'gptq'))}"
    state, qparams = read_gptq(path)
    summary = one_scheme_summary(qc, fmt)
    if qc.get("dynamic"):
        schemes = [p.scheme for p in qparams.values()]
        summary.update({
            "scheme": ", ".join(sorted({s.label() for s in schemes})),
            "bits": sorted({s.bits for s in schemes}),
            "group_size": sorted({"channel" if s.group_size is None else s.group_size for s in schemes}, key=str),
            "symmetric": sorted({s.symmetric for s in schemes}),
            "act_order": sorted({str(p.actorder) for p in qparams.values()}),
            "ignore": [key[2:] for key in qc["dynamic"] if key.startswith("-:")],
        })

    def values(fh: Any, key: str) -> int | None:
        setting = module_setting(qc, key.removesuffix(".qweight"))
        return None if setting is None else _qweight_values(fh, key, setting[0])

    info = describe_safetensors(path, summary, skip=(".qzeros", ".scales", ".g_idx"), packed={".qweight": values})
    info["sparsity"] = code_sparsity(state, qparams)
    return info


GPTQ = Format(
    name=FORMAT,
    description="GPTQ v1, 2/3/4/8-bit (AutoGPTQ/GPTQModel layout; mixes in GPTQModel's dynamic map), "
                "loaded by transformers (gptqmodel), vLLM and TGI",
    fits=_fits,
    write=_write,
    read=dequantizing_reader(read_gptq),
    detect=lambda path: quant_method(path) == FORMAT,
    describe=_describe,
    bits_per_weight=grid_bits_per_weight,
    stored_bits=_stored_bits,
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
