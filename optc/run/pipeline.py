"""Running a recipe end to end: load, evaluate, compress stage by stage, export, report."""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import torch
import yaml

from optc.calibrate.distributed import is_main_process, process_group
from optc.compress.actquant import input_quant_of
from optc.data import check_disjoint
from optc.errors import OptcError
from optc.evaluate.perplexity import perplexity
from optc.evaluate.report import new_report, write_report
from optc.evaluate.gates import check_gates, parse_gates, require_measurable
from optc.evaluate.perplexity import PerplexityResult, evaluation_token_cache, paired_difference
from optc.evaluate.report import layer_statistics, stage_layer_info
from optc.evaluate.size import size_metrics
from optc.export.compressed_tensors import write_int_quantized, write_pack_quantized
from optc.export.compressed_tensors import sparsity_config, write_sparsity_config
from optc.export.checkpoint import check_free_space, check_output, directory_bytes, estimate_checkpoint_bytes
from optc.export.checkpoint import staged_output, write_dense
from optc.export.convert import FORMATS as CONVERT_FORMATS
from optc.export.convert import export_model, scheme_fits
from optc.memory import trim
from optc.model.load import load_model
from optc.progress import NullProgress, Progress
from optc.recipe import EvaluationConfig, Recipe
from optc.methods.recover_training import check_recoverable, restore_base, write_adapter
from optc.methods import METHODS, Workspace, declared_schemes, planned_schemes

log = logging.getLogger(__name__)


def _stage_summary(stats: dict) -> str:
    modules = stats.get("modules", {})
    if not modules:
        return "; ".join(stats.get("notes", []))  # stages without per-Linear stats (structured)
    parts = [f"{len(modules)} Linears"]
    errs = [m["rel_error"] for m in modules.values() if "rel_error" in m]
    if errs:
        schemes = sorted({m["scheme"] for m in modules.values() if "scheme" in m})
        parts.append(", ".join(schemes))
        parts.append(f"mean relative weight error {sum(errs) / len(errs):.4f}")
    sp = [m["sparsity"] for m in modules.values() if "sparsity" in m]
    if sp:
        parts.append(f"mean sparsity {sum(sp) / len(sp):.3f}")
    parts += stats.get("notes", [])  # stage-specific lines (e.g. the activation scheme used)
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
    gates: list[str] | None = None,
    resume: bool = False,
) -> dict:
    """Apply ``recipe`` and write the checkpoint (with recipe and report) to ``output``.

    Started by torchrun, every rank calibrates on its share of the samples and rank 0 alone
    evaluates and writes; the other ranks return a report without metrics.
    Finished layers of the calibrated stages are saved beside ``output`` as they complete;
    ``resume`` continues from them after a crash or Ctrl-C (same bytes as an uninterrupted run).
    A model that does not fit in memory runs streaming (:mod:`optc.run.streaming`).
    """
    with process_group(device):
        return _run_recipe(recipe, output, overwrite=overwrite, device=device, trust_remote_code=trust_remote_code,
                           progress=progress, gates=gates, resume=resume)


