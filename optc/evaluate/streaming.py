"""Layer-major perplexity: every window through layer i, then through layer i+1.

A model larger than memory is evaluated the way it is calibrated: the first decoder layer's
inputs are captured for all windows (the embeddings are read for this alone), then each layer
is read from the checkpoint, run on every window and freed, and finally the model's own head
(final norm, output projection) turns the last hidden states into logits. Memory holds one
layer plus the hidden states of all windows (``windows x seqlen x hidden`` floats), never the
model. The per-window scores are the same as :func:`optc.evaluate.perplexity.evaluate_windows`
computes on the whole model (same batches, same operations).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from optc.model.anatomy import find_decoder_layers
from optc.model.forward import capture_first_layer_inputs
from optc.model.lazy import CheckpointSource, linear_summary, materialize, release, tensor_counts
from optc.evaluate.perplexity import PerplexityResult, _check_protocol, _WindowScores, windows_of
from optc.progress import NullProgress, Progress

log = logging.getLogger(__name__)


class _Replay(nn.Module):
    """Stands in for the whole decoder stack: returns the hidden states computed layer-major."""

    def __init__(self, as_tuple: bool, attention_type: str | None) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None
        self.as_tuple = as_tuple
        if attention_type is not None:  # read by models that pick a mask per layer type
            self.attention_type = attention_type

    def forward(self, *args, **kwargs) -> torch.Tensor | tuple[torch.Tensor]:
        return (self.hidden,) if self.as_tuple else self.hidden


@contextmanager
def _stack_replaced(model: nn.Module, prefix: str, stack: nn.ModuleList) -> Iterator[None]:
    parent_name, _, attr = prefix.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    layers = getattr(parent, attr)
    setattr(parent, attr, stack)
    try:
        yield
    finally:
        setattr(parent, attr, layers)


def streamed_perplexity(
    model: nn.Module,
    source: CheckpointSource,
    tokens: torch.Tensor,
    seqlen: int,
    windows: int | None = None,
    stride: int | None = None,
    batch_size: int = 1,
    progress: Progress | None = None,
    stats: dict | None = None,
) -> PerplexityResult:
    """Perplexity of the checkpoint ``source`` (``model``: its meta-device skeleton) on 1-D
    ``tokens``, reading one decoder layer at a time. ``stats``, when given, receives the
    parameter and non-zero counts and per-Linear summaries of the weights read on the way."""
    progress = progress or NullProgress()
    stride = _check_protocol(model, seqlen, stride)
    spans = windows_of(tokens, seqlen, stride, windows)
    ids = torch.stack([tokens[s : s + seqlen] for s, _ in spans])
    prefix, layers = find_decoder_layers(model)
    t0 = time.perf_counter()
    materialize(model, source, exclude=prefix)
    materialize(layers[0], source, prefix=f"{prefix}.0.")
    with torch.inference_mode():
        batches = capture_first_layer_inputs(model, ids, batch_size, torch.device("cpu"))
    release(model, exclude=prefix)  # embeddings and head are not needed while the layers run
    as_tuple = False
    first_bad: str | None = None  # the first decoder layer whose output is not finite
    label = f"perplexity ({len(spans)} x {seqlen}, layer-major)"
    with progress.task(label, total=len(layers) + 1) as advance:
        for i, layer in enumerate(layers):
            materialize(layer, source, prefix=f"{prefix}.{i}.")
            if stats is not None:
                _count(stats, *tensor_counts(layer))
                stats.setdefault("linears", {}).update(linear_summary(layer, f"{prefix}.{i}"))
            with torch.inference_mode():
                for b in batches:
                    out = layer(b.hidden, *b.args, **b.kwargs)
                    as_tuple = isinstance(out, tuple)
                    b.hidden = (out[0] if as_tuple else out).to(b.hidden.dtype)
                    if first_bad is None and not bool(torch.isfinite(b.hidden).all()):
                        first_bad = f"{prefix}.{i}"
            release(layer)
            advance()
        materialize(model, source, exclude=prefix)
        if stats is not None:
            _count(stats, *tensor_counts(model, exclude=prefix))
        replay = _Replay(as_tuple, getattr(layers[-1], "attention_type", None))
        scores = _WindowScores()
        with _stack_replaced(model, prefix, nn.ModuleList([replay])), torch.inference_mode():
            for j, b in enumerate(batches):
                chunk = spans[j * batch_size : (j + 1) * batch_size]
                chunk_ids = ids[j * batch_size : (j + 1) * batch_size]
                replay.hidden = b.hidden
                logits = model(input_ids=chunk_ids, use_cache=False).logits
                for k, (_, first) in enumerate(chunk):
                    lo = max(first, 1)  # position t predicts token t+1
                    scores.update(logits[k, lo - 1 : -1], chunk_ids[k, lo:])
                del logits
        release(model, exclude=prefix)
        advance()
    result = scores.result(seqlen, stride, time.perf_counter() - t0)
    if result.non_finite_logits:
        result.first_non_finite = first_bad or "the output head (final norm or lm_head)"
    return result


def _count(stats: dict, numel: int, nonzero: int) -> None:
    stats["numel"] = stats.get("numel", 0) + numel
    stats["nonzero"] = stats.get("nonzero", 0) + nonzero
