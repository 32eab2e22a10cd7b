"""The accuracy report: ``report.json`` (versioned, validated) and a readable ``report.md``.

``report.json`` is what CI reads. Schema version 2 holds: the model and baseline, the recipe,
the environment, ``metrics`` (perplexity with intervals, the paired change, KL divergence,
size, latency), ``layers`` (per-Linear scheme, weight error and sparsity), ``stages``,
``timings`` (seconds per step), ``gates`` (each gate's outcome) and the checkpoint. The
pydantic models below are the schema (:func:`report_json_schema` exports it as JSON Schema);
known sections are strict, and the top level and ``metrics`` accept additional keys so
that other commands can add sections without breaking readers. Version 1 reports (optc
0.1.0) are read by filling in the sections they lack.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import optc
from optc.errors import OptcError

log = logging.getLogger(__name__)

REPORT_SCHEMA = 2

# --- schema -------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# A measured number; null in report.json where the run produced NaN or an infinity (JSON has
# neither), which ``metrics.non_finite`` then names.
Measured = float | None
NonNegative = Annotated[float, Field(ge=0)] | None


class PerplexitySection(_Strict):
    perplexity: Measured
    nll: Measured
    ci95: tuple[float | None, float | None]
    windows: int
    tokens: int
    seqlen: int
    stride: int
    seconds: float
    window_nll: list[Measured]
    non_finite_logits: int = 0  # present only when some were
    first_non_finite: str | None = None


class ChangeSection(_Strict):
    ppl_baseline: Measured
    ppl_model: Measured
    ppl_difference: Measured
    ppl_increase_pct: Measured
    ppl_increase_pct_ci95: tuple[float | None, float | None]
    nll_difference: Measured
    significant: bool
    windows: int


class NonFiniteSection(_Strict):
    """What was not finite in a run: a model that computes NaN is an error of its own."""

    logits: int  # NaN or infinite logits over the evaluation windows
    first_module: str | None  # the first module whose output was not finite
    metrics: list[str]  # the metrics (dotted names under ``metrics``) that are not finite


class DivergenceSection(_Strict):
    kl_mean: NonNegative
    kl_max: NonNegative
    kl_p99: NonNegative
    kl_ci95: tuple[float | None, float | None]
    top1_agreement: float = Field(ge=0, le=1)
    tokens: int
    windows: int


class SizeSection(_Strict):
    bytes_on_disk: int | None  # the whole checkpoint directory (or file)
    weight_bytes: int | None  # tensor data in its weight files
    parameters: int
    nonzero: int
    sparsity: float | None  # zeros in decoder Linears
    bits_per_weight: float | None  # 8 * weight_bytes / parameters
    linear_bits_per_weight: float | None  # the same over decoder Linears (codes + scales)
    compression_ratio: float | None  # float16 bytes / weight_bytes
    dtype: str | None = None  # the dtype unquantized tensors were stored in (export.dtype)


class LatencyRun(_Strict):
    kernel: str
    kernels: dict[str, int]
    prompt_tokens: int
    new_tokens: int
    repeats: int
    threads: int
    prefill: dict[str, float]
    decode: dict[str, float]
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    weights_mb: float
    peak_rss_mb: float | None
    peak_above_start_mb: float | None


class LatencySection(_Strict):
    model: LatencyRun
    baseline: LatencyRun | None = None
    decode_speedup: float | None = None
    prefill_speedup: float | None = None
    fallbacks: dict[str, str] = Field(default_factory=dict)


class Metrics(BaseModel):
    model_config = ConfigDict(extra="allow")

    perplexity_model: PerplexitySection | None = None
    perplexity_baseline: PerplexitySection | None = None
    perplexity_compressed: PerplexitySection | None = None
    perplexity_change: ChangeSection | None = None
    divergence: DivergenceSection | None = None
    size: SizeSection | None = None
    latency: LatencySection | None = None
    tasks: dict[str, Any] | None = None
    non_finite: NonFiniteSection | None = None
    parameters: int | None = None
    nonzero: int | None = None
    bytes_on_disk: int | None = None


class LayerRow(_Strict):
    name: str
    shape: tuple[int, int]
    scheme: str | None  # e.g. int4-sym-g64; None: float
    rel_error: float | None  # ||W_hat - W|| / ||W|| against the original weights
    sparsity: float


class StageRow(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    seconds: float
    summary: str = ""
    stats: dict[str, Any] = Field(default_factory=dict)


class GateRow(_Strict):
    gate: str
    metric: str
    op: str
    threshold: float
    value: float | None
    passed: bool
    message: str


class CheckpointRow(BaseModel):
    model_config = ConfigDict(extra="allow")

    path: str
    format: str
    bytes: int


class Report(BaseModel):
    model_config = ConfigDict(extra="allow")

    schema_version: int
    command: str = "run"
    created: str
    model: str
    baseline: str | None = None
    recipe: dict[str, Any] | None = None
    environment: dict[str, Any]
    stages: list[StageRow] = Field(default_factory=list)
    metrics: Metrics
    layers: list[LayerRow] = Field(default_factory=list)
    timings: dict[str, float] = Field(default_factory=dict)
    gates: list[GateRow] = Field(default_factory=list)
    checkpoint: CheckpointRow | None = None
    charts: list[str] = Field(default_factory=list)


def report_json_schema() -> dict:
    """The JSON Schema of ``report.json`` (schema version :data:`REPORT_SCHEMA`)."""
    schema = Report.model_json_schema()
    schema["title"] = f"optc report, schema version {REPORT_SCHEMA}"
    return schema


def validate_report(data: Any, source: str = "report") -> dict:
    """Check ``data`` against the schema; returns it upgraded to the current version."""
    if not isinstance(data, dict):
        raise OptcError(f"{source}: not an optc report (expected a JSON object)")
    version = data.get("schema_version")
    if not isinstance(version, int):
        raise OptcError(f"{source}: not an optc report (no schema_version)")
    if version > REPORT_SCHEMA:
        raise OptcError(f"{source}: schema_version {version} is newer than this optc reads ({REPORT_SCHEMA}); upgrade optc")
    if version < 1:
        raise OptcError(f"{source}: unknown schema_version {version}")
    data = dict(data)
    if version == 1:
        # Version 1 had no layers, timings, gates or charts, and no command name.
        data.setdefault("command", "run" if data.get("recipe") else "eval")
        data["schema_version"] = REPORT_SCHEMA
    try:
        Report.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise OptcError(f"{source}: does not match the report schema: {problems}") from None
    return data


def load_report(path: Path | str) -> dict:
    """A validated report from ``report.json`` or a directory holding one."""
    path = Path(path).expanduser()
    file = path / "report.json" if path.is_dir() else path
    if not file.is_file():
        raise OptcError(f"no report at {path} (expected report.json or a directory holding one)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OptcError(f"{file}: not valid JSON ({exc})") from None
    return validate_report(data, str(file))


# --- building -----------------------------------------------------------------------------


def environment() -> dict:
    import transformers

    return {
        "optc": optc.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": platform.processor() or None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def new_report(model: str, recipe: dict | None = None, command: str = "run") -> dict:
    return {
        "schema_version": REPORT_SCHEMA,
        "command": command,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "baseline": None,
        "recipe": recipe,
        "environment": environment(),
        "stages": [],
        "metrics": {},
        "layers": [],
        "timings": {},
        "gates": [],
        "checkpoint": None,
        "charts": [],
    }


def layer_statistics(
    model: torch.nn.Module,
    schemes: dict[str, str] | None = None,
    errors: dict[str, float] | None = None,
    reference: torch.nn.Module | None = None,
) -> list[dict]:
    """Per decoder-Linear rows: shape, scheme, relative weight error, sparsity.

    ``errors`` come from the stages that quantized (measured against the weights they saw);
    without them, a ``reference`` model (the baseline) gives ``||W - W_ref|| / ||W_ref||``.
    """
    from optc.model.anatomy import select_linears, weight_2d

    schemes, errors = schemes or {}, errors or {}
    try:
        linears = select_linears(model, [".*"], [])
        ref_linears = select_linears(reference, [".*"], []) if reference is not None else {}
    except OptcError as exc:  # an architecture without recognisable decoder layers
        log.info("no per-layer statistics: %s", exc)
        return []
    rows = []
    for name, module in linears.items():
        w = weight_2d(module).detach()
        err = errors.get(name)
        if err is None and name in ref_linears:
            ref = weight_2d(ref_linears[name]).detach().float()
            if ref.shape == w.shape:
                err = float((w.float() - ref).norm() / ref.norm().clamp_min(1e-12))
        rows.append({
            "name": name, "shape": tuple(w.shape), "scheme": schemes.get(name),
            "rel_error": None if err is None else round(err, 6),
            "sparsity": round(float((w == 0).float().mean()), 6),
        })
    return rows


def stage_layer_info(stages: list[dict]) -> tuple[dict[str, str], dict[str, float]]:
    """Schemes and relative errors per Linear from the stages' stats (last stage wins)."""
    schemes, errors = {}, {}
    for st in stages:
        for name, m in (st.get("stats") or {}).get("modules", {}).items():
            if "scheme" in m:
                schemes[name] = m["scheme"]
            if "rel_error" in m:
                errors[name] = m["rel_error"]
    return schemes, errors