def _run_recipe(
    recipe: Recipe,
    output: Path | None,
    *,
    overwrite: bool = False,
    device: str = "cpu",
    trust_remote_code: bool = False,
    progress: Progress | None = None,
    gates: list[str] | None = None,
    resume: bool = False,
) -> dict:
    from optc.run.streaming import baseline_perplexity, keeping_progress, open_store, run_streaming, wants_streaming

    progress = progress or NullProgress()
    gate_list = _recipe_gates(recipe, gates, output)  # parsed before any work
    t_start = time.perf_counter()
    if output is not None:
        check_output(output, overwrite)
        _check_export(recipe)  # an impossible export is refused before any calibration
    if wants_streaming(recipe):
        return run_streaming(recipe, output, overwrite=overwrite, device=device, trust_remote_code=trust_remote_code,
                             progress=progress, gate_list=gate_list, resume=resume)
    torch.manual_seed(recipe.calibration.seed)
    if recipe.evaluation is not None:
        check_disjoint(recipe.calibration.dataset, recipe.evaluation.dataset)
    loaded = load_model(recipe.model, recipe.dtype, trust_remote_code)
    if output is not None and loaded.path is not None:
        check_output(output, overwrite, protect=loaded.path)
    if output is not None and is_main_process():  # no hours of calibration for a checkpoint that cannot fit
        check_free_space(output, estimate_checkpoint_bytes(loaded.model, planned_schemes(loaded.model, recipe.stages),
                                                           recipe.export.format))
    report = new_report(loaded.source, recipe.model_dump(mode="json"))
    report["timings"]["load"] = round(time.perf_counter() - t_start, 3)
    model = loaded.model
    recover = [s for s in recipe.stages if s.type == "recover"]
    for stage in recover:  # targets and rank are refused before any evaluation or training
        check_recoverable(model, stage)
        if stage.export == "adapter" and stage is not recipe.stages[-1]:
            raise OptcError("recover with export: adapter must be the last stage (the checkpoint "
                            "holds the weights before it, the adapter the update)")
    teacher = _teacher(model, loaded.path, recover, report, trust_remote_code)
    if teacher is not None:
        report["recipe"] = recipe.model_dump(mode="json")  # with the teacher it resolved
    ws = Workspace(model, loaded.tokenizer, recipe.calibration, device, progress,
                   qparams=dict(loaded.qparams), masks=dict(loaded.masks), nm=loaded.nm, teacher=teacher)
    ws.store = open_store(recipe, output, loaded.path, device, resume, ws.qparams)
    tokens = None
    if recipe.evaluation is not None and is_main_process():
        tokens = evaluation_token_cache(loaded.tokenizer, recipe.evaluation.dataset)
        if recipe.evaluation.baseline:
            # Recovering a compressed checkpoint: its teacher is the uncompressed baseline.
            base_model = teacher if report["baseline"] is not None else model
            report["metrics"]["perplexity_baseline"] = baseline_perplexity(
                ws.store, recipe.evaluation, lambda: _evaluate(base_model, tokens, recipe.evaluation, progress))
    if recipe.evaluation is not None:
        ws.evaluate = lambda m: _evaluate(m, tokens, recipe.evaluation, progress)
    if output is not None:
        ws.state_dir = output.expanduser().parent / f".{output.name}.recover-state"
    with keeping_progress(ws.store):
        for i, stage in enumerate(recipe.stages):
            fn = METHODS[stage.type].run
            if ws.store is not None:
                ws.store.begin_stage(i, stage.type)
            t0 = time.perf_counter()
            log.info("stage %d: %s", i, stage.type)
            stats = fn(ws, stage)
            if "perplexity_before" in stats:
                report["metrics"]["perplexity_before_recovery"] = stats.pop("perplexity_before")
            report["stages"].append(
                {
                    "type": stage.type,
                    "seconds": round(time.perf_counter() - t0, 2),
                    "summary": _stage_summary(stats),
                    "stats": stats,
                }
            )
        if not is_main_process():
            return report  # distributed: rank 0 evaluates and writes
        report["metrics"].update(count_parameters(model))
        if recipe.evaluation is not None:
            report["metrics"]["perplexity_compressed"] = _evaluate(model, tokens, recipe.evaluation, progress)
        _add_eval_details(report, model)

        if output is not None:
            check_free_space(output, estimate_checkpoint_bytes(model, {n: p.scheme for n, p in ws.qparams.items()},
                                                               recipe.export.format))
            trim()  # calibration's freed fragments, before export allocates the packed tensors
            with staged_output(output, overwrite, protect=loaded.path) as tmp:
                if ws.adapter is not None:
                    restore_base(ws.model, ws.adapter)  # the checkpoint holds the pre-recovery weights
                    ws.adapter.base_model = str(output)
                fmt = export_checkpoint(ws, recipe.export.format, tmp, recipe.export.max_shard_size)
                adapter_files = write_adapter(ws.adapter, tmp) if ws.adapter is not None else []
                if ws.masks and recipe.export.sparsity_metadata and fmt.split("/")[0] in ("dense", "compressed-tensors"):
                    write_sparsity_config(tmp, sparsity_config(ws.model, ws.masks))
                (tmp / "recipe.yaml").write_text(recipe.to_yaml())
                report["checkpoint"] = {"path": str(output), "format": fmt, "bytes": directory_bytes(tmp)}
                if adapter_files:
                    report["checkpoint"]["adapter"] = adapter_files
                report["metrics"]["size"] = size_metrics(ws.model, tmp)
                report["gates"] = [g.to_dict() for g in check_gates(gate_list, report)]
                write_report(report, tmp)
        else:
            report["gates"] = [g.to_dict() for g in check_gates(gate_list, report)]
    if ws.store is not None:
        ws.store.remove()
    return report


