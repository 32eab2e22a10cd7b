"""Commands that measure, convert and describe: ``eval``, ``report``, ``inspect``, ``export``,
``imatrix``, ``recipes``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from optc.cli.app import (
    FLAG, LATENCY, PROTOCOL, DeviceOpt, ForceOverwriteOpt, GateOpt, SplitOpt, TextColumnOpt, JsonOpt, OutputOpt,
    OverwriteOpt, QuietOpt, app, console, finish, handle_errors, pick_device, progress_bars, recipes_app,
)
from optc.errors import OptcError
from optc.evaluate.protocol import KERNEL_CHOICES, EvalProtocol, LatencyOptions
from optc.export.formats import format_help


@app.command("eval")
@handle_errors
def eval_(
    model: Annotated[Optional[str], typer.Argument(help="Checkpoint directory, hub id, .gguf file, or built-in name.")] = None,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="Compare against this model.")] = None,
    dataset: Annotated[str, typer.Option("--dataset", help="Evaluation text: builtin, wikitext2, c4, or a path.")] = PROTOCOL.dataset,
    split: SplitOpt = None, text_column: TextColumnOpt = None,
    seqlen: Annotated[int, typer.Option("--seqlen", help="Tokens per window.")] = PROTOCOL.seqlen,
    windows: Annotated[Optional[int], typer.Option("--windows", help=f"Evaluate the first N windows (default {PROTOCOL.windows}, as recipes do; --all-windows for the whole text).")] = None,
    all_windows: Annotated[bool, typer.Option("--all-windows", help="Evaluate every window of the text.", metavar=FLAG)] = False,
    stride: Annotated[Optional[int], typer.Option("--stride", help="Sliding-window stride (default: seqlen).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Windows per forward.")] = PROTOCOL.batch_size,
    output: OutputOpt = None, overwrite: OverwriteOpt = False, force_overwrite: ForceOverwriteOpt = False,
    as_json: JsonOpt = False, gate: GateOpt = None, quiet: QuietOpt = False,
    latency: Annotated[bool, typer.Option("--latency", help="Time prefill and decode (batch 1, CPU) on low-precision kernels; against --baseline too.", metavar=FLAG)] = False,
    kernel: Annotated[str, typer.Option("--kernel", help=f"Latency kernels: {', '.join(KERNEL_CHOICES)}.")] = LATENCY.kernel,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Latency: prompt length.")] = LATENCY.prompt_tokens,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Latency: tokens decoded per run.")] = LATENCY.new_tokens,
    repeats: Annotated[int, typer.Option("--repeats", help="Latency: timed runs per model.")] = LATENCY.repeats,
    threads: Annotated[Optional[int], typer.Option("--threads", help="Latency: torch threads (default: torch's).")] = None,
    tasks: Annotated[Optional[str], typer.Option("--tasks", help="lm-eval-harness tasks, comma-separated (needs lm-eval and its data).")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Tokenize the evaluation text again instead of using the disk cache.", metavar=FLAG)] = False,
    device: DeviceOpt = "cpu",
    streaming: Annotated[bool, typer.Option("--streaming", help="Layer-major evaluation, one decoder layer in memory at a time (perplexity and size; models larger than memory).", metavar=FLAG)] = False,
) -> None:
    """Perplexity with a 95% interval, KL and top-1 agreement against --baseline, size, latency; gates for CI."""
    from optc.run.pipeline import evaluate_model

    if all_windows and windows is not None:
        raise OptcError("--windows and --all-windows exclude each other")
    protocol = EvalProtocol(dataset=dataset, split=split, text_column=text_column, seqlen=seqlen, stride=stride, batch_size=batch_size,
                            windows=None if all_windows else (windows or PROTOCOL.windows))
    timing = LatencyOptions(kernel=kernel, prompt_tokens=prompt_tokens, new_tokens=new_tokens, repeats=repeats, threads=threads)
    task_list = [t.strip() for t in tasks.split(",") if t.strip()] if tasks else None
    report = evaluate_model(
        model, protocol, baseline=baseline, output=output, overwrite=overwrite, progress=progress_bars(quiet),
        gates=gate, latency=timing if latency else None, tasks=task_list, cache=not no_cache, streaming=streaming,
        device=pick_device(device),
        force_overwrite=force_overwrite,
    )
    finish(report, as_json, quiet)


@app.command("report")
@handle_errors
def report_(
    reports: Annotated[Optional[list[str]], typer.Argument(help="report.json files or directories holding one (any optc command's).")] = None,
    markdown: Annotated[Optional[Path], typer.Option("--markdown", help="Also write the comparison table to this Markdown file.")] = None,
    schema: Annotated[bool, typer.Option("--schema", help="Print the JSON Schema of report.json and exit.", metavar=FLAG)] = False,
    card: Annotated[bool, typer.Option("--card", help="Regenerate the model card (README.md) of each checkpoint directory given, from its report.json and recipe.yaml.", metavar=FLAG)] = False,
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
    if card:
        from optc.run.card import write_model_card

        for name in reports:
            path = Path(name).expanduser()
            written = write_model_card(path.parent if path.is_file() else path)
            console.print(f"wrote [bold]{written}[/]")
        return
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
    fmt: Annotated[str, typer.Option("--format", help=f"Target format. {format_help(descriptions=True)}.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output directory (written atomically).")],
    overwrite: OverwriteOpt = False,
    force_overwrite: ForceOverwriteOpt = False,
    requantize: Annotated[bool, typer.Option("--requantize", help="GGUF: round grids the block type cannot hold again (lossy).", metavar=FLAG)] = False,
    imatrix: Annotated[Optional[Path], typer.Option("--imatrix", help="GGUF: llama.cpp importance matrix (llama-imatrix's GGUF file) weighing the rounding of every tensor the export quantizes itself.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Convert a checkpoint to another format, re-packing its quantization grid (no calibration)."""
    from optc.export.convert import convert_checkpoint

    info = convert_checkpoint(model, output, fmt, overwrite=overwrite, requantize=requantize, force=force_overwrite,
                              imatrix=imatrix)
    if as_json:
        console.print_json(json.dumps(info, default=str))
        return
    console.print(f"wrote [bold]{info['path']}[/] ({info['format']}, {info['bytes'] / 2**20:.1f} MiB) from {info['source']}")
    for key in ("scheme", "modules", "types"):
        if key in info:
            console.print(f"{key}: {info[key]}")
    for key, what in (("requantized", "grid re-quantized"), ("rounded", "float weights quantized")):
        if info.get(key):
            console.print(f"[yellow]{what}[/]: {len(info[key])} module(s)")
    by_change: dict[str, list[str]] = {}
    for name, change in (info.get("fallbacks") or {}).items():
        by_change.setdefault(change, []).append(name)
    for change, names in by_change.items():  # every name: --json
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        console.print(f"[yellow]fallback {change}[/] (rows not whole super-blocks): {shown}")


