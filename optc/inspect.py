"""What a checkpoint holds, read from its files without instantiating the model."""

from __future__ import annotations

import json
import math
from pathlib import Path

from safetensors import safe_open

from optc.errors import OptcError
from optc.export.checkpoint import directory_bytes

_PACKED_SUFFIXES = (".weight_packed", ".qweight")
_AUX_SUFFIXES = (
    ".weight_scale", ".weight_zero_point", ".weight_g_idx", ".weight_shape", ".qzeros",
    ".scales", ".g_idx", ".input_scale", ".input_zero_point",
)


def _quant_summary(qc: dict | None) -> dict:
    if not qc:
        return {"format": "dense"}
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        weights = [g.get("weights") or {} for g in groups.values()]
        acts = [g.get("input_activations") for g in groups.values() if g.get("input_activations")]
        return {
            "format": f"compressed-tensors/{qc.get('format')}",
            "bits": sorted({w.get("num_bits") for w in weights}),
            "group_size": sorted({w.get("group_size") for w in weights}, key=str),
            "symmetric": sorted({w.get("symmetric") for w in weights}),
            "act_order": sorted({str(w.get("actorder")) for w in weights}),
            "activations": "static/dynamic int8" if acts else "float",
            "ignore": qc.get("ignore", []),
        }
    if method in ("gptq", "awq"):
        return {
            "format": method if method == "gptq" else f"awq/{qc.get('version', 'gemm')}",
            "bits": [qc.get("bits", qc.get("w_bit"))],
            "group_size": [qc.get("group_size", qc.get("q_group_size"))],
            "symmetric": [qc.get("sym", not qc.get("zero_point", False))],
            "act_order": [str(qc.get("desc_act", False))],
        }
    return {"format": str(method)}


def _scan_tensors(directory: Path) -> dict:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise OptcError(f"{directory} holds no .safetensors weights")
    params = zeros = linear_params = 0
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    if key.endswith(_AUX_SUFFIXES):
                        continue
                    if key.endswith(_PACKED_SUFFIXES):
                        base = key.rsplit(".", 1)[0]
                        shape_key = f"{base}.weight_shape"
                        if shape_key in fh.keys():
                            params += int(math.prod(fh.get_tensor(shape_key).tolist()))
                        else:  # GPTQ qweight: [K / pack, N] int32 holding 32 / bits values each
                            t = fh.get_slice(key)
                            params += int(math.prod(t.get_shape())) * 8
                        continue
                    t = fh.get_tensor(key)
                    params += t.numel()
                    if t.dim() == 2 and "embed" not in key and "lm_head" not in key:
                        linear_params += t.numel()
                        zeros += int((t == 0).sum())
        except (OSError, RuntimeError, ValueError) as exc:
            raise OptcError(f"cannot read checkpoint file {f}: {exc}") from None
    return {
        "parameters": params,
        "sparsity": round(zeros / linear_params, 4) if linear_params else 0.0,
    }


def inspect_checkpoint(path: Path) -> dict:
    """Format, scheme, sparsity, size and parameter count of a checkpoint directory."""
    path = Path(path).expanduser()
    if not path.exists():
        raise OptcError(f"checkpoint not found: {path}")
    if path.is_file() and path.suffix == ".gguf":
        return _inspect_gguf(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise OptcError(f"{path} is not a checkpoint directory (no config.json)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise OptcError(f"{config_path}: not valid JSON ({exc.msg})") from None
    info = {"path": str(path), "architecture": (config.get("architectures") or ["?"])[0]}
    info.update(_quant_summary(config.get("quantization_config")))
    info.update(_scan_tensors(path))
    info["bytes"] = directory_bytes(path)
    info["ratio_to_fp16"] = round(info["bytes"] / max(1, 2 * info["parameters"]), 4)
    return info


def _inspect_gguf(path: Path) -> dict:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise OptcError(f"cannot read GGUF file {path}: {exc}") from None
    types: dict[str, int] = {}
    params = 0
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        params += int(t.n_elements)
    arch = reader.fields.get("general.architecture")
    arch_name = bytes(arch.parts[arch.data[0]]).decode() if arch else "?"
    size = path.stat().st_size
    return {
        "path": str(path),
        "architecture": arch_name,
        "format": "gguf",
        "tensor_types": types,
        "parameters": params,
        "bytes": size,
        "ratio_to_fp16": round(size / max(1, 2 * params), 4),
    }