def _teacher(model: torch.nn.Module, path: Path | None, recover: list, report: dict,
             trust_remote_code: bool) -> torch.nn.Module | None:
    """The uncompressed model a recovery stage distils from: the one it names; for an optc
    checkpoint, the model its ``recipe.yaml`` compressed; else a frozen copy of the recipe's
    model taken before any stage changes it."""
    needs = [s for s in recover if s.loss != "ce"]
    if not needs:
        return None
    named = next((s.teacher for s in needs if s.teacher), None) or source_model(path)
    for stage in needs:  # recorded in the recipe as applied, so a later run finds it
        stage.teacher = stage.teacher or named
    if named is None:
        teacher = copy.deepcopy(model)
    else:
        loaded = load_model(named, trust_remote_code=trust_remote_code)
        if loaded.model.config.vocab_size != model.config.vocab_size:
            raise OptcError(
                f"teacher {named!r} has a vocabulary of {loaded.model.config.vocab_size} tokens, the "
                f"model {model.config.vocab_size}: distillation needs the same tokenizer"
            )
        teacher = loaded.model
        report["baseline"] = loaded.source
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.eval()


def source_model(path: Path | None) -> str | None:
    """The model an optc checkpoint was compressed from (its ``recipe.yaml``), if any."""
    recipe = path / "recipe.yaml" if path is not None and path.is_dir() else None
    if recipe is None or not recipe.is_file():
        return None
    try:
        data = yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    # A recovered checkpoint names its teacher; its ``model`` is the compressed input.
    teachers = [s.get("teacher") for s in data.get("stages") or [] if isinstance(s, dict) and s.get("type") == "recover"]
    name = next((t for t in teachers if t), None) or data.get("model")
    return name if isinstance(name, str) and name else None


def _check_export(recipe: Recipe) -> None:
    """Refuse, before any calibration, a recipe whose schemes its export format cannot hold.

    Stands in for optc.export.convert.check_recipe_export (which read the removed QUANT_STAGES)
    until export takes plain data: the same checks and messages over ``declared_schemes``."""
    fmt = recipe.export.format
    if fmt not in CONVERT_FORMATS:
        return
    schemes = declared_schemes(recipe.stages)
    for where, scheme, permuted in schemes:
        reason = scheme_fits(scheme, fmt, permuted)
        if reason is not None:
            raise OptcError(f"export format {fmt}: {where}: {reason}")
    if fmt in ("gptq", "awq"):
        kinds = {(s.bits, s.symmetric) for _, s, _ in schemes}
        if len(kinds) > 1:
            raise OptcError(
                f"export format {fmt} holds one scheme per checkpoint; the recipe mixes "
                f"{', '.join(sorted({s.label() for _, s, _ in schemes}))} (use compressed-tensors)"
            )


def _recipe_gates(recipe: Recipe, extra: list[str] | None, output: Path | None) -> list:
    """The recipe's ``gates:`` plus command-line ones, refused early if not measurable."""
    gate_list = parse_gates(list(getattr(recipe, "gates", None) or []) + list(extra or []))
    available = {"size"} if output is not None else set()
    if recipe.evaluation is not None:
        available |= {"eval"} | ({"baseline"} if recipe.evaluation.baseline else set())
    require_measurable(gate_list, available)
    return gate_list


def _add_eval_details(report: dict, model: torch.nn.Module, layers: list[dict] | None = None) -> None:
    """Paired perplexity change, per-layer statistics (``layers``: already computed, when the
    weights are not in memory) and per-stage timings of a run."""
    metrics = report["metrics"]
    base, comp = metrics.get("perplexity_baseline"), metrics.get("perplexity_compressed")
    if base and comp:
        metrics["perplexity_change"] = paired_difference(PerplexityResult(**base), PerplexityResult(**comp))
        report["timings"]["baseline_eval"], report["timings"]["eval"] = base["seconds"], comp["seconds"]
    for i, st in enumerate(report["stages"]):
        report["timings"][f"stage {i}: {st['type']}"] = st["seconds"]
    report["layers"] = layers if layers is not None else layer_statistics(model, *stage_layer_info(report["stages"]))


