"""The ``optc`` command line: parse, load, call one library function, print with rich."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgressBar
from rich.table import Table

import optc
from optc.errors import Interrupted, OptcError
from optc.cli.stage_flags import PRUNE_FIELDS, STRUCTURED_FIELDS, first_stage, prune_methods, takes
from optc.methods import METHODS, methods_of_kind

app = typer.Typer(
    name="optc",
    help="Compress Hugging Face causal LMs (RTN, GPTQ, AWQ, INT8, pruning) into checkpoints real runtimes load.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
recipes_app = typer.Typer(help="List, show and validate recipes.", invoke_without_command=True)
app.add_typer(recipes_app, name="recipes")

console = Console()
err_console = Console(stderr=True)

# Options shared by every command, with one meaning everywhere.
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="HF directory, hub id, .gguf file, or 'smollm2-135m' (default).")]
OutputOpt = Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory (written atomically).")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")]
DatasetOpt = Annotated[Optional[str], typer.Option("--dataset", help="Calibration text: builtin, wikitext2, c4, or a .txt/.jsonl path.")]
SamplesOpt = Annotated[Optional[int], typer.Option("--samples", help="Calibration samples.")]
SeqlenOpt = Annotated[Optional[int], typer.Option("--seqlen", help="Tokens per calibration sample.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed for sampling and any randomness.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, or auto.")]
EvalDatasetOpt = Annotated[Optional[str], typer.Option("--eval-dataset", help="Evaluation text (never used for calibration).")]
WindowsOpt = Annotated[Optional[int], typer.Option("--windows", help="Evaluate the first N windows only.")]
NoEvalOpt = Annotated[bool, typer.Option("--no-eval", help="Skip perplexity evaluation.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the model repository.")]
FormatOpt = Annotated[Optional[str], typer.Option("--format", help="Export format: dense, compressed-tensors, gptq, awq, gguf-q4_0, gguf-q8_0 or gguf-f16.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the report as JSON.")]
GateOpt = Annotated[Optional[list[str]], typer.Option("--gate", help="CI gate, e.g. 'ppl_increase<=5%' (repeatable); a failed gate exits with code 3 after the report is written.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars; print only errors and failed gates.")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run from the layers it saved beside --output (same checkpoint as an uninterrupted run).")]
StreamingOpt = Annotated[bool, typer.Option("--streaming", help="Read one decoder layer at a time from the safetensors shards (models larger than memory; default: when the model does not fit).")]


def _version(value: bool) -> None:
    if value:
        console.print(f"optc {optc.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress details.")] = False,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False)],
        force=True,
    )
    for noisy in ("transformers", "datasets", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def handle_errors(fn: Callable) -> Callable:
    """Turn user errors into one red line and exit code 1, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OptcError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", soft_wrap=True, highlight=False)
            raise typer.Exit(1) from None
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            err_console.print(f"[bold red]error:[/] {problems}", soft_wrap=True, highlight=False)
            raise typer.Exit(1) from None
        except Interrupted as exc:
            err_console.print(
                f"[bold red]interrupted[/] ({exc.where}): no output was written. The finished layers are "
                f"saved in {exc.state_dir}; continue with:\n  {_resume_command()}", soft_wrap=True, highlight=False,
            )
            raise typer.Exit(130) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]: no output was written")
            raise typer.Exit(130) from None

    return wrapper


def _resume_command() -> str:
    """The command line that was run, with ``--resume``."""
    import shlex
    import sys

    args = sys.argv[1:]
    return shlex.join(["optc", *args, *([] if "--resume" in args else ["--resume"])])


class RichProgress:
    """rich progress bars for the library's :class:`optc.progress.Progress` protocol."""

    @contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Callable[..., None]]:
        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
        with RichProgressBar(*columns, console=err_console, transient=True) as bar:
            tid = bar.add_task(description, total=total)

            def advance(info: str | None = None) -> None:
                bar.update(tid, advance=1, description=description if info is None else f"{description} {info}")

            yield advance


