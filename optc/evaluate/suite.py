"""``optc eval``: every measurement of one model (and its baseline) into one report.

Order matters for speed and honesty: both models read the evaluation windows in one pass
(paired NLLs and KL from the same logits); size and per-layer statistics read the float
weights; latency comes last because it swaps quantized Linears for kernel modules in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from optc.errors import OptcError
from optc.evaluate.gates import Gate, check_gates, require_measurable
from optc.evaluate.latency import apply_kernels, float_summary, measure_latency
from optc.evaluate.protocol import EvalProtocol, LatencyOptions
from optc.evaluate.perplexity import evaluate_windows, evaluation_token_cache, paired_difference
from optc.evaluate.report import layer_statistics, record_non_finite
from optc.evaluate.size import size_metrics
from optc.model.load import LoadedModel
from optc.progress import NullProgress, Progress

log = logging.getLogger(__name__)


@dataclass
class EvalOptions:
    protocol: EvalProtocol = field(default_factory=EvalProtocol)
    cache: bool = True  # tokenized-text cache on disk
    latency: LatencyOptions | None = None  # None: not timed
    tasks: list[str] = field(default_factory=list)
    task_limit: int | None = None
    gates: list[Gate] = field(default_factory=list)


@contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = round(timings.get(name, 0.0) + time.perf_counter() - t0, 3)


def check_same_tokenizer(model_tok, base_tok, sample: str, names: tuple[str, str]) -> None:
    """KL between models is only meaningful over the same token ids."""
    same = model_tok.get_vocab() == base_tok.get_vocab()
    if same:
        enc = lambda t: t(sample, add_special_tokens=False)["input_ids"]  # noqa: E731
        same = enc(model_tok) == enc(base_tok)
    if not same:
        raise OptcError(
            f"baseline {names[1]!r} uses a different tokenizer than {names[0]!r}: perplexity and "
            "KL divergence cannot be compared across tokenizers"
        )


def run_evaluation(
    loaded: LoadedModel,
    baseline: LoadedModel | None,
    opts: EvalOptions,
    report: dict,
    progress: Progress | None = None,
) -> dict:
    """Fill ``report`` (metrics, layers, timings, gates) for ``loaded`` against ``baseline``."""
    progress = progress or NullProgress()
    timings = report.setdefault("timings", {})
    metrics = report["metrics"]
    available = {"eval", "size"} | ({"baseline", "kl"} if baseline is not None else set())
    available |= {"latency"} if opts.latency is not None else set()
    require_measurable(opts.gates, available)
    if opts.tasks:
        from optc.evaluate.tasks import check_lm_eval

        check_lm_eval(opts.tasks)
    lat = opts.latency
    if lat is not None and (lat.prompt_tokens < 1 or lat.new_tokens < 1 or lat.repeats < 1):
        raise OptcError("--prompt-tokens, --new-tokens and --repeats must be at least 1")

    with timed(timings, "tokenize"):
        tokens = evaluation_token_cache(loaded.tokenizer, opts.protocol.source(), opts.cache)
    if baseline is not None:
        from optc.data import load_text

        check_same_tokenizer(loaded.tokenizer, baseline.tokenizer,
                             load_text(opts.protocol.source(), "evaluation", loaded.tokenizer)[:4000], (loaded.source, baseline.source))

    with timed(timings, "perplexity"):
        res = evaluate_windows(
            loaded.model, tokens, opts.protocol.seqlen, opts.protocol.windows, opts.protocol.stride,
            opts.protocol.batch_size, progress,
            baseline=baseline.model if baseline is not None else None,
        )
    if baseline is None:
        metrics["perplexity_model"] = res.model.to_dict()
    else:
        metrics["perplexity_baseline"] = res.baseline.to_dict()
        metrics["perplexity_compressed"] = res.model.to_dict()
        metrics["perplexity_change"] = paired_difference(res.baseline, res.model)
        metrics["divergence"] = res.divergence.to_dict()

    with timed(timings, "size"):
        size = size_metrics(loaded.model, loaded.path)
        metrics["size"] = size
        metrics["parameters"], metrics["nonzero"] = size["parameters"], size["nonzero"]
        if size["bytes_on_disk"] is not None:
            metrics["bytes_on_disk"] = size["bytes_on_disk"]
        schemes = {n: p.scheme.label() for n, p in loaded.qparams.items()}
        report["layers"] = layer_statistics(
            loaded.model, schemes, reference=baseline.model if baseline is not None else None
        )

    if opts.tasks:
        from optc.evaluate.tasks import run_tasks

        with timed(timings, "tasks"):
            metrics["tasks"] = run_tasks(loaded.model, loaded.tokenizer, opts.tasks, opts.task_limit)

    if opts.latency is not None:
        with timed(timings, "latency"):
            metrics["latency"] = _latency(loaded, baseline, tokens, opts.latency, progress)

    record_non_finite(report)
    report["gates"] = [g.to_dict() for g in check_gates(opts.gates, report)]
    return report


def _latency(loaded: LoadedModel, baseline: LoadedModel | None, tokens: torch.Tensor,
             opts: LatencyOptions, progress: Progress) -> dict:
    if tokens.numel() < opts.prompt_tokens:
        raise OptcError(f"latency prompt needs {opts.prompt_tokens} tokens; the evaluation text has {tokens.numel()}")
    summary = apply_kernels(loaded.model, loaded.qparams, opts.kernel)
    models = {"model": (loaded.model, summary)}
    if baseline is not None:
        models["baseline"] = (baseline.model, float_summary(baseline.model))
    with progress.task(f"latency ({len(models)} models)", total=opts.repeats * len(models)) as advance:
        results = measure_latency(models, tokens[: opts.prompt_tokens], opts.new_tokens, opts.repeats,
                                  opts.threads, on_run=advance)
    out: dict = {k: r.to_dict() for k, r in results.items()}
    if "baseline" in results:
        b, m = results["baseline"], results["model"]
        out["decode_speedup"] = round(b.decode["p50_ms"] / m.decode["p50_ms"], 4)
        out["prefill_speedup"] = round(b.prefill["p50_ms"] / m.prefill["p50_ms"], 4)
    out["fallbacks"] = summary.fallbacks
    return out
