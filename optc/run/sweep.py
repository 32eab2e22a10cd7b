"""A sweep: one recipe run at several bits-per-weight budgets and at uniform bit widths, with the
size-versus-perplexity trade-off (and its Pareto front) in one ``report.md``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from optc.errors import OptcError
from optc.methods import METHODS
from optc.progress import Progress
from optc.recipe import Recipe, parse_recipe
from optc.run.pipeline import run_recipe

log = logging.getLogger(__name__)


def _variants(recipe: Recipe, targets: list[float], uniform: list[int]) -> list[tuple[str, str, Recipe]]:
    """(label, kind, recipe) for each point: the first quantize stage with the budget or bits."""
    data = recipe.model_dump(mode="json")
    index = next((i for i, s in enumerate(recipe.stages) if METHODS[s.type].kind == "quantize"), None)
    if index is None:
        raise OptcError(f"recipe {recipe.name}: a sweep needs a quantize stage (its stages: "
                        f"{' -> '.join(s.type for s in recipe.stages) or 'none'})")
    out = []
    for t in targets:
        d = json.loads(json.dumps(data))
        stage = d["stages"][index]
        budget = dict(stage.get("budget") or {})
        budget.update(bits_per_weight=t, size=None)
        stage["budget"] = budget
        out.append((f"budget-{t:g}", "budget", parse_recipe(d, f"{recipe.name} at {t:g} bits per weight")))
    for b in uniform:
        d = json.loads(json.dumps(data))
        stage = d["stages"][index]
        stage["budget"] = None
        stage["scheme"]["bits"] = b
        out.append((f"uniform-int{b}", "uniform", parse_recipe(d, f"{recipe.name} at int{b}")))
    return out


def pareto(points: list[dict]) -> list[bool]:
    """Whether each point is on the front: no other point is at most as large and at most as
    perplexed, and better in one of the two."""
    def dominated(p: dict) -> bool:
        return any(q is not p and q["bytes"] <= p["bytes"] and q["perplexity"] <= p["perplexity"]
                   and (q["bytes"] < p["bytes"] or q["perplexity"] < p["perplexity"]) for q in points)
    return [not dominated(p) for p in points]


def _chart(points: list[dict], width: int = 60, height: int = 14) -> str:
    """A text scatter of perplexity over decoder-Linear bits per weight: B budget, U uniform."""
    xs = [p["bits_per_weight"] for p in points]
    ys = [p["perplexity"] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    grid = [[" "] * width for _ in range(height)]
    for p in points:
        c = round((p["bits_per_weight"] - x0) / ((x1 - x0) or 1) * (width - 1))
        r = round((y1 - p["perplexity"]) / ((y1 - y0) or 1) * (height - 1))
        grid[r][c] = "B" if p["kind"] == "budget" else "U"
    lines = [f"{y1:9.2f} |" + "".join(grid[0])]
    lines += ["          |" + "".join(row) for row in grid[1:-1]]
    lines.append(f"{y0:9.2f} |" + "".join(grid[-1]))
    lines.append("          +" + "-" * width)
    lines.append(f"           {x0:<.2f}{'bits per decoder-Linear weight':^{width - 10}}{x1:>.2f}")
    return "\n".join(lines)


def sweep_markdown(name: str, points: list[dict]) -> str:
    front = pareto(points)
    rows = ["| point | kind | bits / decoder-Linear weight | weights (MiB) | perplexity | KL (mean) | Pareto |",
            "|---|---|---|---|---|---|---|"]
    for p, on in sorted(zip(points, front), key=lambda t: t[0]["bytes"]):
        kl = "" if p.get("kl") is None else f"{p['kl']:.4f}"
        rows.append(f"| {p['label']} | {p['kind']} | {p['bits_per_weight']:.4f} | {p['bytes'] / 2**20:.2f} | "
                    f"{p['perplexity']:.3f} | {kl} | {'yes' if on else ''} |")
    return (f"# Sweep: {name}\n\nSize against perplexity: budgets (B) and uniform schemes (U).\n\n"
            + "\n".join(rows) + "\n\n```text\n" + _chart(points) + "\n```\n")


def run_sweep(recipe: Recipe, output: Path, targets: list[float], uniform: list[int], *, device: str = "cpu",
              overwrite: bool = False, trust_remote_code: bool = False, progress: Progress | None = None) -> dict:
    """Run ``recipe`` at each budget and uniform width into ``output/<point>`` and write
    ``output/report.md`` and ``output/sweep.json``; returns the points."""
    if recipe.evaluation is None:
        raise OptcError("a sweep compares perplexities: the recipe needs an evaluation (drop --no-eval)")
    if not targets and not uniform:
        raise OptcError("a sweep needs at least one --target-bpw or --uniform")
    variants = _variants(recipe, targets, uniform)  # every point validated before the first run
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    points = []
    for label, kind, variant in variants:
        log.info("sweep: %s", label)
        report = run_recipe(variant, output / label, overwrite=overwrite, device=device,
                            trust_remote_code=trust_remote_code, progress=progress)
        m = report["metrics"]
        points.append({
            "label": label, "kind": kind, "path": str(output / label),
            "bits_per_weight": m["size"]["linear_bits_per_weight"], "bytes": m["size"]["weight_bytes"],
            "perplexity": m["perplexity_compressed"]["perplexity"],
            "kl": (m.get("divergence") or {}).get("kl_mean"),
        })
    (output / "sweep.json").write_text(json.dumps(points, indent=1) + "\n", encoding="utf-8")
    (output / "report.md").write_text(sweep_markdown(recipe.name, points), encoding="utf-8")
    return {"points": points, "report": str(output / "report.md")}
