"""What every ``optc`` command shares: the app, option blocks defined once, error handling,
progress bars and report printing (commands: :mod:`optc.cli.compress`, :mod:`optc.cli.measure`)."""

from __future__ import annotations

import functools
import json
import logging
import os
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
from optc.evaluate.protocol import EvalProtocol, LatencyOptions
from optc.export.formats import format_help
from optc.methods.base import CANDIDATE_SETS

app = typer.Typer(
    name="optc",
    help="Compress Hugging Face causal LMs (RTN, GPTQ, AWQ, INT8, pruning) into checkpoints real runtimes load.",
    no_args_is_help=True,
    add_completion=True,  # optc --install-completion / --show-completion
    pretty_exceptions_enable=False,
)
recipes_app = typer.Typer(help="List, show and validate recipes.", invoke_without_command=True)
app.add_typer(recipes_app, name="recipes")

console = Console()
err_console = Console(stderr=True)

# The one evaluation protocol's defaults (recipes' evaluation: block uses the same).
PROTOCOL = EvalProtocol()
LATENCY = LatencyOptions()

# typer shows a value type for every option ("<bool>" too); a flag takes no value, so its type
# column stays empty and --help reads it as the flag it is.
FLAG = ""


def completing(choices: Callable[[], Any]) -> Callable[[str], list[str]]:
    """Shell completion of an option's values from a registry, read when the shell asks."""
    return lambda incomplete: [c for c in choices() if c.startswith(incomplete)]


def _recipe_names() -> list[str]:
    from optc.recipe import builtin_recipes

    return sorted(n.removesuffix(".yaml") for n in builtin_recipes())


def _format_names() -> list[str]:
    from optc.export.formats import FORMATS

    return list(FORMATS)


complete_recipe = completing(_recipe_names)