def _print_report(report: dict, as_json: bool) -> None:
    if as_json:
        console.print_json(json.dumps(report, default=str))
        return
    metrics = report.get("metrics", {})
    table = Table(title=f"optc report: {report['model']}")
    table.add_column("model")
    table.add_column("perplexity", justify="right")
    table.add_column("95% CI", justify="right")
    table.add_column("windows", justify="right")
    for key, value in metrics.items():
        if key.startswith("perplexity_") and isinstance(value, dict) and "ci95" in value:
            lo, hi = value["ci95"]
            ci = "-" if lo is None else f"\\[{lo:.2f}, {hi:.2f}]"  # escaped: not rich markup
            table.add_row(key.removeprefix("perplexity_"), f"{value['perplexity']:.3f}", ci, f"{value['windows']} x {value['seqlen']}")
    if table.row_count:
        console.print(table)
    if "perplexity_baseline" in metrics and "perplexity_compressed" in metrics:
        b, c = metrics["perplexity_baseline"]["perplexity"], metrics["perplexity_compressed"]["perplexity"]
        ch, paired = metrics.get("perplexity_change") or {}, ""
        if (ch.get("ppl_increase_pct_ci95") or [None])[0] is not None:
            lo, hi = ch["ppl_increase_pct_ci95"]
            paired = f" (paired 95% CI [{lo:+.2f}%, {hi:+.2f}%]: {'a real change' if ch['significant'] else 'within noise'})"
        console.print(f"perplexity change: {100 * (c / b - 1):+.2f}%{paired}", highlight=False)
    for st in report.get("stages", []):
        console.print(f"stage [bold]{st['type']}[/] ({st['seconds']:.1f} s): {st['summary']}")
    if metrics.get("parameters"):
        console.print(f"parameters: {metrics['parameters']:,} ({metrics['nonzero']:,} non-zero)")
    ck = report.get("checkpoint")
    if ck:
        console.print(f"wrote [bold]{ck['path']}[/] ({ck['format']}, {ck['bytes'] / 2**20:.1f} MiB): report.json, report.md, recipe.yaml")
    _print_details(report)


def _print_details(report: dict) -> None:
    from optc.evaluate.report import summary_lines

    for line in summary_lines(report):
        if not line.startswith("Perplexity change:"):  # printed with the perplexity table
            console.print(line, highlight=False, markup=False)
    for g in report.get("gates", []):
        console.print(("[green]" if g["passed"] else "[bold red]") + g["message"] + "[/]", highlight=False)


