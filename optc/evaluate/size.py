"""Size metrics: parameters, non-zeros, bits per weight, compression ratio vs float16.

Stored bytes are read from the weight files' headers (safetensors: each tensor's byte range;
GGUF: the file), so packed codes, scales, zero points and index tensors all count, and
nothing is loaded. Parameters count the model's logical weights (a packed 4-bit Linear
still has N x K parameters).
"""

from __future__ import annotations

from pathlib import Path

import torch

from optc.model.anatomy import select_linears, weight_2d
from optc.model.gguf_index import read_gguf_index
from optc.model.safetensors_io import header_json
from optc.errors import OptcError

# Tensor-name suffixes that belong to one quantized Linear's storage (compressed-tensors,
# GPTQ and AWQ layouts), besides the plain ``.weight`` / ``.bias``.
_LINEAR_SUFFIXES = (
    ".weight", ".bias", ".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_g_idx",
    ".weight_shape", ".qweight", ".qzeros", ".scales", ".g_idx", ".input_scale", ".input_global_scale", ".input_zero_point",
)


def safetensors_tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of each tensor in a ``.safetensors`` file, from its JSON header alone (a corrupt
    header is one line naming the file)."""
    header, _ = header_json(path)
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, non-zero parameters), tied tensors counted once."""
    params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    return (sum(p.numel() for p in params.values()),
            sum(int(torch.count_nonzero(p)) for p in params.values()))


def _linear_of(key: str, linears: set[str]) -> str | None:
    for suffix in _LINEAR_SUFFIXES:
        if key.endswith(suffix) and key[: -len(suffix)] in linears:
            return key[: -len(suffix)]
    return None


def size_metrics(
    model: torch.nn.Module, path: Path | None, counts: tuple[int, int, int, int] | None = None
) -> dict:
    """The ``metrics.size`` section of a report for ``model`` stored at ``path`` (if any).

    ``counts`` (parameters, non-zeros, decoder-Linear weights, their zeros) stands in for
    counting on ``model`` when its tensors are not in memory (streaming).
    """
    try:
        linears = select_linears(model, [".*"], [])
    except OptcError:  # no recognisable decoder layers: whole-model numbers only
        linears = {}
    if counts is None:
        parameters, nonzero = parameter_counts(model)
        linear_params = sum(weight_2d(m).numel() for m in linears.values())
        linear_zeros = sum(int((weight_2d(m) == 0).sum()) for m in linears.values())
    else:
        parameters, nonzero, linear_params, linear_zeros = counts
    out = {
        "bytes_on_disk": None, "weight_bytes": None, "parameters": parameters, "nonzero": nonzero,
        "sparsity": round(linear_zeros / linear_params, 6) if linear_params else None,
        "bits_per_weight": None, "linear_bits_per_weight": None, "compression_ratio": None,
    }
    if path is None or not Path(path).exists():
        return out
    path = Path(path)
    linear_bytes = None
    ggufs = [path] if path.suffix == ".gguf" else sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1 and not (path.is_dir() and (path / "config.json").exists()):
        # As llama.cpp's loader counts a GGUF file's bits per weight: its tensors' bytes, no metadata.
        tensors = read_gguf_index(ggufs[0]).tensors
        out["bytes_on_disk"] = (path.stat().st_size if path.is_file()
                                else sum(p.stat().st_size for p in path.rglob("*") if p.is_file()))
        out["weight_bytes"] = sum(int(t.n_bytes) for t in tensors)
        linear_bytes = sum(int(t.n_bytes) for t in tensors if t.name.startswith("blk.") and len(t.shape) > 1)
    elif path.is_file():
        out["bytes_on_disk"] = out["weight_bytes"] = path.stat().st_size
    else:
        out["bytes_on_disk"] = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        files = sorted(path.glob("*.safetensors"))
        if files:
            per_tensor: dict[str, int] = {}
            for f in files:
                per_tensor.update(safetensors_tensor_bytes(f))
            out["weight_bytes"] = sum(per_tensor.values())
            names = set(linears)
            # Checkpoints of a *ForCausalLM are keyed by module name, so keys map to Linears.
            linear_bytes = sum(b for k, b in per_tensor.items() if _linear_of(k, names) is not None)
    if out["weight_bytes"]:
        out["bits_per_weight"] = round(8 * out["weight_bytes"] / parameters, 4)
        out["compression_ratio"] = round(2 * parameters / out["weight_bytes"], 4)
    if linear_bytes:
        out["linear_bits_per_weight"] = round(8 * linear_bytes / linear_params, 4)
    return out
