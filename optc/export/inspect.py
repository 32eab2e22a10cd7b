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
        sparse = (qc.get("sparsity_config") or {}).get("sparsity_structure")
        if not groups:  # pruned only: plain dense tensors (zeros included) plus sparsity metadata
            return {"format": "dense", **({"sparsity_structure": sparse} if sparse else {})}
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
            **({"sparsity_structure": sparse} if sparse else {}),
        }
    if method in ("gptq", "awq"):
        group = qc.get("group_size", qc.get("q_group_size"))
        bits = qc.get("bits", qc.get("w_bit"))
        sym = qc.get("sym", not qc.get("zero_point", False))
        return {
            "scheme": f"int{bits}-{'sym' if sym else 'asym'}-{'channel' if group in (-1, None) else f'g{group}'}",
            "format": (f"gptq/{qc.get('checkpoint_format', qc.get('format', 'gptq'))}" if method == "gptq"
                       else f"awq/{qc.get('version', 'gemm')}"),
            "bits": [bits],
            "group_size": ["channel" if group in (-1, None) else group],
            # AWQ GEMM always stores zero points; optc writes symmetric grids with zero 8.
            "symmetric": [sym],
            "act_order": [str(qc.get("desc_act", False))],
            "ignore": qc.get("modules_to_not_convert") or [],
        }
    return {"format": str(method)}


def _packed_params(fh, key: str, qc: dict | None) -> int | None:
    """Weights held by a GPTQ/AWQ ``qweight``: K from its rows, N from the ``scales`` beside it."""
    base = key.rsplit(".", 1)[0]
    if f"{base}.scales" not in fh.keys():
        return None
    n = fh.get_slice(f"{base}.scales").get_shape()[1]
    rows = fh.get_slice(key).get_shape()[0]
    qc = qc or {}
    if qc.get("quant_method") == "gptq":  # [K * b / 32, N]
        return rows * 32 // int(qc.get("bits", 4)) * n
    return rows * n  # AWQ: [K, N / 8]


def _packed_stats(directory: Path, fmt: str) -> dict:
    """Sparsity of GPTQ/AWQ weights (codes equal to their zero point), and whether an AWQ file's
    zero points are all 8, i.e. a symmetric grid stored in AWQ's always-asymmetric layout."""
    from optc.export.awq_format import read_awq
    from optc.export.gptq_format import read_gptq

    state, qparams = (read_gptq if fmt.startswith("gptq") else read_awq)(directory)
    weights = [state[f"{name}.weight"] for name in qparams]
    total = sum(w.numel() for w in weights)
    out: dict = {"sparsity": round(sum(int((w == 0).sum()) for w in weights) / max(1, total), 4)}
    if fmt.startswith("awq"):
        sym = all(p.scheme.symmetric for p in qparams.values())
        out["symmetric"] = [sym]
        out["scheme"] = f"int4-{'sym' if sym else 'asym'}-g{next(iter(qparams.values())).scheme.group_size}"
    return out


def _scan_tensors(directory: Path, qc: dict | None = None) -> dict:
    from safetensors import SafetensorError

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
                        elif (packed := _packed_params(fh, key, qc)) is not None:
                            params += packed
                        else:  # GPTQ qweight: [K / pack, N] int32 holding 32 / bits values each
                            t = fh.get_slice(key)
                            params += int(math.prod(t.get_shape())) * 8
                        continue
                    t = fh.get_tensor(key)
                    params += t.numel()
                    if t.dim() == 2 and "embed" not in key and "lm_head" not in key:
                        linear_params += t.numel()
                        zeros += int((t == 0).sum())
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
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
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1 and not (path / "config.json").exists():
        return _inspect_gguf(ggufs[0])  # a directory optc exported as GGUF
    config_path = path / "config.json"
    if not config_path.is_file():
        raise OptcError(f"{path} is not a checkpoint directory (no config.json)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise OptcError(f"{config_path}: not valid JSON ({exc.msg})") from None
    info = {"path": str(path), "architecture": (config.get("architectures") or ["?"])[0]}
    info.update(_quant_summary(config.get("quantization_config")))
    info.update(_scan_tensors(path, config.get("quantization_config")))
    if info["format"].startswith(("gptq", "awq")):
        info.update(_packed_stats(path, info["format"]))
    info["bytes"] = directory_bytes(path)
    info["ratio_to_fp16"] = round(info["bytes"] / max(1, 2 * info["parameters"]), 4)
    return info


_GGUF_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5}


def _gguf_string(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    return bytes(field.parts[field.data[0]]).decode() if field is not None else None


def _inspect_gguf(path: Path) -> dict:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError, IndexError) as exc:  # truncated files fail inside numpy views
        raise OptcError(f"cannot read GGUF file {path}: {exc}") from None
    from gguf import dequantize

    types: dict[str, int] = {}
    params = zeros = linear_params = 0
    block_types: set[str] = set()
    for t in reader.tensors:
        name = t.tensor_type.name
        types[name] = types.get(name, 0) + 1
        params += int(t.n_elements)
        if len(t.shape) > 1 and t.name.startswith("blk."):
            block_types.add(name)
            try:
                zeros += int((dequantize(t.data, t.tensor_type) == 0).sum())
            except (NotImplementedError, ValueError) as exc:
                raise OptcError(f"cannot read tensor {t.name} of GGUF file {path}: {exc}") from None
            linear_params += int(t.n_elements)
    size = path.stat().st_size
    info = {
        "path": str(path),
        "architecture": _gguf_string(reader, "general.architecture") or "?",
        "format": "gguf",
        "scheme": "+".join(sorted(block_types)) or "-",
        "tensor_types": types,
        # The decoder matrices' types: what the file's quantization is.
        "bits": sorted({_GGUF_BITS.get(n, n) for n in block_types}, key=str),
        "group_size": [32] if block_types & {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"} else [],
        "symmetric": sorted({n in ("Q4_0", "Q5_0", "Q8_0") for n in block_types if n.startswith("Q")}),
        "act_order": ["False"],
    }
    scheme = _gguf_string(reader, "optc.scheme")
    if scheme is not None:
        exact = reader.fields.get("optc.exact_modules")
        info["optc_scheme"] = scheme
        info["optc_exact_modules"] = int(exact.parts[exact.data[0]][0]) if exact is not None else 0
    info.update({"parameters": params, "sparsity": round(zeros / linear_params, 4) if linear_params else 0.0,
                 "bytes": size, "ratio_to_fp16": round(size / max(1, 2 * params), 4)})
    return info
