"""Checkpoint files every format shares: ``config.json`` and its ``quantization_config`` (read
in this one place), the config written beside quantized weights, safetensors reading, and the
tensor scan behind ``optc inspect``.

Importing this module imports neither torch nor transformers (the format registry and the
recipe schema import it); the functions that need them import them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from optc.errors import OptcError

CONFIG = "config.json"


def grid_bits_per_weight(scheme: Any, in_features: int) -> float | None:
    """Stored bits per weight of a Linear on ``scheme``'s grid with an 8-byte scale and zero point
    per group (the GPTQ and AWQ layouts); None for a Linear kept in float."""
    if scheme is None:
        return None
    group = scheme.group_size or in_features
    return scheme.bits + 64 * math.ceil(in_features / group) / in_features


def dequantizing_reader(read_state: Callable[[Path], tuple[dict, dict]]) -> Callable[[Path, Any], Any]:
    """A ``Format.read`` that builds the float model from ``read_state(path)``: the dequantized
    state dict and the grids (see :func:`optc.export.reading.load_dequantized`)."""

    def read(path: Path, dtype: Any) -> Any:
        from optc.export.reading import load_dequantized
        from optc.model.load import CheckpointRead

        model, qparams = load_dequantized(Path(path), dtype, read_state)
        return CheckpointRead(model, qparams)

    return read


def config_file(path: Path) -> Path | None:
    """``path/config.json`` when ``path`` is a directory holding one."""
    path = Path(path)
    config = path / CONFIG
    return config if path.is_dir() and config.is_file() else None


def read_config(path: Path) -> dict:
    """The parsed ``config.json`` of a checkpoint directory; unreadable or invalid JSON is an error."""
    config = Path(path) / CONFIG
    try:
        return json.loads(config.read_text())
    except json.JSONDecodeError as exc:
        raise OptcError(f"{config}: not valid JSON ({exc.msg})") from None
    except OSError as exc:
        raise OptcError(f"cannot read {config}: {exc.strerror}") from None


def quantization_config(path: Path) -> dict | None:
    """The ``quantization_config`` block of a checkpoint directory's ``config.json``; None when the
    directory has no config.json or the config has no (or an empty) block."""
    if config_file(path) is None:
        return None
    return read_config(path).get("quantization_config") or None


def quant_method(path: Path) -> str | None:
    """``quantization_config.quant_method`` of a checkpoint directory, or None."""
    return (quantization_config(path) or {}).get("quant_method")


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def write_config(src: Any, quantization_config: dict, directory: Path) -> None:
    """``config.json`` of ``src`` (an :class:`optc.export.source.ExportSource`) with the
    quantization block, plus its generation config."""
    config = src.config.to_dict()
    config["dtype"] = str(src.dtype).removeprefix("torch.")
    config["quantization_config"] = quantization_config
    (Path(directory) / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if getattr(src, "generation_config", None) is not None:
        src.generation_config.save_pretrained(directory)


def read_tensors(directory: Path) -> dict:
    """All ``*.safetensors`` of a checkpoint directory; a corrupt or truncated file is an error naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise OptcError(f"{directory} holds no .safetensors weights")
    out: dict = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise OptcError(f"cannot read checkpoint file {f}: {exc}") from None
    return out


# --- optc inspect -----------------------------------------------------------------------------

# Weights a packed tensor holds, from the open file and the tensor's key (None: not known).
PackedCount = Callable[[Any, str], "int | None"]


def scan_safetensors(directory: Path, skip: tuple[str, ...] = (), packed: Mapping[str, PackedCount] | None = None) -> dict:
    """Parameter count and sparsity of a directory's safetensors files, read without building a model.

    Keys ending in ``skip`` (scales, zero points, indices) are not weights; keys ending in a
    suffix of ``packed`` hold several weights each, counted by its function (a shape tensor
    beside them, or the shapes), else as 8 per element (int32 words of 4-bit codes).
    Sparsity is the share of zeros in the 2-D tensors outside embeddings and head.
    """
    from safetensors import SafetensorError, safe_open

    packed = dict(packed or {})
    suffixes = tuple(packed)
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise OptcError(f"{directory} holds no .safetensors weights")
    params = zeros = linear_params = 0
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    if key.endswith(skip):
                        continue
                    if suffixes and key.endswith(suffixes):
                        count = packed[next(s for s in suffixes if key.endswith(s))](fh, key)
                        params += count if count is not None else int(math.prod(fh.get_slice(key).get_shape())) * 8
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


def describe_safetensors(path: Path, summary: dict, skip: tuple[str, ...] = (),
                         packed: Mapping[str, PackedCount] | None = None) -> dict:
    """What ``optc inspect`` prints for a safetensors checkpoint directory: its architecture,
    ``summary`` (format, scheme ...), parameters, sparsity, size and size relative to float16."""
    path = Path(path)
    config = read_config(path)
    info = {"path": str(path), "architecture": (config.get("architectures") or ["?"])[0]}
    info.update(summary)
    info.update(scan_safetensors(path, skip, packed))
    info["bytes"] = directory_bytes(path)
    info["ratio_to_fp16"] = round(info["bytes"] / max(1, 2 * info["parameters"]), 4)
    return info


def one_scheme_summary(qc: dict, fmt: str) -> dict:
    """``optc inspect``'s summary of a GPTQ/AWQ-style config (one scheme, ``fmt`` the label)."""
    group = qc.get("group_size", qc.get("q_group_size"))
    bits = qc.get("bits", qc.get("w_bit"))
    sym = qc.get("sym", not qc.get("zero_point", False))
    return {
        "scheme": f"int{bits}-{'sym' if sym else 'asym'}-{'channel' if group in (-1, None) else f'g{group}'}",
        "format": fmt,
        "bits": [bits],
        "group_size": ["channel" if group in (-1, None) else group],
        # AWQ GEMM always stores zero points; optc writes symmetric grids with zero 8.
        "symmetric": [sym],
        "act_order": [str(qc.get("desc_act", False))],
        "ignore": qc.get("modules_to_not_convert") or [],
    }


def code_sparsity(state: Mapping, qparams: Mapping) -> float:
    """Share of zeros in the dequantized weights of the quantized modules (codes equal to their zero point)."""
    weights = [state[f"{name}.weight"] for name in qparams]
    total = sum(w.numel() for w in weights)
    return round(sum(int((w == 0).sum()) for w in weights) / max(1, total), 4)
