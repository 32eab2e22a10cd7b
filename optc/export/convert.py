"""Writing a compressed model in any registered format, and converting checkpoints between them.

The quantization grid (codes, scales, zero points, groups) travels as :class:`QuantParams`, the one
representation every reader returns and every writer takes, so a conversion re-packs the same
integers and never re-runs calibration. A target that cannot hold the grid is refused with the
reason before anything is written (the output is assembled in a staging directory, see
:func:`optc.export.checkpoint.staged_output`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from optc.compress.quant import QuantParams
from optc.errors import OptcError
from optc.export.checkpoint import check_output, claimed_output, staged_output
from optc.export.formats import FORMATS, get_format
from optc.export.source import ModelSource

log = logging.getLogger(__name__)

__all__ = ["FORMATS", "check_format", "convert_checkpoint", "export_model"]


def check_format(fmt: str) -> str:
    return get_format(fmt).name


def export_model(
    model: torch.nn.Module,
    tokenizer,
    qparams: dict[str, QuantParams],
    fmt: str,
    directory: Path,
    *,
    max_shard_bytes: int | None = None,
    requantize: bool = False,
    imatrix: Path | None = None,
) -> dict:
    """Write ``model`` (weights fake-quantized on ``qparams``' grids) into ``directory`` as ``fmt``
    (``imatrix``: llama.cpp's importance matrix, for the formats that round weights themselves).

    Weight grids only: activation quantization attached to the model is not written. Returns a
    summary with at least ``format`` (and ``file`` for a one-file format such as GGUF, whose
    tokenizer is inside); ``max_shard_bytes`` None is the format's default shard size.
    """
    target = get_format(fmt)
    if target.needs_quantized and not qparams:
        raise OptcError(f"export format {fmt} holds quantized weights; this model has none "
                        "(quantize it first, or export dense / gguf)")
    extra = {}
    if imatrix is not None:
        if not target.takes_imatrix:
            able = ", ".join(n for n, f in FORMATS.items() if f.takes_imatrix)
            raise OptcError(f"an imatrix weighs the rounding of formats that quantize weights themselves ({able}); "
                            f"{fmt} does not")
        extra["imatrix"] = Path(imatrix)
    return target.write(ModelSource(model, tokenizer, qparams), Path(directory),
                        max_shard_bytes=max_shard_bytes, requantize=requantize, **extra)


def convert_checkpoint(
    source: str,
    output: Path,
    fmt: str,
    *,
    overwrite: bool = False,
    requantize: bool = False,
    max_shard_bytes: int | None = None,
    force: bool = False,
    imatrix: Path | None = None,
) -> dict:
    """Read ``source`` (any format optc reads, or a dense / GGUF / hub model) and write it as ``fmt``.

    The quantization grid read from ``source`` is written again as it is: no calibration, no
    re-rounding (GGUF targets re-round only with ``requantize``, and say so).
    """
    from optc.model.load import local_path

    target = get_format(fmt)
    output = Path(output)
    inputs = {"model": local_path(source)}
    check_output(output, overwrite, inputs, force=force)
    with claimed_output(output, overwrite, inputs, force=force):
        return _convert(source, output, fmt, target, overwrite=overwrite, force=force, requantize=requantize,
                        max_shard_bytes=max_shard_bytes, imatrix=imatrix)


def _convert(source: str, output: Path, fmt: str, target, *, overwrite: bool, force: bool, requantize: bool,
             max_shard_bytes: int | None, imatrix: Path | None = None) -> dict:
    from optc.compress.actquant import input_quant_of
    from optc.export.checkpoint import check_free_space, estimate_checkpoint_bytes
    from optc.export.load import load_checkpoint

    loaded = load_checkpoint(source)
    if input_quant_of(loaded.model):
        raise OptcError(
            f"{source} also quantizes activations; {fmt} cannot hold activation quantization and "
            "dropping it would change what the model computes"
        )
    if target.needs_quantized and not loaded.qparams:
        raise OptcError(
            f"{source} holds no quantized weights optc can read, so there is no grid to write as {fmt} "
            "(quantize it with optc quantize, or export dense / gguf)"
        )
    check_free_space(output, estimate_checkpoint_bytes(loaded.model, {n: p.scheme for n, p in loaded.qparams.items()}, fmt))
    with staged_output(output, overwrite, {"model": loaded.path}, force=force) as tmp:
        summary = export_model(loaded.model, loaded.tokenizer, loaded.qparams, fmt, tmp,
                               max_shard_bytes=max_shard_bytes, requantize=requantize, imatrix=imatrix)
    summary.update({"source": str(source), "path": str(output), "modules_read": len(loaded.qparams)})
    if "file" in summary:  # a one-file format: the path is the file
        summary["path"] = str(output / summary["file"])
    log.info("converted %s -> %s (%s)", source, output, summary["format"])
    return summary