def _finish(report: dict, as_json: bool, quiet: bool) -> None:
    """Print the report (unless quiet), then exit with the gate code if a gate failed."""
    from optc.evaluate.gates import GATE_EXIT_CODE, failed

    if as_json or not quiet:
        _print_report(report, as_json)
    bad = failed(report.get("gates", []))
    if bad:
        if quiet or as_json:
            for g in bad:
                err_console.print(f"[bold red]{g['message']}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(GATE_EXIT_CODE)


def _common_overrides(model, dataset, samples, seqlen, seed, eval_dataset, windows, fmt, streaming: bool = False) -> dict:
    return {
        "calibration.streaming": True if streaming else None,
        "model": model,
        "calibration.dataset": dataset,
        "calibration.samples": samples,
        "calibration.seqlen": seqlen,
        "calibration.seed": seed,
        "evaluation.dataset": eval_dataset,
        "evaluation.windows": windows,
        "export.format": fmt,
    }


def _run(recipe_name: str, overrides: dict, output, overwrite, device, trust_remote_code, no_eval, as_json, stages: list | None = None, gates: list[str] | None = None, quiet: bool = False, resume: bool = False) -> None:
    from optc.calibrate.distributed import is_main_process
    from optc.run.pipeline import run_recipe
    from optc.recipe import apply_overrides, parse_recipe, read_recipe_data, resolve_recipe

    path = resolve_recipe(recipe_name)
    data = read_recipe_data(path)
    if not isinstance(data, dict):
        raise OptcError(f"recipe {path}: expected a mapping at the top level")
    if stages is not None:
        data["stages"] = stages
    if no_eval:
        data["evaluation"] = None
    recipe = parse_recipe(apply_overrides(data, overrides), str(path))
    main = is_main_process()  # under torchrun only rank 0 shows progress and prints the report
    report = run_recipe(recipe, output, overwrite=overwrite, device=_device(device), trust_remote_code=trust_remote_code, progress=_progress(quiet or not main), gates=gates, resume=resume)
    if main:
        _finish(report, as_json, quiet)


def _progress(quiet: bool):
    from optc.progress import NullProgress

    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its weight-loading bars too
        return NullProgress()
    return RichProgress()


def _device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise OptcError(f"unknown device {device!r} (expected cpu, cuda or auto)")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise OptcError("--device cuda: no CUDA device is available (use cpu or auto)")
    return device


@app.command()
@handle_errors
def run(
    recipe: Annotated[str, typer.Argument(help="Built-in recipe name or YAML path.")],
    model: ModelOpt = None, output: OutputOpt = None, overwrite: OverwriteOpt = False,
    dataset: DatasetOpt = None, samples: SamplesOpt = None, seqlen: SeqlenOpt = None, seed: SeedOpt = None,
    eval_dataset: EvalDatasetOpt = None, windows: WindowsOpt = None, no_eval: NoEvalOpt = False,
    fmt: FormatOpt = None, device: DeviceOpt = "cpu", trust_remote_code: TrustOpt = False, as_json: JsonOpt = False,
    gate: GateOpt = None, quiet: QuietOpt = False, resume: ResumeOpt = False, streaming: StreamingOpt = False,
) -> None:
    """Run a whole multi-stage recipe: compress, evaluate, export, report."""
    overrides = _common_overrides(model, dataset, samples, seqlen, seed, eval_dataset, windows, fmt, streaming)
    _run(recipe, overrides, output, overwrite, device, trust_remote_code, no_eval, as_json, gates=gate, quiet=quiet, resume=resume)


@app.command()
@handle_errors
def quantize(
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="Built-in recipe name or YAML path.")] = "w4a16-rtn.yaml",
    method: Annotated[Optional[str], typer.Option("--method", help=f"Method of the recipe's first quantize stage: {', '.join(methods_of_kind('quantize'))}.")] = None,
    bits: Annotated[Optional[int], typer.Option("--bits", help="Weight bits (2-8) of the recipe's first quantize stage.")] = None,
    group_size: Annotated[Optional[int], typer.Option("--group-size", help="Input columns per scale of the recipe's first quantize stage.")] = None,
    model: ModelOpt = None, output: OutputOpt = None, overwrite: OverwriteOpt = False,
    dataset: DatasetOpt = None, samples: SamplesOpt = None, seqlen: SeqlenOpt = None, seed: SeedOpt = None,
    eval_dataset: EvalDatasetOpt = None, windows: WindowsOpt = None, no_eval: NoEvalOpt = False,
    fmt: FormatOpt = None, device: DeviceOpt = "cpu", trust_remote_code: TrustOpt = False, as_json: JsonOpt = False,
    gate: GateOpt = None, quiet: QuietOpt = False, resume: ResumeOpt = False, streaming: StreamingOpt = False,
) -> None:
    """Quantize weights with a recipe (default: 4-bit round-to-nearest); --method, --bits and
    --group-size override its first quantize stage (e.g. gptq after a sparsegpt stage)."""
    known = methods_of_kind("quantize")
    if method is not None and method not in known:
        raise OptcError(f"unknown quantization method {method!r} (expected {', '.join(known)})")
    overrides = _common_overrides(model, dataset, samples, seqlen, seed, eval_dataset, windows, fmt, streaming)
    i = first_stage(recipe, "quantize", {"--method": method, "--bits": bits, "--group-size": group_size})
    if i is not None:
        overrides.update({f"stages.{i}.type": method, f"stages.{i}.scheme.bits": bits, f"stages.{i}.scheme.group_size": group_size})
    _run(recipe, overrides, output, overwrite, device, trust_remote_code, no_eval, as_json, gates=gate, quiet=quiet, resume=resume)