# --- rendering ----------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ppl_row(label: str, r: dict) -> str:
    lo, hi = r["ci95"]
    return (
        f"| {label} | {_fmt(r['perplexity'])} | [{_fmt(lo)}, {_fmt(hi)}] | {r['windows']} x "
        f"{r['seqlen']} | {_fmt(r['seconds'], 1)} s |"
    )


def summary_lines(report: dict) -> list[str]:
    """The headline numbers as Markdown bullet lines (shared by report.md and the CLI)."""
    m = report.get("metrics", {})
    out = []
    ch = m.get("perplexity_change")
    if ch:
        lo, hi = ch["ppl_increase_pct_ci95"]
        ci = f" (paired 95% CI [{lo:+.2f}%, {hi:+.2f}%])" if lo is not None else ""
        verdict = "a real change" if ch["significant"] else "within noise"
        out.append(f"Perplexity change: {ch['ppl_increase_pct']:+.2f}%{ci}: {verdict}")
    elif m.get("perplexity_baseline") and m.get("perplexity_compressed"):
        b, c = m["perplexity_baseline"]["perplexity"], m["perplexity_compressed"]["perplexity"]
        out.append(f"Perplexity change: {100 * (c / b - 1):+.2f}%")
    dv = m.get("divergence")
    if dv:
        out.append(
            f"KL divergence from the baseline: mean {dv['kl_mean']:.4f}, p99 {dv['kl_p99']:.4f}, "
            f"max {dv['kl_max']:.4g} nats; top-1 agreement {100 * dv['top1_agreement']:.2f}% "
            f"over {dv['tokens']:,} tokens"
        )
    sz = m.get("size")
    if sz:
        parts = [f"{sz['parameters']:,} parameters ({sz['nonzero']:,} non-zero)"]
        if sz.get("bits_per_weight") is not None:
            parts.append(f"{sz['bits_per_weight']:.2f} bits/weight")
        if sz.get("linear_bits_per_weight") is not None:
            parts.append(f"{sz['linear_bits_per_weight']:.2f} in decoder Linears")
        if sz.get("compression_ratio") is not None:
            parts.append(f"compression {sz['compression_ratio']:.2f}x vs float16")
        if sz.get("bytes_on_disk") is not None:
            parts.append(f"{sz['bytes_on_disk'] / 2**20:.1f} MiB on disk")
        if sz.get("dtype"):
            parts.append(f"unquantized tensors in {sz['dtype']}")
        out.append("Size: " + ", ".join(parts))
    lat = m.get("latency")
    if lat:
        for who in ("baseline", "model"):
            r = lat.get(who)
            if r:
                out.append(
                    f"Latency ({who}): decode {r['decode_tokens_per_s']:.1f} tok/s "
                    f"(p50/p95/p99 {r['decode']['p50_ms']:.1f}/{r['decode']['p95_ms']:.1f}/"
                    f"{r['decode']['p99_ms']:.1f} ms), prefill {r['prompt_tokens']} tokens "
                    f"{r['prefill']['p50_ms']:.0f} ms p50; kernel: {r['kernel']}"
                )
        if lat.get("decode_speedup") is not None:
            out.append(f"Decode speedup over the baseline: {lat['decode_speedup']:.2f}x "
                       f"(prefill {lat['prefill_speedup']:.2f}x)")
    return out