def export_checkpoint(ws: Workspace, fmt: str, directory: Path, max_shard_size: str) -> str:
    """Write the workspace's model in ``fmt``; returns the format name written."""
    if fmt == "dense":
        if input_quant_of(ws.model):
            log.warning("dense format keeps the fake-quantized weights but not the activation scales")
        write_dense(ws.model, ws.tokenizer, directory, max_shard_size)
        return "dense"
    if fmt == "compressed-tensors":
        if not ws.qparams:
            raise OptcError(
                "export format compressed-tensors needs quantized weights; this recipe quantizes "
                "nothing (use format: dense)"
            )
        input_quant = input_quant_of(ws.model)
        if input_quant:  # W8A8: the sub-format follows from what was quantized
            info = write_int_quantized(
                ws.model, ws.qparams, input_quant, directory, max_shard_bytes=parse_size(max_shard_size)
            )
            ws.tokenizer.save_pretrained(directory)
            return f"compressed-tensors/{info['format']}"
        write_pack_quantized(ws.model, ws.qparams, directory, max_shard_bytes=parse_size(max_shard_size))
        ws.tokenizer.save_pretrained(directory)
        return "compressed-tensors/pack-quantized"
    if fmt in CONVERT_FORMATS:
        if input_quant_of(ws.model):
            raise OptcError(f"export format {fmt} stores weight-only quantization; this recipe also "
                            "quantizes activations (use compressed-tensors)")
        info = export_model(ws.model, ws.tokenizer, ws.qparams, fmt, directory,
                            max_shard_bytes=parse_size(max_shard_size))
        return info["format"]
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
    gates: list[str] | None = None,
    latency: bool = False,
    kernel: str = "auto",
    prompt_tokens: int = 128,
    new_tokens: int = 32,
    repeats: int = 5,
    threads: int | None = None,
    tasks: list[str] | None = None,
    cache: bool = True,
    streaming: bool = False,
) -> dict:
    """Perplexity, KL to a baseline, size and latency of a model, with a report (and gates).

    ``streaming`` evaluates layer-major, one decoder layer in memory at a time (perplexity and
    size only), for models larger than memory.
    """
    from optc.evaluate.gates import parse_gates
    from optc.evaluate.latency import KERNEL_CHOICES
    from optc.evaluate.suite import EvalOptions, run_evaluation, timed

    progress = progress or NullProgress()
    opts = EvalOptions(  # gates parse first: a typo fails before any model loads
        gates=parse_gates(gates), dataset=dataset, seqlen=seqlen, windows=windows, stride=stride,
        batch_size=batch_size, cache=cache, latency=latency, kernel=kernel,
        prompt_tokens=prompt_tokens, new_tokens=new_tokens, repeats=repeats, threads=threads,
        tasks=list(tasks or []),
    )
    if kernel not in KERNEL_CHOICES:
        raise OptcError(f"unknown kernel {kernel!r} (expected one of {', '.join(KERNEL_CHOICES)})")
    if output is not None:
        check_output(output, overwrite)
    EvaluationConfig(dataset=dataset, seqlen=seqlen, windows=windows, stride=stride, batch_size=batch_size)
    report = new_report(source or "smollm2-135m", command="eval")
    if streaming:
        from optc.run.streaming import evaluate_streaming

        report["baseline"] = baseline
        evaluate_streaming(source, baseline, opts, report, progress)
        if output is not None:
            with staged_output(output, overwrite) as tmp:
                write_report(report, tmp)
        return report
    with timed(report["timings"], "load"):
        loaded = load_model(source)
        base = load_model(baseline) if baseline is not None else None
    report["model"], report["baseline"] = loaded.source, base.source if base is not None else None
    run_evaluation(loaded, base, opts, report, progress)
    if output is not None:
        with staged_output(output, overwrite) as tmp:
            write_report(report, tmp)
    return report
