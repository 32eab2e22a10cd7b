"""The registry's data: what a checkpoint format is (:class:`Format`) and the table of them.

Import :mod:`optc.export.formats` to use the registry: it registers the built-in formats. This
module only holds the table, so the built-in format modules can import :func:`register`'s types
without importing each other (or the registry importing them back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Format:
    """One ``--format`` value: how to check, write, read, recognise and describe it."""

    name: str  # the --format value / recipe export.format
    description: str  # one line: what it is and which runtimes load it (--help, docs)
    # (weight scheme or None for a float Linear, act-order permuted groups) -> why the format can
    # never hold it, or None; checked on the recipe before any calibration.
    fits: Callable[[Any, bool], str | None]
    # write(src: ExportSource, directory, *, max_shard_bytes=None (the format's default),
    # requantize=False) -> summary with at least "format", the label written (e.g.
    # "compressed-tensors/pack-quantized"); "file" when the checkpoint is one file.
    write: Callable[..., dict]
    # read(path, torch dtype) -> optc.model.load.CheckpointRead (model with exactly the stored
    # weights, its grids, input quantization attached, pruning masks); None: transformers'
    # own loader reads it (optc.model.load).
    read: Callable[..., Any] | None
    detect: Callable[[Path], bool]  # is this file/directory in this format (config.json / suffix only)
    describe: Callable[[Path], dict]  # what `optc inspect` prints for it
    # Stored bits per weight of a Linear with this scheme and in_features, scales and zero points
    # included (for the free-space estimate); None: stored as it is in memory.
    bits_per_weight: Callable[[Any, int], float | None]
    # stored_bits(scheme, out_features, in_features, float_bits, permuted): exact stored bits of one
    # Linear weight on a scheme (None: kept in float, at float_bits), its scales, zero points,
    # act-order indices and shape included: what a size or bits-per-weight budget counts; it returns
    # None where the format cannot store that Linear on that scheme (GGUF's k-quant super-blocks
    # on rows they do not divide). None: the format cannot hold a budget's mix of schemes.
    stored_bits: Callable[[Any, int, int, int, bool], int | None] | None = None
    one_scheme: bool = False  # one (bits, symmetric) per checkpoint (awq)
    needs_quantized: bool = False  # refuses a model with nothing quantized
    holds_activations: bool = False  # stores activation quantization (W8A8)
    holds_kv_cache: bool = False  # stores KV-cache scales (k_scale / v_scale)
    sparsity_metadata: bool = False  # pruned models get compressed-tensors' sparsity_config
    # Whether a checkpoint detect() claims holds quantized weights (from its config only);
    # None: exactly when needs_quantized.
    quantized: Callable[[Path], bool] | None = None
    # How to load a checkpoint of this format, for its model card: Markdown with ``{path}`` (the
    # directory or hub id) and ``{file}`` (the weights file, for one-file formats).
    usage: str = ""
    # Why the input embedding cannot be stored in 8 bits (export.embedding_bits: 8), or None
    # when the format and its runtime hold it so (GGUF Q8_0 in llama.cpp); write() then takes
    # embedding_bits=8.
    # linear_schemes(model) -> {Linear name: scheme or None (float)}: the grid a quantizing stage
    # calibrates each Linear on when this format is the target, because the format fixes each
    # tensor's type itself (a GGUF mix); None: the stage's own schemes.
    linear_schemes: Callable[[Any], dict[str, Any]] | None = None
    # write() takes imatrix=PATH: llama.cpp's importance matrix weighs the rounding of the tensors
    # the format quantizes itself (GGUF).
    takes_imatrix: bool = False
    embedding_8bit: str | None = ("its runtimes (vLLM, transformers) load quantized Linear layers only, "
                                  "so the embedding stays 16-bit; GGUF stores it as Q8_0")


# name -> Format, in registration order (built-ins first: optc.export.formats).
FORMATS: dict[str, Format] = {}


def register(fmt: Format, *, replace: bool = False) -> Format:
    """Add ``fmt`` to the registry (``replace``: over an entry of the same name); returns it."""
    if not isinstance(fmt, Format):
        raise TypeError(f"register() takes a Format, got {type(fmt).__name__}")
    if fmt.name in FORMATS and FORMATS[fmt.name] is not fmt and not replace:
        raise ValueError(f"export format {fmt.name!r} is already registered")
    FORMATS[fmt.name] = fmt
    return fmt
