"""Running a recipe end to end: load, evaluate, compress stage by stage, export, report."""

from __future__ import annotations

import copy
import json
import logging
import re
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import ValidationError

from optc.calibrate.distributed import is_main_process, process_group
from optc.compress.actquant import input_quant_of
from optc.compress.kvquant import kv_quant_of
from optc.data import check_dataset, check_disjoint, dataset_path
from optc.errors import OptcError
from optc.evaluate.perplexity import perplexity
from optc.evaluate.report import new_report, write_report
from optc.evaluate.gates import check_gates, parse_gates, require_measurable
from optc.evaluate.perplexity import PerplexityResult, evaluation_token_cache, paired_difference
from optc.evaluate.report import layer_statistics, record_non_finite, stage_layer_info
from optc.evaluate.size import size_metrics
from optc.export.compressed_tensors import sparsity_config, write_sparsity_config
from optc.export.checkpoint import check_free_space, check_output, check_float_widths, check_stored_bits, claimed_output
from optc.export.checkpoint import directory_bytes, estimate_checkpoint_bytes, staged_output
from optc.export.formats import FORMATS, check_schemes, get_format
from optc.export.load import load_checkpoint as load_model
from optc.export.source import CastSource, ExportSource, ModelSource, stored_dtype
from optc.model.load import local_path
from optc.memory import trim
from optc.progress import NullProgress, Progress
from optc.units import parse_size
from optc.evaluate.protocol import EvalProtocol, LatencyOptions
from optc.recipe import EvaluationConfig, Recipe
from optc.run.card import write_model_card
from optc.run.streaming import (
    baseline_perplexity,
    evaluate_streaming,
    keeping_progress,
    layer_rows,
    open_store,
    open_streamed,
    streamed_eval,
    streamed_source,
    wants_streaming,
)
from optc.methods.recover_training import check_recoverable, restore_base, write_adapter
from optc.methods import METHODS, Workspace, declared_schemes, planned_schemes
from optc.methods.base import Override, WeightQuantConfig, scheme_label
from optc.methods.budget import allocate_budget, plan_budget

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
    force_overwrite: bool = False,
) -> dict:
    """Apply ``recipe`` and write the checkpoint (with recipe and report) to ``output``.

    Started by torchrun, every rank calibrates on its share of the samples and rank 0 alone
    evaluates and writes; the other ranks return a report without metrics.
    Finished layers of the calibrated stages are saved beside ``output`` as they complete;
    ``resume`` continues from them after a crash or Ctrl-C (same bytes as an uninterrupted run).
    A model that does not fit in memory runs streaming (:mod:`optc.run.streaming`).
    """
    with process_group(device):
        return _run_recipe(recipe, output, overwrite=overwrite, force_overwrite=force_overwrite, device=device,
                           trust_remote_code=trust_remote_code, progress=progress, gates=gates, resume=resume)


def _run_recipe(
    recipe: Recipe,
    output: Path | None,
    *,
    overwrite: bool = False,
    force_overwrite: bool = False,
    device: str = "cpu",
    trust_remote_code: bool = False,
    progress: Progress | None = None,
    gates: list[str] | None = None,
    resume: bool = False,
) -> dict:
    progress = progress or NullProgress()
    gate_list = _recipe_gates(recipe, gates, output)  # parsed before any work
    t_start = time.perf_counter()
    inputs = input_paths(recipe)
    if output is not None:
        check_output(output, overwrite, inputs, force=force_overwrite)
        check_recipe_export(recipe)  # an impossible export is refused before any calibration
    check_stages(recipe, output)
    # Only rank 0 writes; it holds the output's lock (and its resume state's) until the rename.
    claim = (claimed_output(output, overwrite, inputs, force=force_overwrite)
             if output is not None and is_main_process() else nullcontext())
    with claim:
        return _run_claimed(recipe, output, overwrite=overwrite, force_overwrite=force_overwrite, device=device,
                            trust_remote_code=trust_remote_code, progress=progress, gate_list=gate_list,
                            resume=resume, inputs=inputs, t_start=t_start)