# Options shared by every command, with one meaning everywhere.
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="HF directory, hub id, .gguf file, or 'smollm2-135m' (default).")]
OutputOpt = Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory (written atomically).")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory that optc wrote.", metavar=FLAG)]
ForceOverwriteOpt = Annotated[bool, typer.Option("--force-overwrite", help="Replace an existing output directory even if optc did not write it (never an input, a directory holding one, the working or home directory).", metavar=FLAG)]
NoSaveOpt = Annotated[bool, typer.Option("--no-save", help="Compress and measure without writing a checkpoint (without it, commands that compress need --output).", metavar=FLAG)]
DatasetOpt = Annotated[Optional[str], typer.Option("--dataset", help="Calibration text: builtin, wikitext2, c4, a .txt/.jsonl/.parquet/.arrow/.csv/.json file or folder, a save_to_disk directory, or a hub dataset id.")]
TextColumnOpt = Annotated[Optional[str], typer.Option("--text-column", help="Column of --dataset to read (default: text, else messages; conversations are rendered with the model's chat template).")]
SplitOpt = Annotated[Optional[str], typer.Option("--split", help="Split of --dataset to read (default: train for calibration, test or validation for optc eval).")]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", autocompletion=completing(lambda: ["auto", "bfloat16", "float16", "float32"]), help="Stored dtype of the tensors that are not quantized: float16, bfloat16, float32 or auto (default: the source's; bfloat16 for a GGUF source).")]
SamplesOpt = Annotated[Optional[int], typer.Option("--samples", help="Calibration samples.")]
SeqlenOpt = Annotated[Optional[int], typer.Option("--seqlen", help="Tokens per calibration sample.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed for sampling and any randomness.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, or auto.")]
EvalDatasetOpt = Annotated[Optional[str], typer.Option("--eval-dataset", help="Evaluation text (never used for calibration).")]
WindowsOpt = Annotated[Optional[int], typer.Option("--windows", help="Evaluate the first N windows only.")]
NoEvalOpt = Annotated[bool, typer.Option("--no-eval", help="Skip perplexity evaluation.", metavar=FLAG)]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the model repository.", metavar=FLAG)]
FormatOpt = Annotated[Optional[str], typer.Option("--format", help=f"Export format: {format_help()}.", autocompletion=completing(_format_names))]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the report as JSON.", metavar=FLAG)]
GateOpt = Annotated[Optional[list[str]], typer.Option("--gate", help="CI gate, e.g. 'ppl_increase<=5%' (repeatable); a failed gate exits with code 3 after the report is written.")]
TargetBpwOpt = Annotated[Optional[float], typer.Option("--target-bpw", help="Budget: average stored bits per decoder-Linear weight (scales included), e.g. 3.25; each Linear of the first quantize stage gets the candidate scheme that meets it with the least estimated error.")]
CandidatesOpt = Annotated[Optional[str], typer.Option("--candidates", help=f"Budget: the named set of candidate schemes, {' or '.join(CANDIDATE_SETS)} (default: symmetric; asymmetric mixes store zero points, are better at 3 bits, and transformers loads them only decoded module by module).", autocompletion=completing(lambda: list(CANDIDATE_SETS)))]
FusedOpt = Annotated[bool, typer.Option("--fused", help="Budget: one scheme for each layer's q/k/v_proj and for its gate/up_proj, which vLLM needs to load the mix (it fuses them); costs accuracy.", metavar=FLAG)]
TargetSizeOpt = Annotated[Optional[str], typer.Option("--target-size", help="Budget: size of the weight files, e.g. 80MiB or 2GB; chooses each Linear's scheme like --target-bpw.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars; print only errors and failed gates.", metavar=FLAG)]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run from the layers it saved beside --output (same checkpoint as an uninterrupted run).", metavar=FLAG)]
StreamingOpt = Annotated[bool, typer.Option("--streaming", help="Read one decoder layer at a time from the safetensors shards (models larger than memory; default: when the model does not fit).", metavar=FLAG)]


def _version(value: bool) -> None:
    if value:
        console.print(f"optc {optc.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.", metavar=FLAG)] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress details.", metavar=FLAG)] = False,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False)],
        force=True,
    )
    for noisy in ("transformers", "datasets", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    # transformers sets its logger's level again when it is first imported (after this), from this
    # variable: without it a model that fails to load prints a page of report before optc's line.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


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
        from optc.evaluate.report import json_safe

        console.print_json(json.dumps(json_safe(report), default=str, allow_nan=False))  # strict JSON: NaN is null
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
        console.print(f"wrote [bold]{ck['path']}[/] ({ck['format']}, {ck['bytes'] / 2**20:.1f} MiB): README.md (model card), report.json, report.md, recipe.yaml")
    _print_details(report)


def _print_details(report: dict) -> None:
    from optc.evaluate.report import summary_lines

    for line in summary_lines(report):
        if not line.startswith("Perplexity change:"):  # printed with the perplexity table
            console.print(line, highlight=False, markup=False)
    for g in report.get("gates", []):
        console.print(("[green]" if g["passed"] else "[bold red]") + g["message"] + "[/]", highlight=False)


def finish(report: dict, as_json: bool, quiet: bool) -> None:
    """Print the report (unless quiet), then exit with the non-finite code if the model computed
    NaN or infinite values, else with the gate code if a gate failed."""
    from optc.evaluate.gates import GATE_EXIT_CODE, NON_FINITE_EXIT_CODE, failed
    from optc.evaluate.report import non_finite_message

    if as_json or not quiet:
        _print_report(report, as_json)
    bad = failed(report.get("gates", []))
    if bad and (quiet or as_json):
        for g in bad:
            err_console.print(f"[bold red]{g['message']}[/]", highlight=False, soft_wrap=True)
    broken = report.get("metrics", {}).get("non_finite")
    if broken:
        err_console.print(f"[bold red]error:[/] {non_finite_message(broken, report)}", soft_wrap=True, highlight=False)
        raise typer.Exit(NON_FINITE_EXIT_CODE)
    if bad:
        raise typer.Exit(GATE_EXIT_CODE)


def common_overrides(model, dataset, samples, seqlen, seed, eval_dataset, windows, fmt, streaming: bool = False, *,
                     text_column: str | None = None, split: str | None = None, dtype: str | None = None) -> dict:
    return {
        "calibration.streaming": True if streaming else None,
        "model": model,
        "calibration.dataset": dataset,
        # --dataset replaces the recipe's calibration source, a mix included.
        "calibration.mix": [] if dataset is not None else None,
        "calibration.text_column": text_column,
        "calibration.split": split,
        "export.dtype": dtype,
        "calibration.samples": samples,
        "calibration.seqlen": seqlen,
        "calibration.seed": seed,
        "evaluation.dataset": eval_dataset,
        "evaluation.windows": windows,
        "export.format": fmt,
    }


def run_command(recipe_name: str, overrides: dict, output, overwrite, device, trust_remote_code, no_eval, as_json, stages: list | None = None, gates: list[str] | None = None, quiet: bool = False, resume: bool = False, no_save: bool = False, force_overwrite: bool = False) -> None:
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
    device = pick_device(device)
    check_save(recipe, output, no_save)
    main = is_main_process()  # under torchrun only rank 0 shows progress and prints the report
    report = run_recipe(recipe, output, overwrite=overwrite, force_overwrite=force_overwrite, device=device, trust_remote_code=trust_remote_code, progress=progress_bars(quiet or not main), gates=gates, resume=resume)
    if main:
        finish(report, as_json, quiet)


def check_save(recipe, output, no_save: bool) -> None:
    """A command that compresses writes its checkpoint to --output; without one it would compute
    for minutes or hours and keep nothing, so that takes --no-save, said on purpose."""
    if output is not None and no_save:
        raise OptcError("--output and --no-save exclude each other")
    if output is None and not no_save and recipe.stages:
        raise OptcError("no --output: the compressed checkpoint would be written nowhere; pass --output DIR "
                        "to save it, or --no-save to compress and measure without saving")


def progress_bars(quiet: bool):
    from optc.progress import NullProgress

    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its weight-loading bars too
        return NullProgress()
    return RichProgress()


def pick_device(device: str) -> str:
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