@app.command()
@handle_errors
def imatrix(
    model: Annotated[Optional[str], typer.Argument(help="Checkpoint directory, hub id, .gguf file, or built-in name (default: the built-in model).")] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="imatrix file to write (llama.cpp's GGUF imatrix).")] = Path("imatrix.gguf"),
    dataset: Annotated[str, typer.Option("--dataset", help="Calibration text: builtin, a path, or a hub dataset.")] = "builtin",
    samples: Annotated[int, typer.Option("--samples", help="Sequences of calibration text.")] = 128,
    seqlen: Annotated[int, typer.Option("--seqlen", help="Tokens per sequence.")] = 512,
    overwrite: OverwriteOpt = False, device: DeviceOpt = "cpu", as_json: JsonOpt = False, quiet: QuietOpt = False,
) -> None:
    """Importance matrix for llama.cpp: each decoder Linear's mean squared input per column on
    calibration text (what llama-imatrix writes; llama-quantize --imatrix and optc export --imatrix read it)."""
    from optc.data import CalibrationConfig
    from optc.model.load import DEFAULT_MODEL
    from optc.run.imatrix import model_imatrix

    info = model_imatrix(model or DEFAULT_MODEL, output, CalibrationConfig(dataset=dataset, samples=samples, seqlen=seqlen),
                         overwrite=overwrite, device=pick_device(device), progress=progress_bars(quiet))
    if as_json:
        console.print_json(json.dumps(info, default=str))
        return
    console.print(f"wrote [bold]{info['path']}[/]: {info['entries']} tensors, {info['chunks']} chunks of "
                  f"{info['chunk_size']} tokens, from {info['model']}")


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
    from optc.recipe import read_recipe_text, resolve_recipe

    typer.echo(read_recipe_text(resolve_recipe(name)), nl=False)  # verbatim: never wrapped


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