@app.command()
@handle_errors
def prune(
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help="Built-in recipe name or YAML path.")] = None,
    method: Annotated[Optional[str], typer.Option("--method", help=f"Pruning score: {', '.join(prune_methods())} (default magnitude); with --recipe, the method of its first prune stage taking --pattern/--sparsity.")] = None,
    pattern: Annotated[Optional[str], typer.Option("--pattern", help="N:M pattern, e.g. 2:4 (with --recipe: of its first prune stage taking --pattern/--sparsity).")] = None,
    sparsity: Annotated[Optional[float], typer.Option("--sparsity", help="Unstructured sparsity in [0, 1) (with --recipe: of its first prune stage taking --pattern/--sparsity).")] = None,
    structured: Annotated[Optional[str], typer.Option("--structured", help="Remove heads / MLP channels, e.g. heads=0.25,mlp=0.3 (also kv_heads=); with --recipe: its structured stage.")] = None,
    model: ModelOpt = None, output: OutputOpt = None, overwrite: OverwriteOpt = False,
    dataset: DatasetOpt = None, samples: SamplesOpt = None, seqlen: SeqlenOpt = None, seed: SeedOpt = None,
    eval_dataset: EvalDatasetOpt = None, windows: WindowsOpt = None, no_eval: NoEvalOpt = False,
    fmt: FormatOpt = None, device: DeviceOpt = "cpu", trust_remote_code: TrustOpt = False, as_json: JsonOpt = False,
    gate: GateOpt = None, quiet: QuietOpt = False, resume: ResumeOpt = False,
) -> None:
    """Prune weights: unstructured (--sparsity), N:M (--pattern 2:4) or structured (--structured);
    with --recipe the flags override its first prune stage that takes them."""
    known = prune_methods()
    if method is not None and method not in known:
        expected = f"{', '.join(known[:-1])} or {known[-1]}" if len(known) > 1 else ", ".join(known)
        raise OptcError(f"unknown pruning method {method!r} (expected {expected})")
    overrides = _common_overrides(model, dataset, samples, seqlen, seed, eval_dataset, windows, fmt)
    parts = _parse_structured(structured) if structured is not None else None
    stages = None
    if recipe is None:
        remover = next(m for m in methods_of_kind("prune") if takes(m, STRUCTURED_FIELDS))
        stages = [{"type": remover, **parts}] if parts else []
        if pattern is not None or sparsity is not None or not parts:
            stage: dict[str, Any] = {"type": method or "magnitude"}
            if pattern is not None:
                stage["pattern"] = pattern
            if sparsity is not None:
                stage["sparsity"] = sparsity
            stages.append(stage)
    else:
        i = first_stage(recipe, "prune", {"--method": method, "--pattern": pattern, "--sparsity": sparsity}, PRUNE_FIELDS)
        if i is not None:
            overrides.update({f"stages.{i}.type": method, f"stages.{i}.pattern": pattern, f"stages.{i}.sparsity": sparsity})
        i = first_stage(recipe, "prune", {"--structured": structured}, STRUCTURED_FIELDS)
        if i is not None:
            overrides.update({f"stages.{i}.{k}": v for k, v in (parts or {}).items()})
    _run(recipe or "prune-2of4-magnitude.yaml", overrides, output, overwrite, device, trust_remote_code, no_eval, as_json, stages, gates=gate, quiet=quiet, resume=resume)


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
    gradient_checkpointing: Annotated[Optional[bool], typer.Option("--gradient-checkpointing/--no-gradient-checkpointing", help="Recompute activations in the backward pass.")] = None,
    save_every: Annotated[Optional[int], typer.Option("--save-every", help="Save resumable state every N steps (0: never).")] = None,
    state_dir: Annotated[Optional[str], typer.Option("--state-dir", help="Where the resumable state lives (default: beside --output).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run from its last saved step.")] = False,
    export_mode: Annotated[Optional[str], typer.Option("--export", help="merge (fold into the weights, same grid) or adapter (peft adapter beside the checkpoint).")] = None,
    output: OutputOpt = None, overwrite: OverwriteOpt = False,
    dataset: DatasetOpt = None, samples: SamplesOpt = None, seqlen: SeqlenOpt = None, seed: SeedOpt = None,
    eval_dataset: EvalDatasetOpt = None, windows: WindowsOpt = None, no_eval: NoEvalOpt = False,
    fmt: FormatOpt = None, device: DeviceOpt = "cpu", trust_remote_code: TrustOpt = False, as_json: JsonOpt = False,
    gate: GateOpt = None, quiet: QuietOpt = False,
) -> None:
    """Recover accuracy with a LoRA fine-tune distilled from the float model; masks and grids are kept."""
    from optc.model.load import checkpoint_is_quantized
    from optc.recipe import read_recipe_data, resolve_recipe

    data = read_recipe_data(resolve_recipe(recipe))
    stages = data.get("stages") if isinstance(data, dict) else None
    index = next((i for i, st in enumerate(stages or []) if isinstance(st, dict) and isinstance(st.get("type"), str)
                  and st["type"] in METHODS and METHODS[st["type"]].kind == "recover"), None)
    if index is None:
        raise OptcError(f"recipe {recipe}: has no recover stage (use optc run for other recipes)")
    if fmt is None and model is not None and checkpoint_is_quantized(model):
        fmt = "compressed-tensors"  # keep a quantized checkpoint's format
    overrides = _common_overrides(model, dataset, samples, seqlen, seed, eval_dataset, windows, fmt)
    fields = {
        "teacher": teacher, "steps": steps, "tokens": tokens, "max_minutes": max_minutes, "lr": lr,
        "rank": rank, "alpha": alpha, "loss": loss, "kd_weight": kd_weight, "temperature": temperature,
        "batch_size": batch_size, "targets": target, "gradient_checkpointing": gradient_checkpointing,
        "save_every": save_every, "state_dir": state_dir, "resume": resume or None, "export": export_mode,
        "seed": seed,
    }
    overrides.update({f"stages.{index}.{k}": v for k, v in fields.items()})
    _run(recipe, overrides, output, overwrite, device, trust_remote_code, no_eval, as_json, gates=gate, quiet=quiet)


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