def _budget_table(stage: dict) -> list[str]:
    """A budget stage's chosen schemes: a row per decoder layer, a column per Linear of the layer."""
    stats = stage.get("stats") or {}
    if "budget" not in stats or not stats.get("modules"):
        return []
    layers: dict[str, dict[str, str]] = {}
    columns: list[str] = []
    for name, m in stats["modules"].items():
        match = re.match(r"(.*?\.\d+)\.(.+)$", name)
        layer, linear = match.groups() if match else ("", name)
        layers.setdefault(layer, {})[linear] = m.get("scheme", "")
        if linear not in columns:
            columns.append(linear)
    short = [c.rsplit(".", 1)[-1] for c in columns]
    lines = [f"Schemes chosen by the budget ({stage['type']}):", "",
             "| layer | " + " | ".join(short) + " |", "|---" * (len(columns) + 1) + "|"]
    for layer, row in layers.items():
        lines.append(f"| {layer.rsplit('.', 1)[-1]} | " + " | ".join(row.get(c, "float") for c in columns) + " |")
    return lines + [""]


def _calibration_table(stage: dict) -> list[str]:
    """Per-Linear activation calibration of a W8A8 stage: which layers lose most."""
    rows = {n: m for n, m in stage.get("stats", {}).get("modules", {}).items() if "input_sqnr_db" in m}
    if not rows:
        return []
    lines = [
        f"Activation calibration ({stage['type']}): threshold = clipping range chosen, clip ratio = "
        "threshold / max |x|, SQNR measured on calibration rows.",
        "",
        "| layer | activations | max abs | threshold | clip ratio | clipped | input SQNR (dB) | output SQNR (dB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in rows.items():
        clipped = "-" if m.get("clipped") is None else f"{100 * m['clipped']:.4f}%"
        lines.append(
            f"| {name} | {m['activations']} | {_fmt(m['absmax'])} | {_fmt(m.get('threshold'))} | "
            f"{_fmt(m.get('clip_ratio'))} | {clipped} | {_fmt(m['input_sqnr_db'], 1)} | "
            f"{_fmt(m['output_sqnr_db'], 1)} |"
        )
    return lines + [""]


def render_markdown(report: dict) -> str:
    lines = [f"# optc report: {report['model']}", ""]
    if report.get("baseline"):
        lines += [f"Baseline: `{report['baseline']}`", ""]
    if report.get("recipe"):
        lines += [f"Recipe: `{report['recipe'].get('name', 'custom')}`", ""]
    metrics = report.get("metrics", {})
    ppl = {k: v for k, v in metrics.items() if k.startswith("perplexity_") and isinstance(v, dict) and "ci95" in v}
    if ppl:
        lines += ["| model | perplexity | 95% CI | windows | time |", "|---|---|---|---|---|"]
        lines += [_ppl_row(k.removeprefix("perplexity_"), v) for k, v in ppl.items()]
        lines.append("")
    head = summary_lines(report)
    if head:
        lines += [f"- {h}" for h in head] + [""]
    if report.get("gates"):
        lines += ["| gate | value | result |", "|---|---|---|"]
        for g in report["gates"]:
            value = "not measured" if g["value"] is None else f"{g['value']:.4g}"
            lines.append(f"| `{g['gate']}` | {value} | {'pass' if g['passed'] else '**FAIL**'} |")
        lines.append("")
    if report.get("stages"):
        lines += ["| stage | seconds | summary |", "|---|---|---|"]
        for st in report["stages"]:
            lines.append(f"| {st['type']} | {_fmt(st['seconds'], 1)} | {st.get('summary', '')} |")
        lines.append("")
        for st in report["stages"]:
            lines += _calibration_table(st)
            lines += _budget_table(st)
    if report.get("timings"):
        lines += ["Timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in report["timings"].items()), ""]
    for chart in report.get("charts", []):
        lines += [f"![{Path(chart).stem}]({chart})", ""]
    layers = report.get("layers") or []
    if layers:
        worst = sorted((r for r in layers if r.get("rel_error") is not None), key=lambda r: -r["rel_error"])[:10]
        if worst:
            lines += ["Largest relative weight errors:", "", "| Linear | scheme | rel. error | sparsity |", "|---|---|---|---|"]
            lines += [f"| {r['name']} | {r['scheme'] or 'float'} | {r['rel_error']:.4f} | {r['sparsity']:.3f} |" for r in worst]
            lines.append("")
    ck = report.get("checkpoint")
    if ck:
        lines += [f"Checkpoint: `{ck['path']}` ({ck['format']}), {ck['bytes'] / 2**20:.1f} MiB on disk.", ""]
    env = report.get("environment", {})
    lines.append(
        f"optc {env.get('optc')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
        f"{env.get('threads')} threads, schema {report.get('schema_version')}, {report.get('created')}."
    )
    return "\n".join(lines)


def json_safe(value: Any) -> Any:
    """``value`` with every NaN and infinity replaced by None, so that it is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _non_finite_paths(value: Any, path: str = "") -> list[str]:
    if isinstance(value, float):
        return [] if math.isfinite(value) else [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() if k != "non_finite" for p in _non_finite_paths(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list | tuple):
        return [path] if any(_non_finite_paths(v, path) for v in value) else []  # one name per list
    return []


def record_non_finite(report: dict) -> dict | None:
    """Record in ``metrics.non_finite`` which metrics are NaN or infinite and how many logits were
    (with the first module that produced them); None when everything is finite. Gates read it:
    with it every gate fails, and the command exits with :data:`optc.evaluate.gates.NON_FINITE_EXIT_CODE`."""
    metrics = report.get("metrics", {})
    names = _non_finite_paths(metrics)
    logits, first = 0, None
    for key in ("perplexity_compressed", "perplexity_model", "perplexity_baseline"):
        section = metrics.get(key)
        if isinstance(section, dict) and section.get("non_finite_logits"):
            logits += section["non_finite_logits"]
            where = section.get("first_non_finite")
            if first is None and where:
                first = f"{where} (baseline)" if key == "perplexity_baseline" else where
    if not names and not logits:
        metrics.pop("non_finite", None)
        return None
    metrics["non_finite"] = {"logits": logits, "first_module": first, "metrics": names}
    return metrics["non_finite"]


def non_finite_message(non_finite: dict, report: dict | None = None) -> str:
    """The one line a run whose model computed NaN or infinite values ends with."""
    parts = []
    if non_finite.get("logits"):
        first = non_finite.get("first_module")
        parts.append(f"{non_finite['logits']:,} non-finite logits (NaN or infinite)"
                     + (f", first produced by {first}" if first else ""))
    if non_finite.get("metrics"):
        parts.append(f"not finite: {', '.join(non_finite['metrics'])}")
    ck = (report or {}).get("checkpoint") or {}
    written = f"; the report (in {ck['path']}) records it" if ck.get("path") else ""
    return f"the model computed {'; '.join(parts) or 'non-finite values'}: every gate failed{written}"


def write_report(report: dict, directory: Path) -> None:
    """``report.json``, ``report.md`` and, where matplotlib is installed, the PNG charts.
    report.json is strict JSON: a NaN or infinite metric is written as null."""
    from optc.evaluate.charts import write_charts

    directory = Path(directory)
    report["charts"] = write_charts(report, directory)
    data = json.loads(json.dumps(json_safe(report), default=str, allow_nan=False))
    validate_report(data, "report being written")
    (directory / "report.json").write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    (directory / "report.md").write_text(render_markdown(report) + "\n")
