"""CI gates: ``ppl_increase<=5%``, ``kl_mean<=0.05``, ``top1_agreement>=0.9``...

A gate is ``METRIC OP NUMBER[%]`` with OP one of ``<= < >= >``. Gates come from ``--gate``
options or a recipe's ``gates:`` list, are parsed before any work starts (a typo fails in a
second, not after an hour of calibration), and are checked against the finished report.
The report is written first, with every gate's outcome; then the CLI exits with
:data:`GATE_EXIT_CODE` if any gate failed.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

from optc.errors import OptcError

# Exit codes of every optc command: 0 success, 1 user error (bad input, one line on stderr),
# 2 command-line usage error, 3 a gate failed (report written), 4 the model computed NaN or
# infinite logits or metrics (report written, every gate failed), 130 interrupted.
GATE_EXIT_CODE = 3
NON_FINITE_EXIT_CODE = 4

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt,
}
_GATE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_]*)\s*(<=|>=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(%?)\s*$")


@dataclass(frozen=True)
class GateMetric:
    description: str
    unit: str  # "%" (value in percent), "fraction" (0..1), or a plain unit
    needs: str  # what must be measured: "eval", "baseline", "latency", "size"


# What each gate name reads from the report (see :func:`gate_values`).
GATE_METRICS: dict[str, GateMetric] = {
    "ppl": GateMetric("perplexity of the evaluated model", "", "eval"),
    "ppl_increase": GateMetric("perplexity change over the baseline, percent", "%", "baseline"),
    "ppl_increase_ci_high": GateMetric("upper end of the paired 95% interval of ppl_increase", "%", "baseline"),
    "kl_mean": GateMetric("mean token KL divergence from the baseline (nats)", "nats", "kl"),
    "kl_max": GateMetric("largest token KL divergence from the baseline (nats)", "nats", "kl"),
    "kl_p99": GateMetric("99th percentile token KL divergence (nats)", "nats", "kl"),
    "top1_agreement": GateMetric("share of tokens whose top-1 prediction matches the baseline", "fraction", "kl"),
    "bits_per_weight": GateMetric("stored bits per parameter", "bits", "size"),
    "compression_ratio": GateMetric("float16 size / stored size of the weights", "x", "size"),
    "size_mb": GateMetric("checkpoint size on disk, MiB", "MiB", "size"),
    "sparsity": GateMetric("share of zero weights in decoder Linears", "fraction", "size"),
    "decode_speedup": GateMetric("decode tokens/s over the baseline's (median latencies)", "x", "latency"),
    "prefill_speedup": GateMetric("prefill speed over the baseline's (median latencies)", "x", "latency"),
    "decode_tokens_per_s": GateMetric("decode tokens per second (1 / median token latency)", "tok/s", "latency"),
}


@dataclass(frozen=True)
class Gate:
    text: str
    metric: str
    op: str
    threshold: float  # in the metric's own unit

    def check(self, value: float) -> bool:
        return _OPS[self.op](value, self.threshold)


def parse_gate(text: str) -> Gate:
    """``"ppl_increase<=5%"`` -> Gate. A ``%`` on a fraction metric divides by 100."""
    m = _GATE.match(text)
    if not m:
        raise OptcError(
            f"cannot parse gate {text!r}: expected METRIC OP NUMBER, e.g. 'ppl_increase<=5%' "
            f"or 'kl_mean<=0.05' (OP is one of <=, <, >=, >)"
        )
    name, op, number, pct = m.groups()
    if name not in GATE_METRICS:
        raise OptcError(f"gate {text!r}: unknown metric {name!r} (known: {', '.join(GATE_METRICS)})")
    unit = GATE_METRICS[name].unit
    threshold = float(number)
    if pct:
        if unit == "fraction":
            threshold /= 100
        elif unit != "%":
            raise OptcError(f"gate {text!r}: {name} is not a percentage (unit: {unit or 'none'})")
    return Gate(text=text.strip(), metric=name, op=op, threshold=threshold)


def parse_gates(texts: list[str] | None) -> list[Gate]:
    return [parse_gate(t) for t in texts or []]


def require_measurable(gates: list[Gate], available: set[str]) -> None:
    """Refuse, before any work, a gate whose metric this run will not measure."""
    hints = {
        "eval": "evaluation (do not pass --no-eval)",
        "baseline": "a baseline (--baseline MODEL, or evaluation.baseline: true in the recipe)",
        "kl": "a baseline model to compare logits with (optc eval --baseline MODEL)",
        "latency": "latency timing (--latency)",
        "size": "a checkpoint on disk",
    }
    for g in gates:
        need = GATE_METRICS[g.metric].needs
        if need not in available:
            raise OptcError(f"gate {g.text!r} needs {hints[need]}")


def _get(d: dict | None, *keys: str) -> float | None:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d if isinstance(d, int | float) and not isinstance(d, bool) else None


def gate_values(report: dict) -> dict[str, float | None]:
    """Every gate metric's value in ``report`` (None where not measured)."""
    m = report.get("metrics", {})
    change = m.get("perplexity_change") or {}
    ci = change.get("ppl_increase_pct_ci95") or (None, None)
    model_ppl = m.get("perplexity_compressed") or m.get("perplexity_model") or {}
    return {
        "ppl": _get(model_ppl, "perplexity"),
        "ppl_increase": _get(change, "ppl_increase_pct"),
        "ppl_increase_ci_high": ci[1],
        "kl_mean": _get(m, "divergence", "kl_mean"),
        "kl_max": _get(m, "divergence", "kl_max"),
        "kl_p99": _get(m, "divergence", "kl_p99"),
        "top1_agreement": _get(m, "divergence", "top1_agreement"),
        "bits_per_weight": _get(m, "size", "bits_per_weight"),
        "compression_ratio": _get(m, "size", "compression_ratio"),
        "size_mb": None if _get(m, "size", "bytes_on_disk") is None else m["size"]["bytes_on_disk"] / 2**20,
        "sparsity": _get(m, "size", "sparsity"),
        "decode_speedup": _get(m, "latency", "decode_speedup"),
        "prefill_speedup": _get(m, "latency", "prefill_speedup"),
        "decode_tokens_per_s": _get(m, "latency", "model", "decode_tokens_per_s"),
    }