@app.command("eval")
@handle_errors
def eval_(
    model: Annotated[Optional[str], typer.Argument(help="Checkpoint directory, hub id, .gguf file, or built-in name.")] = None,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="Compare against this model.")] = None,
    dataset: Annotated[str, typer.Option("--dataset", help="Evaluation text: builtin, wikitext2, c4, or a path.")] = "builtin",
    seqlen: Annotated[int, typer.Option("--seqlen", help="Tokens per window.")] = 512,
    windows: WindowsOpt = None,
    stride: Annotated[Optional[int], typer.Option("--stride", help="Sliding-window stride (default: seqlen).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Windows per forward.")] = 1,
    output: OutputOpt = None, overwrite: OverwriteOpt = False, as_json: JsonOpt = False,
    gate: GateOpt = None, quiet: QuietOpt = False,
    latency: Annotated[bool, typer.Option("--latency", help="Time prefill and decode (batch 1, CPU) on low-precision kernels; against --baseline too.")] = False,
    kernel: Annotated[str, typer.Option("--kernel", help="Latency kernels: auto, int4, int8-dynamic, int8-weight-only or float.")] = "auto",
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Latency: prompt length.")] = 128,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Latency: tokens decoded per run.")] = 32,
    repeats: Annotated[int, typer.Option("--repeats", help="Latency: timed runs per model.")] = 5,
    threads: Annotated[Optional[int], typer.Option("--threads", help="Latency: torch threads (default: torch's).")] = None,
    tasks: Annotated[Optional[str], typer.Option("--tasks", help="lm-eval-harness tasks, comma-separated (needs lm-eval and its data).")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Tokenize the evaluation text again instead of using the disk cache.")] = False,
    streaming: Annotated[bool, typer.Option("--streaming", help="Layer-major evaluation, one decoder layer in memory at a time (perplexity and size; models larger than memory).")] = False,
) -> None:
    """Perplexity with a 95% interval, KL and top-1 agreement against --baseline, size, latency; gates for CI."""
    from optc.run.pipeline import evaluate_model

    task_list = [t.strip() for t in tasks.split(",") if t.strip()] if tasks else None
    report = evaluate_model(
        model, dataset=dataset, seqlen=seqlen, windows=windows, stride=stride, batch_size=batch_size,
        baseline=baseline, output=output, overwrite=overwrite, progress=_progress(quiet), gates=gate,
        latency=latency, kernel=kernel, prompt_tokens=prompt_tokens, new_tokens=new_tokens,
        repeats=repeats, threads=threads, tasks=task_list, cache=not no_cache, streaming=streaming,
    )
    _finish(report, as_json, quiet)


