"""Commands that compress: ``run``, ``quantize``, ``prune``, ``recover``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from optc.cli.app import (
    DatasetOpt, DeviceOpt, DtypeOpt, EvalDatasetOpt, ForceOverwriteOpt, FormatOpt, GateOpt, JsonOpt, ModelOpt,
    NoEvalOpt, NoSaveOpt, OutputOpt, OverwriteOpt, QuietOpt, ResumeOpt, SamplesOpt, SeedOpt, SeqlenOpt, SplitOpt,
    StreamingOpt, TargetBpwOpt, TargetSizeOpt, TextColumnOpt, TrustOpt, WindowsOpt, CandidatesOpt, FusedOpt,
    FLAG, app, common_overrides, complete_recipe, completing, handle_errors, run_command,
)
from optc.errors import OptcError
from optc.methods import METHODS, methods_of_kind
from optc.methods.base import CANDIDATE_SETS


@app.command()
@handle_errors
def run(
    recipe: Annotated[str, typer.Argument(help="Built-in recipe name or YAML path.", autocompletion=complete_recipe)],
    model: ModelOpt = None, output: OutputOpt = None, overwrite: OverwriteOpt = False,
    force_overwrite: ForceOverwriteOpt = False, no_save: NoSaveOpt = False,
    dataset: DatasetOpt = None, samples: SamplesOpt = None, seqlen: SeqlenOpt = None, seed: SeedOpt = None,
    eval_dataset: EvalDatasetOpt = None, windows: WindowsOpt = None, no_eval: NoEvalOpt = False,
    fmt: FormatOpt = None, dtype: DtypeOpt = None, text_column: TextColumnOpt = None, split: SplitOpt = None,
    device: DeviceOpt = "cpu", trust_remote_code: TrustOpt = False, as_json: JsonOpt = False,
    gate: GateOpt = None, quiet: QuietOpt = False, resume: ResumeOpt = False, streaming: StreamingOpt = False,
    target_bpw: TargetBpwOpt = None, target_size: TargetSizeOpt = None, candidates: CandidatesOpt = None,
    fused: FusedOpt = False,
) -> None:
    """Run a whole multi-stage recipe: compress, evaluate, export, report."""
    overrides = common_overrides(model, dataset, samples, seqlen, seed, eval_dataset, windows, fmt, streaming, text_column=text_column, split=split, dtype=dtype)
    overrides.update(_budget_overrides(recipe, target_bpw, target_size, candidates, fused))
    run_command(recipe, overrides, output, overwrite, device, trust_remote_code, no_eval, as_json, gates=gate, quiet=quiet, resume=resume, no_save=no_save, force_overwrite=force_overwrite)


# Flags of quantize / prune address a stage by what it is, not by its position: the first stage
# of the flag's kind whose config takes the field the flag sets.
_PRUNE_FIELDS = ("pattern", "sparsity")  # --method/--pattern/--sparsity of optc prune
_STRUCTURED_FIELDS = ("heads", "kv_heads", "mlp")  # --structured of optc prune


def _takes(method: str, fields: tuple[str, ...]) -> bool:
    return set(fields) <= set(METHODS[method].config.model_fields)


def _prune_methods() -> list[str]:
    """Pruning methods --method chooses among: those taking --pattern / --sparsity."""
    return [m for m in methods_of_kind("prune") if _takes(m, _PRUNE_FIELDS)]


def _first_stage(recipe: str, kind: str, flags: dict[str, Any], fields: tuple[str, ...] = ()) -> int | None:
    """Index of the recipe's first ``kind`` stage whose config takes ``fields``: where the given
    ``flags`` go (None when none of them is given). A recipe without one is refused."""
    given = [flag for flag, value in flags.items() if value is not None]
    if not given:
        return None
    from optc.recipe import read_recipe_data, resolve_recipe

    data = read_recipe_data(resolve_recipe(recipe))
    if not isinstance(data, dict):
        return None  # refused as a whole when the run parses it
    stages = data.get("stages") or []
    types = [st.get("type") if isinstance(st, dict) else None for st in stages] if isinstance(stages, list) else []
    for i, t in enumerate(types):
        if isinstance(t, str) and t in METHODS and METHODS[t].kind == kind and _takes(t, fields):
            return i
    what = f"{kind} stage" + (f" taking {'/'.join(fields)}" if fields else "")
    have = " -> ".join(str(t) for t in types) or "none"
    raise OptcError(f"cannot set {', '.join(given)}: the recipe has no such entry (no {what} in {recipe}; its stages: {have})")


def _budget_overrides(recipe: str, target_bpw: float | None, target_size: str | None,
                      candidates: str | None = None, fused: bool = False) -> dict[str, Any]:
    """--target-bpw / --target-size / --candidates / --fused as the budget of the recipe's first
    quantize stage."""
    if target_bpw is not None and target_size is not None:
        raise OptcError("--target-bpw and --target-size exclude each other: a budget has one target")
    if candidates is not None and candidates not in CANDIDATE_SETS:
        raise OptcError(f"--candidates {candidates!r}: expected {' or '.join(CANDIDATE_SETS)}")
    flags = {"--target-bpw": target_bpw, "--target-size": target_size, "--candidates": candidates,
             "--fused": fused or None}
    i = _first_stage(recipe, "quantize", flags)
    if i is None:
        return {}
    for flag in ("--candidates", "--fused"):
        if flags[flag] is not None and target_bpw is None and target_size is None and not _has_budget(recipe, i):
            raise OptcError(f"{flag} chooses a budget's schemes: give --target-bpw or --target-size too")
    out = {f"stages.{i}.budget.bits_per_weight": target_bpw, f"stages.{i}.budget.size": target_size}
    if candidates is not None:
        out[f"stages.{i}.budget.candidates"] = candidates
    if fused:
        out[f"stages.{i}.budget.fused"] = True
    return out


def _has_budget(recipe: str, i: int) -> bool:
    from optc.recipe import read_recipe_data, resolve_recipe

    stage = read_recipe_data(resolve_recipe(recipe))["stages"][i]
    return isinstance(stage.get("budget"), dict)


@app.command()
@handle_errors
def quantize(
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="Built-in recipe name or YAML path.")] = "w4a16-rtn.yaml",
    method: Annotated[Optional[str], typer.Option("--method", autocompletion=completing(lambda: methods_of_kind("quantize")), help=f"Method of the recipe's first quantize stage: {', '.join(methods_of_kind('quantize'))}.")] = None,
    bits: Annotated[Optional[int], typer.Option("--bits", help="Weight bits (2-8) of the recipe's first quantize stage.")] = None,
    group_size: Annotated[Optional[int], typer.Option("--group-size", help="Input columns per scale of the recipe's first quantize stage.")] = None,
    model: ModelOpt = None, output: OutputOpt = None, overwrite: OverwriteOpt = False,
    force_overwrite: ForceOverwriteOpt = False, no_save: NoSaveOpt = False,
    dataset: DatasetOpt = None, samples: SamplesOpt = None, seqlen: SeqlenOpt = None, seed: SeedOpt = None,
    eval_dataset: EvalDatasetOpt = None, windows: WindowsOpt = None, no_eval: NoEvalOpt = False,
    fmt: FormatOpt = None, dtype: DtypeOpt = None, text_column: TextColumnOpt = None, split: SplitOpt = None,
    device: DeviceOpt = "cpu", trust_remote_code: TrustOpt = False, as_json: JsonOpt = False,
    gate: GateOpt = None, quiet: QuietOpt = False, resume: ResumeOpt = False, streaming: StreamingOpt = False,
    target_bpw: TargetBpwOpt = None, target_size: TargetSizeOpt = None, candidates: CandidatesOpt = None,
    fused: FusedOpt = False,
) -> None:
    """Quantize weights with a recipe (default: 4-bit round-to-nearest); --method, --bits and
    --group-size override its first quantize stage (e.g. gptq after a sparsegpt stage), and
    --target-bpw / --target-size give it a budget."""
    known = methods_of_kind("quantize")
    if method is not None and method not in known:
        raise OptcError(f"unknown quantization method {method!r} (expected {', '.join(known)})")
    overrides = common_overrides(model, dataset, samples, seqlen, seed, eval_dataset, windows, fmt, streaming, text_column=text_column, split=split, dtype=dtype)
    i = _first_stage(recipe, "quantize", {"--method": method, "--bits": bits, "--group-size": group_size})
    if i is not None:
        overrides.update({f"stages.{i}.type": method, f"stages.{i}.scheme.bits": bits, f"stages.{i}.scheme.group_size": group_size})
    overrides.update(_budget_overrides(recipe, target_bpw, target_size, candidates, fused))
    run_command(recipe, overrides, output, overwrite, device, trust_remote_code, no_eval, as_json, gates=gate, quiet=quiet, resume=resume, no_save=no_save, force_overwrite=force_overwrite)


@app.command()
@handle_errors
def prune(
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help="Built-in recipe name or YAML path.")] = None,
    method: Annotated[Optional[str], typer.Option("--method", autocompletion=completing(_prune_methods), help=f"Pruning score: {', '.join(_prune_methods())} (default magnitude); with --recipe, the method of its first prune stage taking --pattern/--sparsity.")] = None,
    pattern: Annotated[Optional[str], typer.Option("--pattern", help="N:M pattern, e.g. 2:4 (with --recipe: of its first prune stage taking --pattern/--sparsity).")] = None,
    sparsity: Annotated[Optional[float], typer.Option("--sparsity", help="Unstructured sparsity in [0, 1) (with --recipe: of its first prune stage taking --pattern/--sparsity).")] = None,
    structured: Annotated[Optional[str], typer.Option("--structured", help="Remove heads / MLP channels, e.g. heads=0.25,mlp=0.3 (also kv_heads=); with --recipe: its structured stage.")] = None,
    model: ModelOpt = None, output: OutputOpt = None, overwrite: OverwriteOpt = False,
    force_overwrite: ForceOverwriteOpt = False, no_save: NoSaveOpt = False,
    dataset: DatasetOpt = None, samples: SamplesOpt = None, seqlen: SeqlenOpt = None, seed: SeedOpt = None,
    eval_dataset: EvalDatasetOpt = None, windows: WindowsOpt = None, no_eval: NoEvalOpt = False,
    fmt: FormatOpt = None, dtype: DtypeOpt = None, text_column: TextColumnOpt = None, split: SplitOpt = None,
    device: DeviceOpt = "cpu", trust_remote_code: TrustOpt = False, as_json: JsonOpt = False,
    gate: GateOpt = None, quiet: QuietOpt = False, resume: ResumeOpt = False,
) -> None:
    """Prune weights: unstructured (--sparsity), N:M (--pattern 2:4) or structured (--structured);
    with --recipe the flags override its first prune stage that takes them."""
    known = _prune_methods()
    if method is not None and method not in known:
        expected = f"{', '.join(known[:-1])} or {known[-1]}" if len(known) > 1 else ", ".join(known)
        raise OptcError(f"unknown pruning method {method!r} (expected {expected})")
    if sparsity is not None and pattern is not None:
        # The method would prune to the pattern and drop --sparsity without a word.
        raise OptcError(f"--sparsity {sparsity} and --pattern {pattern} exclude each other: an N:M pattern fixes "
                        "the sparsity (2:4 prunes 50%); pass one of them")
    overrides = common_overrides(model, dataset, samples, seqlen, seed, eval_dataset, windows, fmt, text_column=text_column, split=split, dtype=dtype)
    parts = _parse_structured(structured) if structured is not None else None
    stages = None
    if recipe is None:
        remover = next(m for m in methods_of_kind("prune") if _takes(m, _STRUCTURED_FIELDS))
        stages = [{"type": remover, **parts}] if parts else []
        if pattern is not None or sparsity is not None or not parts:
            stage: dict[str, Any] = {"type": method or "magnitude"}
            if pattern is not None:
                stage["pattern"] = pattern
            if sparsity is not None:
                stage["sparsity"] = sparsity
            stages.append(stage)
    else:
        i = _first_stage(recipe, "prune", {"--method": method, "--pattern": pattern, "--sparsity": sparsity}, _PRUNE_FIELDS)
        if i is not None and sparsity is not None:
            _refuse_sparsity_under_pattern(recipe, i, sparsity)
        if i is not None:
            overrides.update({f"stages.{i}.type": method, f"stages.{i}.pattern": pattern, f"stages.{i}.sparsity": sparsity})
        i = _first_stage(recipe, "prune", {"--structured": structured}, _STRUCTURED_FIELDS)
        if i is not None:
            overrides.update({f"stages.{i}.{k}": v for k, v in (parts or {}).items()})
    run_command(recipe or "prune-2of4-magnitude.yaml", overrides, output, overwrite, device, trust_remote_code, no_eval, as_json, stages, gates=gate, quiet=quiet, resume=resume, no_save=no_save, force_overwrite=force_overwrite)


@app.command()
@handle_errors
def recover(
    model: Annotated[Optional[str], typer.Argument(help="The compressed checkpoint (or any model) to recover.")] = None,
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="Recipe holding the recover stage (its first recover stage gets the flags).")] = "recover.yaml",
    teacher: Annotated[Optional[str], typer.Option("--teacher", help="Uncompressed model to distil from (default: the model an optc checkpoint was compressed from).")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Optimizer steps.")] = None,
    tokens: Annotated[Optional[int], typer.Option("--tokens", help="Training tokens.")] = None,
    max_minutes: Annotated[Optional[float], typer.Option("--max-minutes", help="Wall-clock budget in minutes.")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Peak learning rate.")] = None,
    rank: Annotated[Optional[int], typer.Option("--rank", help="LoRA rank.")] = None,
    alpha: Annotated[Optional[float], typer.Option("--alpha", help="LoRA alpha (update scaled by alpha/rank).")] = None,
    loss: Annotated[Optional[str], typer.Option("--loss", help="ce, kd or mix.")] = None,
    kd_weight: Annotated[Optional[float], typer.Option("--kd-weight", help="mix: weight of the distillation term.")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="Distillation temperature.")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Sequences per step.")] = None,
    target: Annotated[Optional[list[str]], typer.Option("--target", help="Regex of Linears to adapt (repeatable).")] = None,
    gradient_checkpointing: Annotated[Optional[bool], typer.Option("--gradient-checkpointing/--no-gradient-checkpointing", help="Recompute activations in the backward pass.", metavar=FLAG)] = None,
    save_every: Annotated[Optional[int], typer.Option("--save-every", help="Save resumable state every N steps (0: never).")] = None,
    state_dir: Annotated[Optional[str], typer.Option("--state-dir", help="Where the resumable state lives (default: beside --output).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run from its last saved step.", metavar=FLAG)] = False,
    export_mode: Annotated[Optional[str], typer.Option("--export", help="merge (fold into the weights, same grid) or adapter (peft adapter beside the checkpoint).")] = None,
    output: OutputOpt = None, overwrite: OverwriteOpt = False,
    force_overwrite: ForceOverwriteOpt = False, no_save: NoSaveOpt = False,
    dataset: DatasetOpt = None, samples: SamplesOpt = None, seqlen: SeqlenOpt = None, seed: SeedOpt = None,
    eval_dataset: EvalDatasetOpt = None, windows: WindowsOpt = None, no_eval: NoEvalOpt = False,
    fmt: FormatOpt = None, dtype: DtypeOpt = None, text_column: TextColumnOpt = None, split: SplitOpt = None,
    device: DeviceOpt = "cpu", trust_remote_code: TrustOpt = False, as_json: JsonOpt = False,
    gate: GateOpt = None, quiet: QuietOpt = False,
) -> None:
    """Recover accuracy with a LoRA fine-tune distilled from the float model; masks and grids are kept."""
    from optc.export.load import quantized_format
    from optc.recipe import read_recipe_data, resolve_recipe

    data = read_recipe_data(resolve_recipe(recipe))
    stages = data.get("stages") if isinstance(data, dict) else None
    index = next((i for i, st in enumerate(stages or []) if isinstance(st, dict) and isinstance(st.get("type"), str)
                  and st["type"] in METHODS and METHODS[st["type"]].kind == "recover"), None)
    if index is None:
        raise OptcError(f"recipe {recipe}: has no recover stage (use optc run for other recipes)")
    fmt = fmt or quantized_format(model)  # a quantized checkpoint stays in its format
    overrides = common_overrides(model, dataset, samples, seqlen, seed, eval_dataset, windows, fmt, text_column=text_column, split=split, dtype=dtype)
    fields = {
        "teacher": teacher, "steps": steps, "tokens": tokens, "max_minutes": max_minutes, "lr": lr,
        "rank": rank, "alpha": alpha, "loss": loss, "kd_weight": kd_weight, "temperature": temperature,
        "batch_size": batch_size, "targets": target, "gradient_checkpointing": gradient_checkpointing,
        "save_every": save_every, "state_dir": state_dir, "resume": resume or None, "export": export_mode,
        "seed": seed,
    }
    overrides.update({f"stages.{index}.{k}": v for k, v in fields.items()})
    run_command(recipe, overrides, output, overwrite, device, trust_remote_code, no_eval, as_json, gates=gate, quiet=quiet, no_save=no_save, force_overwrite=force_overwrite)


def _refuse_sparsity_under_pattern(recipe: str, index: int, sparsity: float) -> None:
    """--sparsity on a recipe stage that prunes to an N:M pattern would be ignored: refused."""
    from optc.recipe import read_recipe_data, resolve_recipe

    stage = read_recipe_data(resolve_recipe(recipe))["stages"][index]
    if stage.get("pattern"):
        raise OptcError(f"--sparsity {sparsity}: stage {index} of {recipe} prunes to the pattern {stage['pattern']}, "
                        "which fixes the sparsity; pass --pattern instead, or use a recipe without one")


def _parse_structured(text: str) -> dict[str, float]:
    """``heads=0.25,mlp=0.3`` -> ``{"heads": 0.25, "mlp": 0.3}``."""
    parts: dict[str, float] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("heads", "kv_heads", "mlp"):
            raise OptcError(f"--structured {text!r}: expected heads=F, kv_heads=F and/or mlp=F, got {item!r}")
        try:
            parts[key.strip()] = float(value)
        except ValueError:
            raise OptcError(f"--structured {text!r}: {value!r} is not a number") from None
    if not parts:
        raise OptcError("--structured needs heads=F, kv_heads=F and/or mlp=F (e.g. heads=0.25,mlp=0.3)")
    return parts


@app.command()
@handle_errors
def sweep(
    recipe: Annotated[str, typer.Argument(help="Built-in recipe name or YAML path (its first quantize stage is swept).", autocompletion=complete_recipe)],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for one checkpoint per point, report.md and sweep.json.")],
    target_bpw: Annotated[Optional[list[float]], typer.Option("--target-bpw", help="A budget to run at, in bits per decoder-Linear weight (repeatable).")] = None,
    uniform: Annotated[Optional[list[int]], typer.Option("--uniform", help="A uniform bit width to run as a reference point (repeatable).")] = None,
    model: ModelOpt = None, overwrite: OverwriteOpt = False,
    dataset: DatasetOpt = None, samples: SamplesOpt = None, seqlen: SeqlenOpt = None, seed: SeedOpt = None,
    eval_dataset: EvalDatasetOpt = None, windows: WindowsOpt = None,
    fmt: FormatOpt = None, dtype: DtypeOpt = None, text_column: TextColumnOpt = None, split: SplitOpt = None,
    device: DeviceOpt = "cpu", trust_remote_code: TrustOpt = False, quiet: QuietOpt = False,
) -> None:
    """Run a recipe at several budgets and uniform bit widths; report.md holds the size-versus-
    perplexity table, its Pareto front and a chart."""
    from rich.table import Table

    from optc.cli.app import console, pick_device, progress_bars
    from optc.recipe import apply_overrides, parse_recipe, read_recipe_data, resolve_recipe
    from optc.run.sweep import pareto, run_sweep

    path = resolve_recipe(recipe)
    data = read_recipe_data(path)
    overrides = common_overrides(model, dataset, samples, seqlen, seed, eval_dataset, windows, fmt, text_column=text_column, split=split, dtype=dtype)
    parsed = parse_recipe(apply_overrides(data, overrides) if isinstance(data, dict) else data, str(path))
    result = run_sweep(parsed, output, list(target_bpw or []), list(uniform or []), device=pick_device(device),
                       overwrite=overwrite, trust_remote_code=trust_remote_code, progress=progress_bars(quiet))
    if quiet:
        return
    table = Table(title=f"optc sweep: {parsed.name}")
    for col in ("point", "bits / Linear weight", "weights (MiB)", "perplexity", "Pareto"):
        table.add_column(col, justify="left" if col == "point" else "right")
    points = result["points"]
    for p, on in sorted(zip(points, pareto(points)), key=lambda t: t[0]["bytes"]):
        table.add_row(p["label"], f"{p['bits_per_weight']:.4f}", f"{p['bytes'] / 2**20:.2f}", f"{p['perplexity']:.3f}",
                      "yes" if on else "")
    console.print(table)
    console.print(f"wrote {result['report']}")
