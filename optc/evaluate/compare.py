"""``optc report A B C``: runs side by side, one column per report, one row per metric."""

from __future__ import annotations

from pathlib import Path

from optc.evaluate.gates import gate_values
from optc.evaluate.report import load_report


def _label(report: dict, source: str) -> str:
    ck = report.get("checkpoint") or {}
    recipe = (report.get("recipe") or {}).get("name")
    name = Path(ck.get("path") or source).name or source
    return f"{name} ({recipe})" if recipe and recipe not in name else name


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def comparison_rows(reports: list[dict]) -> list[tuple[str, list[str]]]:
    """``[(metric, [value per report])]``; rows no report measured are left out."""
    rows: list[tuple[str, list[str]]] = []

    def add(name: str, cells: list[str]) -> None:
        if any(c != "-" for c in cells):
            rows.append((name, cells))

    def metric(r: dict, *keys: str):
        d = r.get("metrics", {})
        for k in keys:
            d = d.get(k) if isinstance(d, dict) else None
        return d

    def ppl(r: dict) -> dict | None:
        return metric(r, "perplexity_compressed") or metric(r, "perplexity_model")

    values = [gate_values(r) for r in reports]
    add("command", [r.get("command", "-") for r in reports])
    add("model", [str(r.get("model", "-")) for r in reports])
    add("format", [(r.get("checkpoint") or {}).get("format", "-") for r in reports])
    add("perplexity", [_num((ppl(r) or {}).get("perplexity"), ".3f") for r in reports])
    add("95% CI", ["-" if not ppl(r) or ppl(r)["ci95"][0] is None else
                   f"[{ppl(r)['ci95'][0]:.2f}, {ppl(r)['ci95'][1]:.2f}]" for r in reports])
    add("windows", ["-" if not ppl(r) else f"{ppl(r)['windows']} x {ppl(r)['seqlen']}" for r in reports])
    add("baseline perplexity", [_num(metric(r, "perplexity_baseline", "perplexity"), ".3f") for r in reports])
    add("perplexity change", [_num(v["ppl_increase"], "+.2f") + ("%" if v["ppl_increase"] is not None else "") for v in values])
    ci = [metric(r, "perplexity_change", "ppl_increase_pct_ci95") for r in reports]
    add("change 95% CI", ["-" if not c or c[0] is None else f"[{c[0]:+.2f}%, {c[1]:+.2f}%]" for c in ci])
    add("KL mean (nats)", [_num(v["kl_mean"], ".4f") for v in values])
    add("KL max (nats)", [_num(v["kl_max"], ".3f") for v in values])
    add("top-1 agreement", [_num(None if v["top1_agreement"] is None else 100 * v["top1_agreement"], ".2f") + ("%" if v["top1_agreement"] is not None else "") for v in values])
    params = [metric(r, "size", "parameters") or metric(r, "parameters") for r in reports]
    add("parameters", [_num(p, ",") for p in params])
    nonzero = [metric(r, "size", "nonzero") or metric(r, "nonzero") for r in reports]
    add("non-zero", [_num(p, ",") for p in nonzero])
    add("sparsity (Linears)", [_num(v["sparsity"], ".3f") for v in values])
    add("bits / weight", [_num(v["bits_per_weight"], ".2f") for v in values])
    add("bits / Linear weight", [_num(metric(r, "size", "linear_bits_per_weight"), ".2f") for r in reports])
    add("vs float16", [_num(v["compression_ratio"], ".2f") + ("x" if v["compression_ratio"] is not None else "") for v in values])
    disk = [metric(r, "size", "bytes_on_disk") or metric(r, "bytes_on_disk") or (r.get("checkpoint") or {}).get("bytes") for r in reports]
    add("size (MiB)", [_num(None if d is None else d / 2**20, ".1f") for d in disk])
    add("decode tok/s", [_num(v["decode_tokens_per_s"], ".1f") for v in values])
    add("decode p95 (ms)", [_num(metric(r, "latency", "model", "decode", "p95_ms"), ".1f") for r in reports])
    add("decode speedup", [_num(v["decode_speedup"], ".2f") + ("x" if v["decode_speedup"] is not None else "") for v in values])
    add("kernel", [metric(r, "latency", "model", "kernel") or "-" for r in reports])
    add("stages", [" -> ".join(s["type"] for s in r.get("stages", [])) or "-" for r in reports])
    add("gates", ["-" if not r.get("gates") else
                  ("pass" if all(g["passed"] for g in r["gates"]) else
                   "FAIL: " + ", ".join(g["gate"] for g in r["gates"] if not g["passed"])) for r in reports])
    return rows


def load_reports(paths: list[str]) -> tuple[list[str], list[dict]]:
    reports = [load_report(p) for p in paths]
    labels = [_label(r, p) for r, p in zip(reports, paths)]
    return labels, reports


def comparison_markdown(labels: list[str], rows: list[tuple[str, list[str]]]) -> str:
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = ["| metric | " + " | ".join(esc(x) for x in labels) + " |",
             "|---|" + "---|" * len(labels)]
    lines += [f"| {name} | " + " | ".join(esc(c) for c in cells) + " |" for name, cells in rows]
    return "\n".join(lines) + "\n"