def _run_claimed(
    recipe: Recipe,
    output: Path | None,
    *,
    overwrite: bool,
    force_overwrite: bool,
    device: str,
    trust_remote_code: bool,
    progress: Progress,
    gate_list: list,
    resume: bool,
    inputs: dict[str, Path | None],
    t_start: float,
) -> dict:
    # The texts are read (or their host reached) before the model loads: a file that is not
    # text fails in a second, not after the baseline evaluation.
    check_dataset(recipe.calibration.dataset, "calibration", network=False)
    if recipe.evaluation is not None:
        check_dataset(recipe.evaluation.dataset, "evaluation")
    streaming = wants_streaming(recipe)
    torch.manual_seed(recipe.calibration.seed)
    if recipe.evaluation is not None:
        check_disjoint(recipe.calibration.datasets(), recipe.evaluation.dataset)
    # The source: the model in memory, or (streaming) on the meta device over the input's shards.
    reader = None
    if streaming:
        loaded, reader = open_streamed(recipe, trust_remote_code)
    else:
        loaded = load_model(recipe.model, recipe.dtype, trust_remote_code)
    if output is not None and loaded.path is not None:
        inputs = {**inputs, "model": loaded.path}
        check_output(output, overwrite, inputs, force=force_overwrite)
    if output is not None:
        planned = planned_schemes(loaded.model, recipe.stages)
        check_stored_bits(loaded.model, planned, recipe.export.format)
        check_float_widths(loaded.model, planned)
    if output is not None and is_main_process() and not streaming:  # no hours of calibration for a checkpoint that cannot fit
        check_free_space(output, estimate_checkpoint_bytes(loaded.model, planned, recipe.export.format))
    dtype = stored_dtype(recipe.export.dtype, loaded.source_dtype, loaded.from_gguf, loaded.model.dtype)
    budgets = _budget_stages(recipe)
    if budgets and streaming:
        raise OptcError("a budget needs the model in memory (its sensitivity pass reads every layer before the "
                        "method runs); this run streams it: drop --streaming or the budget")
    fmt = get_format(recipe.export.format)
    if budgets and fmt.linear_schemes is not None:
        raise OptcError(f"export format {fmt.name} types every tensor itself (as llama.cpp's mix does), so a "
                        "budget has nothing to choose: drop the budget or export to a format that stores each "
                        "Linear on its own scheme")
    for stage in recipe.stages:  # a method that cannot take the format's grids is refused before any calibration
        _format_grids(stage, loaded.model, fmt)
        check = METHODS[stage.type].check
        if check is not None:  # nor a model it cannot work on
            check(loaded.model, stage)
    for i, stage in budgets.items():  # an impossible target is refused before any calibration
        plan_budget(loaded.model, stage, get_format(recipe.export.format), torch.finfo(dtype).bits,
                    loaded.qparams, f"stage {i} ({stage.type})")
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
    ws.store = open_store(recipe, output, loaded.path, device, resume, ws.qparams, reader)
    cfg = recipe.evaluation
    tokens = None
    if cfg is not None and is_main_process():
        tokens = evaluation_token_cache(loaded.tokenizer, cfg.source())
        if cfg.baseline:
            # Recovering a compressed checkpoint: its teacher is the uncompressed baseline.
            base_model = teacher if report["baseline"] is not None else model
            measure = ((lambda: streamed_eval(model, reader, tokens, cfg, progress)) if streaming
                       else (lambda: _evaluate(base_model, tokens, cfg, progress)))
            report["metrics"]["perplexity_baseline"] = baseline_perplexity(ws.store, cfg, measure)
    if cfg is not None and not streaming:
        ws.evaluate = lambda m: _evaluate(m, tokens, cfg, progress)
    if output is not None:
        ws.state_dir = output.expanduser().parent / f".{output.name}.recover-state"
    with keeping_progress(ws.store, resumable=output is not None or not streaming):
        for i, stage in enumerate(recipe.stages):
            if ws.store is not None:
                ws.store.begin_stage(i, stage.type)
            t0 = time.perf_counter()
            log.info("stage %d: %s%s", i, stage.type, " (streaming)" if streaming else "")
            stage, grids_note = _format_grids(stage, ws.model, get_format(recipe.export.format))
            budget = None
            if i in budgets:
                plan = plan_budget(ws.model, stage, get_format(recipe.export.format), torch.finfo(dtype).bits,
                                   ws.qparams, f"stage {i} ({stage.type})")
                stage, budget = allocate_budget(ws, stage, plan)
            stats = METHODS[stage.type].run(ws, stage)
            if budget is not None:
                stats["budget"] = budget
                stats.setdefault("notes", []).append(budget.pop("note"))
            if grids_note is not None:
                stats.setdefault("notes", []).append(grids_note)
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
        # The sink: the format writer reads the model in memory, or the finished layers on disk.
        rows, counts = layer_rows(ws.store, report["stages"]) if streaming else (None, None)
        if streaming:
            src = streamed_source(loaded, reader, ws.store)
            report["metrics"].update(parameters=counts[0], nonzero=counts[1])
        else:
            src = ModelSource(ws.model, ws.tokenizer, ws.qparams, input_quant_of(ws.model), ws.masks,
                              kv_quant=kv_quant_of(ws.model))
            report["metrics"].update(count_parameters(model))
        if cfg is not None:
            report["metrics"]["perplexity_compressed"] = (
                streamed_eval(model, src.stored, tokens, cfg, progress) if streaming
                else _evaluate(model, tokens, cfg, progress))
        _add_eval_details(report, model, layers=rows)

        if output is not None:
            if not streaming:
                check_free_space(output, estimate_checkpoint_bytes(model, {n: p.scheme for n, p in ws.qparams.items()},
                                                                   recipe.export.format))
            trim()  # calibration's freed fragments, before export allocates the packed tensors
            with staged_output(output, overwrite, inputs, force=force_overwrite) as tmp:
                if ws.adapter is not None:
                    restore_base(ws.model, ws.adapter)  # the checkpoint holds the pre-recovery weights
                    ws.adapter.base_model = str(output)
                fmt = export_checkpoint(src, recipe.export.format, tmp, recipe.export.max_shard_size, dtype,
                                        recipe.export.embedding_bits)
                adapter_files = write_adapter(ws.adapter, tmp) if ws.adapter is not None else []
                if ws.masks and recipe.export.sparsity_metadata and get_format(recipe.export.format).sparsity_metadata:
                    write_sparsity_config(tmp, sparsity_config(ws.model, ws.masks))
                (tmp / "recipe.yaml").write_text(recipe.to_yaml())
                report["checkpoint"] = {"path": str(output), "format": fmt, "bytes": directory_bytes(tmp)}
                if adapter_files:
                    report["checkpoint"]["adapter"] = adapter_files
                report["metrics"]["size"] = size_metrics(model, tmp, counts=counts)
                report["metrics"]["size"]["dtype"] = str(dtype).removeprefix("torch.")
                record_non_finite(report)
                report["gates"] = [g.to_dict() for g in check_gates(gate_list, report)]
                write_report(report, tmp)
                write_model_card(tmp, json.loads(json.dumps(report, default=str)))
        else:
            record_non_finite(report)
            report["gates"] = [g.to_dict() for g in check_gates(gate_list, report)]
    if ws.store is not None:
        ws.store.remove()
    return report


