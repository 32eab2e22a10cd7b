"""The ``compressed-tensors`` format (llm-compressor's; transformers and vLLM load it): its
registry entry, pruning metadata (``sparsity_config``), and reading it back.

The sub-format follows from what the model holds: ``pack-quantized`` for weight-only integer
grids (:mod:`optc.export.ct_pack`), ``int-quantized`` when Linears also quantize their inputs
(W8A8, :mod:`optc.export.ct_int`), ``float-quantized`` / ``nvfp4-pack-quantized`` /
``mxfp4-pack-quantized`` for FP8, NVFP4 and MXFP4 (:mod:`optc.export.ct_float`), and
``mixed-precision`` when Linears differ. Importing this module imports neither
torch nor transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optc.errors import OptcError
from optc.export.files import describe_safetensors, quantization_config, read_config
from optc.export.registry import Format
from optc.export.source import integer_grid, save_tokenizer, warn_unfused

if TYPE_CHECKING:
    import torch

    from optc.compress.quant import QuantScheme
    from optc.export.source import ExportSource

NAME = "compressed-tensors"
_AUX_SUFFIXES = (".weight_scale", ".weight_zero_point", ".weight_g_idx", ".weight_shape",
                 ".input_scale", ".input_zero_point", ".weight_global_scale", ".input_global_scale")
# Stored bits of one float-grid scale: FP8's float32 ones, NVFP4's E4M3, MXFP4's E8M0 bytes.
_FLOAT_SCALE_BITS = {"float": 32, "e4m3": 8, "e8m0": 8}


def _fits(scheme: QuantScheme | None, permuted: bool) -> str | None:
    if scheme is not None and scheme.type == "float" and permuted:
        return f"{scheme.label()} has no g_idx for act-order (permuted) groups"
    if scheme is not None and scheme.offset_grid:
        return integer_grid(scheme, NAME)
    return None  # 1..8-bit integer grids of any group size, FP8, NVFP4, MXFP4


def _float_stored_bits(scheme: QuantScheme, out_features: int, in_features: int) -> int:
    """ct_float's tensors: 8- or 4-bit codes, a scale per group, NVFP4's float32 tensor scale."""
    groups = scheme.num_groups(in_features)
    scale_rows = out_features if scheme.block_rows is None else math.ceil(out_features / scheme.block_rows)
    bits = (out_features * in_features * scheme.bits
            + scale_rows * groups * _FLOAT_SCALE_BITS[scheme.scale_format or "float"])
    return bits + (32 if scheme.scale_format == "e4m3" else 0)


def _stored_groups(scheme: QuantScheme, in_features: int) -> int:
    group = scheme.group_size or in_features
    if group < in_features:
        # The writer stores a group size that does not divide K as the finer groups that do
        # (ct_pack's per_layer regrouping): group 7 over 64 columns is 64 groups of one.
        group = math.gcd(group, in_features)
    return math.ceil(in_features / group)


def _bits_per_weight(scheme: QuantScheme | None, in_features: int) -> float | None:
    if scheme is None:
        return None
    if scheme.type == "float":
        rows = scheme.block_rows or 1  # a block's rows share their scales
        return _float_stored_bits(scheme, rows, in_features) / (rows * in_features)
    return scheme.bits + 64 * _stored_groups(scheme, in_features) / in_features  # 8-byte scale + zero per group


def _stored_bits(scheme: QuantScheme | None, out_features: int, in_features: int, float_bits: int,
                 permuted: bool = False) -> int:
    """What ct_pack writes for one weight: int32 words of codes packed across each row, a scale per
    group in the stored float dtype, packed zero points when asymmetric, int32 act-order group
    indices when permuted, the int64 shape pair."""
    if scheme is None:
        return out_features * in_features * float_bits
    if scheme.type == "float":
        return _float_stored_bits(scheme, out_features, in_features)
    groups = _stored_groups(scheme, in_features)
    bits = out_features * 32 * math.ceil(in_features * scheme.bits / 32) + out_features * groups * float_bits + 128
    if not scheme.symmetric:
        bits += 32 * math.ceil(out_features * scheme.bits / 32) * groups
    if permuted:
        bits += 32 * in_features
    return bits


def _write(src: ExportSource, directory: Path, *, max_shard_bytes: int | None = None,
           requantize: bool = False) -> dict:
    from optc.export.ct_pack import DEFAULT_SHARD_BYTES

    shard = DEFAULT_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes
    # The sub-format follows from what was quantized: W8A8 and float grids have their own.
    if src.input_quant or any(p.scheme.type == "float" for p in src.qparams.values()):
        from optc.export.ct_int import write_int

        summary = write_int(src, directory, max_shard_bytes=shard)
    else:
        from optc.export.ct_pack import write_pack

        summary = write_pack(src, directory, max_shard_bytes=shard)
    save_tokenizer(src, directory)
    warn_unfused(src, NAME)
    summary["format"] = f"{NAME}/{summary['format']}"
    return summary


def _read(path: Path, dtype: torch.dtype):
    """pack-quantized and int-quantized (W8A8) alike; stored activation scales are attached
    again, so the model evaluates with its activations quantized as a runtime would."""
    from optc.compress.actquant import attach_input_quant
    from optc.compress.kvquant import attach_kv_quant
    from optc.export.ct_int import read_compressed_tensors
    from optc.export.ct_pack import read_kv_quant
    from optc.export.reading import load_dequantized
    from optc.model.load import CheckpointRead

    input_quant: dict = {}
    kv_quant: dict = {}

    def read(directory: Path):
        state, qparams, found = read_compressed_tensors(directory)
        input_quant.update(found)
        kv_quant.update(read_kv_quant(directory, state))
        return state, qparams

    model, qparams = load_dequantized(Path(path), dtype, read)
    for name, iq in input_quant.items():
        attach_input_quant(model.get_submodule(name), iq)
    for name, kq in kv_quant.items():
        attach_kv_quant(model.get_submodule(name), kq)
    masks, nm = sparsity_masks(path, model)
    return CheckpointRead(model, qparams, masks, nm)


def _detect(path: Path) -> bool:
    return (quantization_config(path) or {}).get("quant_method") == NAME


def _quantized(path: Path) -> bool:
    return bool((quantization_config(path) or {}).get("config_groups"))


def _dynamic_word(dynamic: object) -> str:
    # compressed-tensors' dynamic is true, false or "local" (NVFP4: group scales at run time,
    # the tensor scale calibrated).
    return {True: "dynamic", "local": "locally dynamic"}.get(dynamic, "static")  # type: ignore[call-overload]


def _summary(qc: dict) -> dict:
    groups = qc.get("config_groups") or {}
    sparse = (qc.get("sparsity_config") or {}).get("sparsity_structure")
    if not groups:  # pruned only: plain dense tensors (zeros included) plus sparsity metadata
        return {"format": "dense", **({"sparsity_structure": sparse} if sparse else {})}
    weights = [g.get("weights") or {} for g in groups.values()]
    acts = [g.get("input_activations") for g in groups.values() if g.get("input_activations")]
    return {
        "format": f"{NAME}/{qc.get('format')}",
        "bits": sorted({w.get("num_bits") for w in weights}),
        "group_size": sorted({w.get("group_size") for w in weights}, key=str),
        "symmetric": sorted({w.get("symmetric") for w in weights}),
        "act_order": sorted({str(w.get("actorder")) for w in weights}),
        "activations": sorted({f"{_dynamic_word(a.get('dynamic'))} {a.get('type', 'int')}"
                               f"{a.get('num_bits')}" for a in acts}) if acts else "float",
        "weight_types": sorted({w.get("type", "int") for w in weights}),
        "ignore": qc.get("ignore", []),
        **({"sparsity_structure": sparse} if sparse else {}),
    }


def _packed_weights(fh: Any, key: str) -> int | None:
    shape_key = f"{key.removesuffix('.weight_packed')}.weight_shape"
    if shape_key in fh.keys():
        return int(math.prod(fh.get_tensor(shape_key).tolist()))
    packed = fh.get_slice(key)
    if packed.get_dtype() == "U8":  # NVFP4 / MXFP4: two E2M1 codes a byte, no shape tensor
        return 2 * int(math.prod(packed.get_shape()))
    return None


def _describe(path: Path) -> dict:
    qc = read_config(path).get("quantization_config") or {}
    return describe_safetensors(path, _summary(qc), skip=_AUX_SUFFIXES, packed={".weight_packed": _packed_weights})


COMPRESSED_TENSORS = Format(
    name=NAME,
    description="compressed-tensors pack-quantized, int-quantized for W8A8, float-quantized (FP8), "
                "nvfp4/mxfp4-pack-quantized (llm-compressor's layouts), loaded by transformers and vLLM",
    fits=_fits,
    write=_write,
    read=_read,
    detect=_detect,
    describe=_describe,
    bits_per_weight=_bits_per_weight,
    stored_bits=_stored_bits,
    needs_quantized=True,
    usage="""transformers (with the `compressed-tensors` package installed):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{path}")
