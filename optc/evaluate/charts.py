"""PNG charts for ``report.md``: per-layer weight error and perplexity before/after.

matplotlib is optional (``pip install optc[charts]``); without it the report is written
without charts and says nothing is missing beyond them.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never a display
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _layer_index(name: str) -> int | None:
    m = re.search(r"\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def layer_error_chart(layers: list[dict], path: Path) -> bool:
    """Relative weight error per decoder layer, one line per Linear kind (q_proj, ...)."""
    plt = _pyplot()
    rows = [r for r in layers if r.get("rel_error") is not None and _layer_index(r["name"]) is not None]
    if plt is None or not rows:
        return False
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        series.setdefault(r["name"].rsplit(".", 1)[-1], []).append((_layer_index(r["name"]), r["rel_error"]))
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    for kind, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=kind)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("relative weight error ||W - W0|| / ||W0||")
    ax.set_title("Per-layer weight error")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def perplexity_chart(metrics: dict, path: Path) -> bool:
    """Perplexity of each evaluated model with its 95% interval."""
    plt = _pyplot()
    bars = [(k.removeprefix("perplexity_"), v) for k, v in metrics.items()
            if k.startswith("perplexity_") and isinstance(v, dict) and "ci95" in v]
    if plt is None or not bars:
        return False
    fig, ax = plt.subplots(figsize=(5, 4), dpi=100)
    names = [b[0] for b in bars]
    values = [b[1]["perplexity"] for b in bars]
    lo = [v - (b[1]["ci95"][0] if b[1]["ci95"][0] is not None else v) for v, b in zip(values, bars)]
    hi = [(b[1]["ci95"][1] if b[1]["ci95"][1] is not None else v) - v for v, b in zip(values, bars)]
    ax.bar(names, values, yerr=[lo, hi], capsize=6, color=["#7a9cc6", "#d98b5f", "#8fbf7f"][: len(bars)])
    for i, v in enumerate(values):
        ax.annotate(f"{v:.2f}", (i, v), textcoords="offset points", xytext=(12, 4), fontsize=9)
    ax.set_ylabel("perplexity (95% CI)")
    ax.set_title("Perplexity before / after")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_charts(report: dict, directory: Path) -> list[str]:
    """Write the charts that apply to ``report`` into ``directory``; their file names."""
    directory = Path(directory)
    written = []
    if perplexity_chart(report.get("metrics", {}), directory / "perplexity.png"):
        written.append("perplexity.png")
    if layer_error_chart(report.get("layers") or [], directory / "layer_error.png"):
        written.append("layer_error.png")
    if not written and _pyplot() is None:
        log.info("matplotlib is not installed: report.md has no charts (pip install matplotlib)")
    return written
