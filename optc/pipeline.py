"""Running a recipe end to end: load, evaluate, compress stage by stage, export, report."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from optc.data import check_disjoint, evaluation_tokens
from optc.errors import OptcError
from optc.evaluate.perplexity import perplexity
from optc.evaluate.report import new_report, write_report
from optc.export.compressed_tensors import write_pack_quantized
from optc.export.checkpoint import check_output, directory_bytes, staged_output, write_dense
from optc.models import load_model
from optc.progress import NullProgress, Progress
from optc.recipe import EvaluationConfig, Recipe
from optc.stages import STAGES, Workspace

log = logging.getLogger(__name__)


def _stage_summary(stats: dict) -> str:
    modules = stats.get("modules", {})
    if not modules:
        return ""
    parts = [f"{len(modules)} Linears"]
    errs = [m["rel_error"] for m in modules.values() if "rel_error" in m]
    if errs:
        schemes = sorted({m["scheme"] for m in modules.values() if "scheme" in m})
        parts.append(", ".join(schemes))
        parts.append(f"mean relative weight error {sum(errs) / len(errs):.4f}")
    sp = [m["sparsity"] for m in modules.values() if "sparsity" in m]
    if sp:
        parts.append(f"mean sparsity {sum(sp) / len(sp):.3f}")
    return "; ".join(parts)


def _evaluate(model, tokens, cfg: EvaluationConfig, progress: Progress) -> dict:
    return perplexity(
        model, tokens, cfg.seqlen, cfg.windows, cfg.stride, cfg.batch_size, progress
    ).to_dict()


def count_parameters(model: torch.nn.Module) -> dict:
    params = {id(p): p for p in model.parameters()}  # tied weights counted once
    total = sum(p.numel() for p in params.values())
    nonzero = sum(int(torch.count_nonzero(p)) for p in params.values())
    return {"parameters": total, "nonzero": nonzero}


def run_recipe(
    recipe: Recipe,
    output: Path | None,
    *,
    overwrite: bool = False,
    device: str = "cpu",
    trust_remote_code: bool = False,
    progress: Progress | None = None,
) -> dict:
    """Apply ``recipe`` and write the checkpoint (with recipe and report) to ``output``."""
    progress = progress or NullProgress()
    if output is not None:
        check_output(output, overwrite)
    torch.manual_seed(recipe.calibration.seed)
    if recipe.evaluation is not None:
        check_disjoint(recipe.calibration.dataset, recipe.evaluation.dataset)
    loaded = load_model(recipe.model, recipe.dtype, trust_remote_code)
    if output is not None and loaded.path is not None:
        check_output(output, overwrite, protect=loaded.path)
    report = new_report(loaded.source, recipe.model_dump(mode="json"))
    model = loaded.model
    tokens = None
    if recipe.evaluation is not None:
        tokens = evaluation_tokens(loaded.tokenizer, recipe.evaluation.dataset)
        if recipe.evaluation.baseline:
            report["metrics"]["perplexity_baseline"] = _evaluate(model, tokens, recipe.evaluation, progress)

    ws = Workspace(model, loaded.tokenizer, recipe.calibration, device, progress)
    for i, stage in enumerate(recipe.stages):
        _, fn = STAGES[stage.type]
        t0 = time.perf_counter()
        log.info("stage %d: %s", i, stage.type)
        stats = fn(ws, stage)
        report["stages"].append(
            {
                "type": stage.type,
                "seconds": round(time.perf_counter() - t0, 2),
                "summary": _stage_summary(stats),
                "stats": stats,
            }
        )
    report["metrics"].update(count_parameters(model))
    if recipe.evaluation is not None:
        report["metrics"]["perplexity_compressed"] = _evaluate(model, tokens, recipe.evaluation, progress)

    if output is not None:
        with staged_output(output, overwrite, protect=loaded.path) as tmp:
            fmt = export_checkpoint(ws, recipe.export.format, tmp, recipe.export.max_shard_size)
            (tmp / "recipe.yaml").write_text(recipe.to_yaml())
            report["checkpoint"] = {"path": str(output), "format": fmt, "bytes": directory_bytes(tmp)}
            write_report(report, tmp)
    return report


def export_checkpoint(ws: Workspace, fmt: str, directory: Path, max_shard_size: str) -> str:
    """Write the workspace's model in ``fmt``; returns the format name written."""
    if fmt == "dense":
        write_dense(ws.model, ws.tokenizer, directory, max_shard_size)
        return "dense"
    if fmt == "compressed-tensors":
        if not ws.qparams:
            raise OptcError(
                "export format compressed-tensors needs quantized weights; this recipe quantizes "
                "nothing (use format: dense)"
            )
        write_pack_quantized(ws.model, ws.qparams, directory, max_shard_bytes=parse_size(max_shard_size))
        ws.tokenizer.save_pretrained(directory)
        return "compressed-tensors/pack-quantized"
    raise OptcError(f"export format {fmt!r} is not available")


def parse_size(text: str) -> int:
    """``"2GB"`` / ``"500MB"`` / ``"1GiB"`` -> bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            try:
                return int(float(t[: -len(unit)]) * units[unit])
            except ValueError:
                break
    raise OptcError(f"cannot parse size {text!r} (e.g. 2GB, 500MB)")


def evaluate_model(
    source: str | None,
    *,
    dataset: str,
    seqlen: int,
    windows: int | None,
    stride: int | None = None,
    batch_size: int = 1,
    baseline: str | None = None,
    output: Path | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict:
    """Perplexity of a model (and optionally a baseline) with a report."""
    progress = progress or NullProgress()
    if output is not None:
        check_output(output, overwrite)
    cfg = EvaluationConfig(
        dataset=dataset, seqlen=seqlen, windows=windows, stride=stride, batch_size=batch_size
    )
    loaded = load_model(source)
    report = new_report(loaded.source)
    tokens = evaluation_tokens(loaded.tokenizer, dataset)
    if baseline is not None:
        base = load_model(baseline)
        if base.tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
            raise OptcError(f"baseline {baseline!r} uses a different tokenizer than {loaded.source!r}")
        report["metrics"]["perplexity_baseline"] = _evaluate(base.model, tokens, cfg, progress)
        del base
    report["metrics"]["perplexity_compressed" if baseline else "perplexity_model"] = _evaluate(
        loaded.model, tokens, cfg, progress
    )
    report["metrics"].update(count_parameters(loaded.model))
    if loaded.path is not None and loaded.path.is_dir():
        report["metrics"]["bytes_on_disk"] = directory_bytes(loaded.path)
    if output is not None:
        with staged_output(output, overwrite) as tmp:
            write_report(report, tmp)
    return report
