"""What a checkpoint holds, read from its files without instantiating the model."""

from __future__ import annotations

from pathlib import Path

from optc.errors import OptcError
from optc.export.files import config_file, describe_safetensors, quant_method
from optc.export.formats import detect_format


def inspect_checkpoint(path: Path) -> dict:
    """Format, scheme, sparsity, size and parameter count of a checkpoint directory or file,
    as the format that recognises it describes it."""
    path = Path(path).expanduser()
    if not path.exists():
        raise OptcError(f"checkpoint not found: {path}")
    fmt = detect_format(path)
    if fmt is not None:
        return fmt.describe(path)
    if config_file(path) is None:
        raise OptcError(f"{path} is not a checkpoint directory (no config.json)")
    # A quantization method no registered format reads: what its config says, and its tensors.
    return describe_safetensors(path, {"format": str(quant_method(path))})