@dataclass
class GateResult:
    gate: str
    metric: str
    op: str
    threshold: float
    value: float | None
    passed: bool
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt(value: float, unit: str) -> str:
    if unit == "%":
        return f"{value:+.2f}%"
    if unit == "fraction":
        return f"{value:.4f}"
    return f"{value:.4g}"


def check_gates(gates: list[Gate], report: dict) -> list[GateResult]:
    """Each gate's outcome, with a message saying by how much a failed gate missed.

    A metric that is NaN or infinite fails its gate whatever the comparison would say (NaN
    compares false both ways, an infinity passes every ``>=``); and when the report records any
    non-finite value (``metrics.non_finite``) every gate fails: a broken model passes nothing."""
    values = gate_values(report)
    broken = (report.get("metrics") or {}).get("non_finite")
    results = []
    for g in gates:
        value = values.get(g.metric)
        unit = GATE_METRICS[g.metric].unit
        if value is not None and not math.isfinite(value):
            results.append(GateResult(g.text, g.metric, g.op, g.threshold, None, False,
                                      f"gate {g.text}: FAILED, {g.metric} is {value} (not a finite number)"))
            continue
        if broken:
            results.append(GateResult(g.text, g.metric, g.op, g.threshold, value, False,
                                      f"gate {g.text}: FAILED, the model computed non-finite values "
                                      f"({', '.join(broken['metrics']) or 'logits'})"))
            continue
        if value is None:
            results.append(GateResult(g.text, g.metric, g.op, g.threshold, None, False,
                                      f"gate {g.text}: FAILED, {g.metric} was not measured"))
            continue
        passed = g.check(value)
        shown, limit = _fmt(value, unit), _fmt(g.threshold, unit)
        if passed:
            msg = f"gate {g.text}: passed ({g.metric} = {shown})"
        else:
            miss = abs(value - g.threshold)
            by = f"{miss:.2f} percentage points" if unit == "%" else _fmt(miss, unit).lstrip("+")
            rel = f", {100 * miss / abs(g.threshold):.1f}% of the limit" if g.threshold else ""
            msg = f"gate {g.text}: FAILED, {g.metric} = {shown} misses {limit} by {by}{rel}"
        results.append(GateResult(g.text, g.metric, g.op, g.threshold, value, passed, msg))
    return results


def failed(results: list[dict] | list[GateResult]) -> list:
    return [r for r in results if not (r["passed"] if isinstance(r, dict) else r.passed)]