def _format_grids(stage, model: torch.nn.Module, fmt) -> tuple[Any, str | None]:
    """A quantizing stage with one exact-name override per Linear (after its own) when the export
    format fixes each tensor's type (a GGUF mix), so the method calibrates every Linear on the grid
    the file stores it on; and a note of the grids it took."""
    if fmt.linear_schemes is None or METHODS[stage.type].kind != "quantize":
        return stage, None
    schemes = fmt.linear_schemes(model)
    extra = [Override(pattern=f"^{re.escape(n)}$", scheme=s) for n, s in schemes.items()]
    counts = Counter(scheme_label(s) for s in schemes.values())
    note = (f"grids of {fmt.name}'s tensor types: "
            + ", ".join(f"{label} x{n}" for label, n in counts.most_common())
            + (" (the stage's own overrides first)" if stage.overrides else ""))
    try:  # validated again: a method may refuse the format's grids (one line, before any work)
        resolved = type(stage).model_validate({**stage.model_dump(), "overrides": [*stage.overrides, *extra]})
    except ValidationError as exc:
        raise OptcError(f"stage {stage.type} with export format {fmt.name}: "
                        f"{exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    return resolved, note


def _budget_stages(recipe: Recipe) -> dict[int, WeightQuantConfig]:
    """The quantizing stages that carry a budget, by position."""
    return {i: s for i, s in enumerate(recipe.stages) if METHODS[s.type].kind == "quantize" and s.budget is not None}


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




def input_paths(recipe: Recipe) -> dict[str, Path | None]:
    """The local files and directories a run of ``recipe`` reads, which no output may replace."""
    paths: dict[str, Path | None] = {"model": local_path(recipe.model)}
    for i, stage in enumerate(recipe.stages):
        teacher = getattr(stage, "teacher", None)
        if isinstance(teacher, str):
            paths[f"teacher of stage {i}"] = local_path(teacher)
    paths["calibration text"] = dataset_path(recipe.calibration.dataset)
    if recipe.evaluation is not None:
        paths["evaluation text"] = dataset_path(recipe.evaluation.dataset)
    return paths


def check_stages(recipe: Recipe, output: Path | None) -> None:
    """A recipe without stages only evaluates: with an output it would write an uncompressed copy
    of the model (e.g. a YAML file whose stages were lost), so that is refused."""
    if not recipe.stages and output is not None:
        raise OptcError(
            f"recipe {recipe.name!r} has no stages: it would write an uncompressed copy of the model "
            f"to {output}. A recipe without stages only evaluates: run it without --output (or use optc eval)"
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


def export_checkpoint(src: ExportSource, fmt: str, directory: Path, max_shard_size: str,
                      dtype: torch.dtype | None = None, embedding_bits: int = 16) -> str:
    """Write ``src`` (the model in memory, or a streamed run's layers on disk) in ``fmt``, its
    unquantized tensors in ``dtype`` (None: as they are); returns the format name written."""
    target = get_format(fmt)
    if target.needs_quantized and not src.qparams:
        raise OptcError(
            f"export format {fmt} needs quantized weights; this recipe quantizes "
            "nothing (use format: dense)"
        )
    if dtype is not None and dtype != src.dtype:
        # A format that packs codes reads the quantized weights exactly as calibrated; one that
        # stores weights as in memory (bits_per_weight None: dense) casts them like the rest.
        packs = any(target.bits_per_weight(p.scheme, 64) is not None for p in src.qparams.values())
        keep = {f"{name}.weight" for name in src.qparams} if packs else set()
        src = CastSource(src, dtype, keep)
    extra = {"embedding_bits": embedding_bits} if embedding_bits != 16 else {}  # only formats that hold it take it
    return target.write(src, directory, max_shard_bytes=parse_size(max_shard_size), **extra)["format"]


def check_recipe_export(recipe: Recipe) -> None:
    """Refuse, before any calibration, a recipe whose schemes its export format cannot hold."""
    check_schemes(recipe.export.format, declared_schemes(recipe.stages))
    fmt = get_format(recipe.export.format)
    for i, stage in enumerate(recipe.stages):
        if METHODS[stage.type].kind == "cache" and not fmt.holds_kv_cache:
            holders = ", ".join(f.name for f in FORMATS.values() if f.holds_kv_cache)
            raise OptcError(f"export format {fmt.name}: stage {i} ({stage.type}) quantizes the KV cache, which "
                            f"{fmt.name} cannot store (use {holders})")
    refusal = fmt.embedding_8bit
    if recipe.export.embedding_bits == 8 and refusal is not None:
        raise OptcError(f"export format {recipe.export.format}: embedding_bits 8 is refused: {refusal}")


def evaluate_model(
    source: str | None,
    protocol: EvalProtocol | None = None,
    *,
    baseline: str | None = None,
    output: Path | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    gates: list[str] | None = None,
    latency: LatencyOptions | None = None,
    tasks: list[str] | None = None,
    cache: bool = True,
    streaming: bool = False,
    device: str = "cpu",
    force_overwrite: bool = False,
) -> dict:
    """Perplexity (on ``protocol``'s windows), KL to a baseline, size and latency (when
    ``latency`` is given) of a model, with a report (and gates).

    ``streaming`` evaluates layer-major, one decoder layer in memory at a time (perplexity and
    size only), for models larger than memory. ``device``: where the models run (the windows
    follow the model's device).
    """
    if device != "cpu" and (latency is not None or streaming):
        # Latency is batch-1 CPU timing by design, and the layer-major reader feeds CPU layers.
        raise OptcError(f"--device {device}: {'--latency' if latency is not None else '--streaming'} runs on the CPU only")
    from optc.evaluate.gates import parse_gates
    from optc.evaluate.suite import EvalOptions, run_evaluation, timed

    progress = progress or NullProgress()
    protocol = protocol or EvalProtocol()
    opts = EvalOptions(  # gates parse first: a typo fails before any model loads
        protocol=protocol, gates=parse_gates(gates), cache=cache, latency=latency, tasks=list(tasks or []),
    )
    inputs = {"model": local_path(source), "baseline": local_path(baseline),
              "evaluation text": dataset_path(protocol.dataset)}
    if output is not None:
        check_output(output, overwrite, inputs, force=force_overwrite)
    with claimed_output(output, overwrite, inputs, force=force_overwrite) if output is not None else nullcontext():
        check_dataset(protocol.dataset, "evaluation")  # before any model loads
        report = new_report(source or "smollm2-135m", command="eval")
        if streaming:
            report["baseline"] = baseline
            evaluate_streaming(source, baseline, opts, report, progress)
        else:
            with timed(report["timings"], "load"):
                loaded = load_model(source)
                base = load_model(baseline) if baseline is not None else None
                for m in (loaded, base):
                    if m is not None and device != "cpu":
                        m.model.to(device)
            report["model"], report["baseline"] = loaded.source, base.source if base is not None else None
            run_evaluation(loaded, base, opts, report, progress)
        if output is not None:
            with staged_output(output, overwrite, inputs, force=force_overwrite) as tmp:
                write_report(report, tmp)
    return report