@app.command("report")
@handle_errors
def report_(
    reports: Annotated[Optional[list[str]], typer.Argument(help="report.json files or directories holding one (any optc command's).")] = None,
    markdown: Annotated[Optional[Path], typer.Option("--markdown", help="Also write the comparison table to this Markdown file.")] = None,
    schema: Annotated[bool, typer.Option("--schema", help="Print the JSON Schema of report.json and exit.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Compare runs side by side: one column per report.json."""
    from optc.evaluate.compare import comparison_markdown, comparison_rows, load_reports
    from optc.evaluate.report import report_json_schema

    if schema:
        typer.echo(json.dumps(report_json_schema(), indent=2))
        return
    if not reports:
        raise OptcError("optc report needs at least one report.json (or a directory holding one)")
    labels, loaded = load_reports(reports)
    rows = comparison_rows(loaded)
    if as_json:
        console.print_json(json.dumps({"runs": labels, "rows": {name: cells for name, cells in rows}}))
    else:
        table = Table(title="optc runs")
        table.add_column("metric")
        for label in labels:
            table.add_column(label, justify="right", overflow="fold")
        for name, cells in rows:
            table.add_row(name, *(c.replace("[", "\\[") for c in cells))
        console.print(table)
    if markdown is not None:
        try:
            markdown.expanduser().write_text(comparison_markdown(labels, rows), encoding="utf-8")
        except OSError as exc:
            raise OptcError(f"cannot write {markdown}: {exc.strerror}") from None
        if not as_json:
            console.print(f"wrote [bold]{markdown}[/]")


@app.command()
@handle_errors
def inspect(
    path: Annotated[Path, typer.Argument(help="Checkpoint directory or .gguf file.")],
    as_json: JsonOpt = False,
) -> None:
    """What a checkpoint holds: format, bits, group size, sparsity, size, parameters."""
    from optc.export.inspect import inspect_checkpoint

    info = inspect_checkpoint(path)
    if as_json:
        console.print_json(json.dumps(info))
        return
    table = Table(title=str(path), show_header=False)
    for key, value in info.items():
        if key == "bytes":
            value = f"{value:,} ({value / 2**20:.1f} MiB)"
        elif key == "parameters":
            value = f"{value:,}"
        table.add_row(key, str(value))
    console.print(table)


@app.command()
@handle_errors
def export(
    model: Annotated[str, typer.Argument(help="Checkpoint to convert: compressed-tensors, GPTQ, AWQ, dense directory or .gguf.")],
    fmt: Annotated[str, typer.Option("--format", help="gptq, awq, compressed-tensors, dense, gguf-q4_0, gguf-q8_0 or gguf-f16.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output directory (written atomically).")],
    overwrite: OverwriteOpt = False,
    requantize: Annotated[bool, typer.Option("--requantize", help="GGUF: round grids the block type cannot hold again (lossy).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Convert a checkpoint to another format, re-packing its quantization grid (no calibration)."""
    from optc.export.convert import convert_checkpoint

    info = convert_checkpoint(model, output, fmt, overwrite=overwrite, requantize=requantize)
    if as_json:
        console.print_json(json.dumps(info, default=str))
        return
    console.print(f"wrote [bold]{info['path']}[/] ({info['format']}, {info['bytes'] / 2**20:.1f} MiB) from {info['source']}")
    for key in ("scheme", "modules"):
        if key in info:
            console.print(f"{key}: {info[key]}")
    for key in ("requantized", "rounded"):
        if info.get(key):
            console.print(f"[yellow]{key} by gguf's round-to-nearest[/]: {len(info[key])} module(s)")


@recipes_app.callback()
def recipes_root(ctx: typer.Context) -> None:
    """Without a subcommand: list the built-in recipes."""
    if ctx.invoked_subcommand is None:
        recipes_list()


@recipes_app.command("list")
@handle_errors
def recipes_list() -> None:
    """List the built-in recipes."""
    from optc.recipe import builtin_recipes, load_recipe

    table = Table(title="built-in recipes")
    table.add_column("recipe")
    table.add_column("stages")
    table.add_column("description")
    for name, path in sorted(builtin_recipes().items()):
        r = load_recipe(str(path))
        table.add_row(name, " -> ".join(s.type for s in r.stages) or "-", r.description)
    console.print(table)


@recipes_app.command("show")
@handle_errors
def recipes_show(name: Annotated[str, typer.Argument(help="Built-in recipe name or path.")]) -> None:
    """Print a recipe as written."""
    from optc.recipe import resolve_recipe

    typer.echo(resolve_recipe(name).read_text(encoding="utf-8"), nl=False)  # verbatim: never wrapped


@recipes_app.command("validate")
@handle_errors
def recipes_validate(
    names: Annotated[Optional[list[str]], typer.Argument(help="Recipe names or paths (default: all built-in).")] = None,
) -> None:
    """Validate recipes against the schema; exits non-zero on the first invalid one."""
    from optc.recipe import builtin_recipes, load_recipe

    for name in names or sorted(builtin_recipes()):
        recipe = load_recipe(name)
        console.print(f"[green]ok[/] {name}: {len(recipe.stages)} stage(s)")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