tokenizer = AutoTokenizer.from_pretrained("{path}")
```

vLLM (reads the quantization from config.json):

```python
from vllm import LLM

llm = LLM(model="{path}")
print(llm.generate("The capital of France is")[0].outputs[0].text)
```
""",
    holds_activations=True,
    holds_kv_cache=True,
    sparsity_metadata=True,
    quantized=_quantized,
)


# --- sparsity metadata (pruned models are stored dense, with their zeros) --------------------


def sparsity_config(model: torch.nn.Module, masks: dict[str, torch.Tensor]) -> dict:
    """The ``sparsity_config`` block of compressed-tensors for a model pruned in place.

    Fields as ``compressed_tensors.config.SparsityCompressionConfig`` 0.20.1 defines them:
    ``format`` ``dense`` (the weights are stored uncompressed, zeros included, so every loader
    reads them), ``targets`` the pruned Linears, ``ignore`` the other Linears,
    ``global_sparsity`` the share of zeros over all of the model's parameters, and
    ``sparsity_structure`` ``"N:M"`` when every pruned Linear is N:M along its input dimension
    (checked on the weights, not taken from the recipe), else ``unstructured``.
    """
    import torch

    modules = dict(model.named_modules())
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in params)
    zeros = sum(int((p == 0).sum()) for p in params)
    return {
        "format": "dense",
        "targets": sorted(masks),
        "ignore": sorted(n for n, m in modules.items() if isinstance(m, torch.nn.Linear) and n not in masks),
        "global_sparsity": round(zeros / max(1, total), 6),
        "sparsity_structure": _common_structure([modules[n].weight for n in masks if n in modules]),
    }


def _common_structure(weights: list) -> str:
    """``"N:M"`` if all weights hold at most N non-zeros in every M consecutive inputs (the
    smallest M of 4, 8, 16 and the N seen), else ``"unstructured"``."""
    if not weights:
        return "unstructured"
    for m in (4, 8, 16):
        if any(w.shape[-1] % m for w in weights):
            continue
        n = max(int((w.reshape(w.shape[0], -1, m) != 0).sum(-1).max()) for w in weights)
        if n < m and n * 2 <= m:  # denser groups are not N:M sparsity anyone accelerates
            return f"{n}:{m}"
    return "unstructured"


def write_sparsity_config(directory: Path, block: dict) -> None:
    """Add ``block`` as ``quantization_config.sparsity_config`` of ``directory/config.json``.

    A quantized checkpoint already has a compressed-tensors ``quantization_config``; a dense
    one gets the minimal one llm-compressor writes for sparse-only models (no config groups,
    format ``dense``), which transformers loads through compressed-tensors unchanged.
    """
    from optc.export.ct_pack import _ct_version

    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    qc = config.get("quantization_config")
    if qc is None:
        qc = {
            "version": _ct_version(),
            "quant_method": NAME,
            "config_groups": {},
            "format": "dense",
            "quantization_status": "compressed",
            "ignore": [],
            "transform_config": {},
        }
    elif qc.get("quant_method") != NAME:
        raise OptcError(f"{path}: sparsity metadata needs a compressed-tensors config, not {qc.get('quant_method')!r}")
    qc["sparsity_config"] = block
    config["quantization_config"] = qc
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def sparsity_masks(path: Path | None, model: torch.nn.Module) -> tuple[dict, tuple[int, int] | None]:
    """Keep masks of a pruned checkpoint (the Linears its ``sparsity_config`` lists, masked
    where their weights are zero), so later stages keep its zeros; and its N:M pattern."""
    import torch

    try:
        qc = quantization_config(path) or {} if path is not None else {}
    except OptcError:
        return {}, None
    sc = qc.get("sparsity_config") or {}
    modules = dict(model.named_modules())
    masks = {}
    for name in sc.get("targets") or []:
        module = modules.get(name)
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            w = weight.detach()
            masks[name] = (w.t() if type(module).__name__ == "Conv1D" else w) != 0
    structure = str(sc.get("sparsity_structure") or "")
    n, sep, m = structure.partition(":")
    nm = (int(n), int(m)) if sep and n.isdigit() and m.isdigit() else None
    return masks, nm


# --- the readers and writers under their older names (kept for callers that import them here) -


def read_pack_quantized(directory: Path):
    from optc.export.ct_pack import read_pack_quantized as read

    return read(directory)


def dequantize_packed(name: str, tensors: dict, qc: dict):
    from optc.export.ct_pack import dequantize_packed as dequantize

    return dequantize(name, tensors, qc)


def read_compressed_tensors(directory: Path):
    from optc.export.ct_int import read_compressed_tensors as read

    return read(directory)


def write_pack_quantized(model: Any, qparams: dict, directory: Path, **kwargs: Any) -> dict:
    from optc.export.ct_pack import write_pack_quantized as write

    return write(model, qparams, directory, **kwargs)


def write_int_quantized(model: Any, qparams: dict, input_quant: dict, directory: Path, **kwargs: Any) -> dict:
    from optc.export.ct_int import write_int_quantized as write

    return write(model, qparams, input_quant, directory, **kwargs)
