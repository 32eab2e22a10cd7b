"""Writing a compressed model in any format optc knows, and converting checkpoints between them.

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

from optc.compress.quant import QuantParams, QuantScheme
from optc.errors import OptcError
from optc.export.checkpoint import directory_bytes, staged_output, write_dense

log = logging.getLogger(__name__)

GGUF_PREFIX = "gguf-"
FORMATS = ("dense", "compressed-tensors", "gptq", "awq", "gguf-q4_0", "gguf-q8_0", "gguf-f16")
QUANTIZED_FORMATS = ("compressed-tensors", "gptq", "awq")


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise OptcError(f"unknown export format {fmt!r} (expected one of {', '.join(FORMATS)})")
    return fmt


def scheme_fits(scheme: QuantScheme, fmt: str, permuted_groups: bool = False) -> str | None:
    """Why a recipe's ``scheme`` can never be written as ``fmt`` (checked before calibration), or None."""
    from optc.export.gguf_format import BLOCK, GGUF_TYPES
    from optc.export.gptq_format import GPTQ_BITS

    if fmt == "gptq" and scheme.bits not in GPTQ_BITS:
        return f"GPTQ holds {'/'.join(map(str, GPTQ_BITS))}-bit weights, not {scheme.bits}-bit"
    if fmt == "awq":
        if scheme.bits != 4:
            return f"AWQ GEMM holds 4-bit weights only, not {scheme.bits}-bit"
        if permuted_groups:
            return "AWQ has no g_idx for act-order (permuted) groups"
    if fmt.startswith(GGUF_PREFIX):
        qtype = fmt.removeprefix(GGUF_PREFIX)
        span = GGUF_TYPES[qtype][0]
        if span is None:
            return None
        levels = (scheme.qmin, scheme.qmax) if scheme.symmetric else (-(2**scheme.bits - 1), 2**scheme.bits - 1)
        if levels[0] < span[0] or levels[1] > span[1]:
            return (f"{scheme.label()} needs integers in [{levels[0]}, {levels[1]}], "
                    f"{qtype.upper()} blocks hold [{span[0]}, {span[1]}]")
        if scheme.group_size is not None and scheme.group_size % BLOCK:
            return f"groups of {scheme.group_size} split {qtype.upper()}'s {BLOCK}-weight blocks"
        if permuted_groups:
            return f"act-order (permuted) groups split {qtype.upper()}'s blocks"
    return None


def check_recipe_export(recipe) -> None:
    """Refuse, before any calibration, a recipe whose schemes its export format cannot hold."""
    from optc.methods.stages import QUANT_STAGES

    fmt = recipe.export.format
    if fmt not in FORMATS:
        return
    schemes: list[tuple[str, QuantScheme]] = []
    for i, stage in enumerate(recipe.stages):
        if stage.type not in QUANT_STAGES:
            continue
        permuted = getattr(stage, "groups", None) == "permuted" and getattr(stage, "actorder", False)
        candidates = [("scheme", stage.scheme)] + [(f"override {o.pattern!r}", o.scheme) for o in stage.overrides]
        for where, scheme in candidates:
            if scheme is None:
                continue
            reason = scheme_fits(scheme, fmt, permuted)
            if reason is not None:
                raise OptcError(f"export format {fmt}: stage {i} ({stage.type}) {where}: {reason}")
            schemes.append((f"stage {i} {where}", scheme))
    if fmt in ("gptq", "awq"):
        kinds = {(s.bits, s.symmetric) for _, s in schemes}
        if len(kinds) > 1:
            raise OptcError(
                f"export format {fmt} holds one scheme per checkpoint; the recipe mixes "
                f"{', '.join(sorted({s.label() for _, s in schemes}))} (use compressed-tensors)"
            )


def export_model(
    model: torch.nn.Module,
    tokenizer,
    qparams: dict[str, QuantParams],
    fmt: str,
    directory: Path,
    *,
    max_shard_bytes: int = 2 * 1024**3,
    requantize: bool = False,
) -> dict:
    """Write ``model`` (weights fake-quantized on ``qparams``' grids) into ``directory`` as ``fmt``.

    Returns a summary with at least ``format``. GGUF formats write one ``model-<type>.gguf`` file
    (tokenizer inside); the others write safetensors, config and tokenizer files.
    """
    check_format(fmt)
    directory = Path(directory)
    if fmt.startswith(GGUF_PREFIX):
        from optc.export.gguf_format import write_gguf

        qtype = fmt.removeprefix(GGUF_PREFIX)
        return write_gguf(model, tokenizer, directory / f"model-{qtype}.gguf", qtype, qparams,
                          requantize=requantize)
    if fmt == "dense":
        write_dense(model, tokenizer, directory)
        return {"format": "dense", "bytes": directory_bytes(directory)}
    if not qparams:
        raise OptcError(f"export format {fmt} holds quantized weights; this model has none "
                        "(quantize it first, or export dense / gguf)")
    if fmt == "compressed-tensors":
        from optc.export.compressed_tensors import write_pack_quantized

        summary = write_pack_quantized(model, qparams, directory, max_shard_bytes=max_shard_bytes)
        summary["format"] = f"compressed-tensors/{summary['format']}"
    elif fmt == "gptq":
        from optc.export.gptq_format import write_gptq

        summary = write_gptq(model, qparams, directory, max_shard_bytes=max_shard_bytes)
    else:
        from optc.export.awq_format import write_awq

        summary = write_awq(model, qparams, directory, max_shard_bytes=max_shard_bytes)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return summary


def convert_checkpoint(
    source: str,
    output: Path,
    fmt: str,
    *,
    overwrite: bool = False,
    requantize: bool = False,
    max_shard_bytes: int = 2 * 1024**3,
) -> dict:
    """Read ``source`` (compressed-tensors, GPTQ, AWQ, dense or GGUF) and write it as ``fmt``.

    The quantization grid read from ``source`` is written again as it is: no calibration, no
    re-rounding (GGUF targets re-round only with ``requantize``, and say so).
    """
    from optc.compress.actquant import input_quant_of
    from optc.export.checkpoint import check_free_space, check_output, estimate_checkpoint_bytes
    from optc.model.load import load_model

    check_format(fmt)
    output = Path(output)
    check_output(output, overwrite)
    loaded = load_model(source)
    if input_quant_of(loaded.model):
        raise OptcError(
            f"{source} also quantizes activations; {fmt} cannot hold activation quantization and "
            "dropping it would change what the model computes"
        )
    if fmt in QUANTIZED_FORMATS and not loaded.qparams:
        raise OptcError(
            f"{source} holds no quantized weights optc can read, so there is no grid to write as {fmt} "
            "(quantize it with optc quantize, or export dense / gguf)"
        )
    check_free_space(output, estimate_checkpoint_bytes(loaded.model, {n: p.scheme for n, p in loaded.qparams.items()}, fmt))
    with staged_output(output, overwrite, protect=loaded.path) as tmp:
        summary = export_model(loaded.model, loaded.tokenizer, loaded.qparams, fmt, tmp,
                               max_shard_bytes=max_shard_bytes, requantize=requantize)
    summary.update({"source": str(source), "path": str(output), "modules_read": len(loaded.qparams)})
    if fmt.startswith(GGUF_PREFIX):
        summary["path"] = str(output / summary["file"])
    log.info("converted %s -> %s (%s)", source, output, summary["format"])
    return summary
