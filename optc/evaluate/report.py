"""The accuracy report: ``report.json`` (versioned) and a readable ``report.md``."""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

import optc

REPORT_SCHEMA = 1


def environment() -> dict:
    import transformers

    return {
        "optc": optc.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }


def new_report(model: str, recipe: dict | None = None) -> dict:
    return {
        "schema_version": REPORT_SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "recipe": recipe,
        "environment": environment(),
        "stages": [],
        "metrics": {},
        "checkpoint": None,
    }


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ppl_row(label: str, r: dict) -> str:
    lo, hi = r["ci95"]
    return (
        f"| {label} | {_fmt(r['perplexity'])} | [{_fmt(lo)}, {_fmt(hi)}] | {r['windows']} x "
        f"{r['seqlen']} | {_fmt(r['seconds'], 1)} s |"
    )


def render_markdown(report: dict) -> str:
    lines = [f"# optc report: {report['model']}", ""]
    if report.get("recipe"):
        lines += [f"Recipe: `{report['recipe'].get('name', 'custom')}`", ""]
    metrics = report.get("metrics", {})
    ppl = {k: v for k, v in metrics.items() if k.startswith("perplexity_")}
    if ppl:
        lines += ["| model | perplexity | 95% CI | windows | time |", "|---|---|---|---|---|"]
        lines += [_ppl_row(k.removeprefix("perplexity_"), v) for k, v in ppl.items()]
        if "perplexity_baseline" in ppl and "perplexity_compressed" in ppl:
            b = ppl["perplexity_baseline"]["perplexity"]
            c = ppl["perplexity_compressed"]["perplexity"]
            lines += ["", f"Perplexity change: {100 * (c / b - 1):+.2f}%"]
        lines.append("")
    if report.get("stages"):
        lines += ["| stage | seconds | summary |", "|---|---|---|"]
        for st in report["stages"]:
            lines.append(f"| {st['type']} | {_fmt(st['seconds'], 1)} | {st.get('summary', '')} |")
        lines.append("")
    ck = report.get("checkpoint")
    if ck:
        lines += [
            f"Checkpoint: `{ck['path']}` ({ck['format']}), {ck['bytes'] / 2**20:.1f} MiB on disk.",
            "",
        ]
    return "\n".join(lines)


def write_report(report: dict, directory: Path) -> None:
    directory = Path(directory)
    (directory / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (directory / "report.md").write_text(render_markdown(report) + "\n")
