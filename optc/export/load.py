"""Loading any checkpoint optc knows: the format that recognises a local directory reads it
(optc's own readers for compressed-tensors, GPTQ and AWQ: the float model with exactly the stored
weights, plus its grids); dense directories, GGUF files, hub ids and the built-in model are
loaded by :mod:`optc.model.load`."""

from __future__ import annotations

from pathlib import Path

from optc.errors import OptcError
from optc.export.formats import detect_format
from optc.model import load as model_load
from optc.model.load import CheckpointRead, LoadedModel


def read_checkpoint(path: Path, dtype) -> CheckpointRead | None:
    """The checkpoint at ``path`` read by the format that recognises it; None when none does
    or its format leaves reading to transformers."""
    fmt = detect_format(Path(path))
    if fmt is None or fmt.read is None:
        return None
    return fmt.read(Path(path), dtype)


def load_checkpoint(source: str | None = None, dtype: str = "float32", trust_remote_code: bool = False) -> LoadedModel:
    """Load a causal LM, its tokenizer and (if quantized) its grids from any supported source."""
    # Looked up at call time, so a patched optc.model.load.load_model is the one called.
    return model_load.load_model(source, dtype, trust_remote_code, read_checkpoint=read_checkpoint)


def quantized_format(source: str | None) -> str | None:
    """The format of a local checkpoint that stores quantized weights (a recovered checkpoint is
    written back in it), or None."""
    if source is None or not checkpoint_is_quantized(source):
        return None
    return detect_format(Path(source).expanduser()).name


def checkpoint_is_quantized(source: str) -> bool:
    """Whether a local checkpoint directory stores quantized weights (read from config.json)."""
    path = Path(source).expanduser()
    if not path.is_dir():
        return False
    try:
        fmt = detect_format(path)
    except OptcError:
        return False
    if fmt is None:
        return False
    return fmt.quantized(path) if fmt.quantized is not None else fmt.needs_quantized
