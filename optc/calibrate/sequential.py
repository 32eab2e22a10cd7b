"""The sequential (layer-by-layer) calibration runner shared by every data-driven method.

1. Capture the inputs of the first decoder layer for all calibration samples (the model runs
   only up to that layer).
2. For each layer: the solver calls :meth:`LayerStep.collect` to run the layer with forward
   hooks on chosen Linears, feeding small accumulator objects (Hessians, norms, histograms,
   samples); it then writes solved weights back. The runner re-runs the layer to produce the
   next layer's inputs from the compressed weights, so later layers see the errors of earlier
   ones.

Only one layer's inputs and outputs are alive at a time, and on an accelerator only the layer
being calibrated lives on the device. Under torchrun each process runs its own block of the
calibration batches and every collect ends with the accumulators reduced across processes
(:mod:`optc.calibrate.distributed`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from optc.calibrate import distributed
from optc.model.anatomy import find_decoder_layers, select_linears
from optc.model.forward import Batch, StopForward, capture_first_layer_inputs, layers_detached
from optc.errors import OptcError
from optc.memory import trim
from optc.progress import NullProgress, Progress

log = logging.getLogger(__name__)


class Accumulator(Protocol):
    def add(self, x: torch.Tensor) -> None: ...


class LayerStore(Protocol):
    """Where finished layers go (the run's resume state, or disk when streaming), called around
    every decoder layer; :class:`optc.run.state.LayerStore` is the one the run passes."""

    streaming: bool

    def before_capture(self, model: nn.Module, prefix: str, layers: nn.ModuleList) -> None: ...
    def start(self, model: nn.Module, prefix: str, layers: nn.ModuleList, batches: list) -> int: ...
    def restore(self, i: int, name: str, layer: nn.Module, records: dict | None) -> dict: ...
    def load(self, i: int, name: str, layer: nn.Module) -> None: ...
    def done(self, i: int, name: str, layer: nn.Module, stats: dict, batches: list, records: dict | None, last: bool) -> None: ...


@contextmanager
def input_hooks(
    modules: Mapping[str, nn.Module], fn: Callable[[str, torch.Tensor], None]
) -> Iterator[None]:
    """Call ``fn(name, input)`` before each forward of each module; hooks always removed.

    A pre-hook (not a forward hook) so that ``fn`` may stop the forward before the module
    computes anything, by raising.
    """
    handles = []
    try:
        for name, module in modules.items():
            def hook(_mod: nn.Module, args: tuple, _name: str = name) -> None:
                # The very tensor the module reads (not a detached view, which would be a new
                # object on every call): callers recognise shared inputs by identity.
                fn(_name, args[0])

            handles.append(module.register_forward_pre_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()


class _OneDNNLinear(TorchFunctionMode):
    """Float32 CPU ``F.linear`` through oneDNN instead of MKL's sgemm.

    MKL's GEMM is tuned for Intel CPUs; on an AMD EPYC (AVX2) it reached ~55 GFLOPS on a
    SmolLM2 MLP's [512, 576] x [576, 1536] where oneDNN reaches ~95, a layer forward 15% faster.
    """

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if (x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and w.is_contiguous()
                    and (b is None or b.dtype == torch.float32)):
                return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return func(*args, **kwargs)


@functools.cache
def _onednn_linear() -> bool:
    """Whether calibration forwards on the CPU use :class:`_OneDNNLinear`: on CPUs that are
    not Intel's (``OPTC_CPU_LINEAR=mkl|onednn`` decides instead). Decided once per process
    from the CPU, never by timing, so a machine always gets the same checkpoint."""
    choice = os.environ.get("OPTC_CPU_LINEAR", "auto")
    if choice not in ("auto", "mkl", "onednn"):
        raise OptcError(f"OPTC_CPU_LINEAR must be auto, mkl or onednn, got {choice!r}")
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if choice != "auto":
        return choice == "onednn"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    vendor = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("vendor_id")), "")
    use = vendor not in ("", "GenuineIntel")
    log.info("CPU %s: calibration forwards run float32 Linears through %s", vendor or "?", "oneDNN" if use else "MKL")
    return use


def _call_layer(layer: nn.Module, batch: Batch, autocast: torch.dtype | None = None) -> torch.Tensor:
    if autocast is not None:
        # Low-precision matmuls (AMX/tensor cores) for calibration forwards only; the stored
        # activations stay in the model's dtype.
        backend: Any = torch.autocast(batch.hidden.device.type, dtype=autocast)
    elif batch.hidden.device.type == "cpu" and _onednn_linear():
        backend = _OneDNNLinear()
    else:
        backend = nullcontext()
    hidden = batch.hidden
    param = next(layer.parameters(), None)
    if param is not None and param.is_floating_point() and hidden.dtype != param.dtype:
        hidden = hidden.to(param.dtype)  # a stream a method keeps in another dtype (advance_other)
    with backend:
        out = layer(hidden, *batch.args, **batch.kwargs)
    out = out[0] if isinstance(out, tuple) else out
    return out.to(batch.hidden.dtype)


@dataclass
class LayerStep:
    """One decoder layer during calibration, handed to a solver."""

    index: int
    name: str
    layer: nn.Module
    linears: dict[str, nn.Module]  # full model names -> modules inside this layer
    batches: list[Batch]
    forwards: int = field(default=0)
    autocast: torch.dtype | None = None
    row_offset: int = 0  # index of this process's first token among all calibration tokens
    world_tokens: int | None = None  # calibration tokens over all processes
    # Consecutive batches an accumulator may sum in float32 before adding to an exact total
    # (distributed.fold_size: every process's share starts at a multiple of it).
    fold: int = 1

    @property
    def tokens(self) -> int:
        """Calibration tokens this layer sees (over every process when distributed)."""
        if self.world_tokens is not None:
            return self.world_tokens
        return sum(b.hidden.shape[0] * b.hidden.shape[1] for b in self.batches)

    def collect(
        self, names: list[str], make: Callable[[str, nn.Module], Accumulator], samples: int | None = None,
        stream: list[torch.Tensor] | None = None,
    ) -> dict[str, Accumulator]:
        """Run the layer on every batch, feeding each named Linear's input to its accumulator.

        Linears that receive the very same input tensor (q/k/v after one norm, gate/up) share
        one accumulator, so each distinct input is reduced once. ``samples``: only the first
        batches, as many as hold that many samples (per process). ``stream``: statistics of
        another stream's activations (one per batch, e.g. the float model's), each then replaced
        by this layer's output on it as :meth:`advance_other` does, in the same forward.
        """
        batches = self.batches
        if samples is not None:
            held = list(itertools.accumulate(b.hidden.shape[0] for b in batches))
            batches = batches[: bisect.bisect_left(held, samples) + 1]
        accs: dict[str, Accumulator] = {}
        alias: dict[str, str] = {}
        seen: list[tuple[torch.Tensor, str]] = []  # inputs of this batch, kept alive
        # The first batch runs the whole layer and records the order in which the hooked
        # Linears are called; later batches stop right before the last of those calls: the
        # layer's output is not needed here (unless it advances a stream), and the work after
        # its last hooked input (in a Llama layer, down_proj and the residual add) is a quarter
        # of its matmuls.
        order: list[str] = []
        stop: tuple[str, int] | None = None  # (last hooked Linear, its number of calls)
        feeding = [True]  # False for a stream's batches past ``samples``

        def feed(name: str, x: torch.Tensor) -> None:
            if not feeding[0]:
                return
            if name not in accs and name not in alias:
                # Identity (not address) comparison: the list keeps each input alive for the
                # whole batch, so a freed tensor's memory cannot be mistaken for a shared input.
                twin = next((n for t, n in seen if t is x), None)
                if twin is not None:
                    alias[name] = twin
                else:
                    accs[name] = make(name, self.linears[name])
            seen.append((x, name))
            if name in accs:
                accs[name].add(x)
            if stream is not None:
                return
            if stop is None:
                order.append(name)
            elif name == stop[0] and sum(n == name for _, n in seen) == stop[1]:
                raise StopForward

        self.forwards += 1
        # A stream stays a normal tensor (no_grad, not inference mode), as advance_other keeps it.
        with torch.inference_mode() if stream is None else torch.no_grad(), \
                input_hooks({n: self.linears[n] for n in names}, feed):
            if stream is None:
                for i, b in enumerate(batches):
                    try:
                        _call_layer(self.layer, b, self.autocast)
                    except StopForward:
                        pass
                    if i == 0 and order:
                        stop = (order[-1], order.count(order[-1]))
                    seen.clear()
            else:
                for i, (h, b) in enumerate(zip(stream, self.batches)):
                    feeding[0] = i < len(batches)
                    stream[i] = self._output_into(h, b)
                    seen.clear()
            distributed.reduce_all(accs)  # torchrun: statistics of every rank's samples
        return {**accs, **{n: accs[a] for n, a in alias.items()}}

    def observe(self, accs: Mapping[str, Accumulator]) -> None:
        """Run the layer on every batch for hooks the solver attached itself, feeding ``accs``
        (outputs dropped; a hook may end a batch early by raising :class:`StopForward` once it
        has what it needs), then reduce ``accs`` across processes as :meth:`collect` does."""
        self.forwards += 1
        with torch.inference_mode():
            for b in self.batches:
                try:
                    _call_layer(self.layer, b, self.autocast)
                except StopForward:
                    pass
            distributed.reduce_all(accs)

    def input_groups(self, names: list[str]) -> list[list[str]]:
        """The named Linears grouped by the input tensor they share (q/k/v, gate/up), groups in
        the order the layer reads those inputs and each group in ``names`` order; found from the
        first batch alone, since the calls of a layer do not depend on the data."""
        firsts: list[tuple[torch.Tensor, list[str]]] = []
        seen: set[str] = set()

        def feed(name: str, x: torch.Tensor) -> None:
            if name in seen:
                return
            seen.add(name)
            group = next((g for t, g in firsts if t is x), None)
            if group is None:
                firsts.append((x, [name]))
            else:
                group.append(name)

        with torch.inference_mode(), input_hooks({n: self.linears[n] for n in names}, feed):
            _call_layer(self.layer, self.batches[0], self.autocast)
        rank = {n: i for i, n in enumerate(names)}
        return [sorted(g, key=rank.__getitem__) for _, g in firsts]

    @torch.inference_mode()
    def advance(self) -> None:
        """Replace each batch's inputs by this layer's outputs, one batch at a time, so only
        one extra batch of activations is alive."""
        self.forwards += 1
        for b in self.batches:
            b.hidden = self._output_into(b.hidden, b)

    def _output_into(self, hidden: torch.Tensor, b: Batch) -> torch.Tensor:
        """This layer's output on ``hidden`` (with ``b``'s other inputs), written into
        ``hidden`` itself when the shapes agree: allocating each new output while the old inputs
        are freed one by one fragments the heap, which held up to twice the calibration
        activations (150 MB more at the protocol's 128 x 512 tokens)."""
        out = _call_layer(self.layer, Batch(hidden, b.args, b.kwargs), self.autocast)
        if out.shape == hidden.shape:
            return hidden.copy_(out)
        return out

    @torch.inference_mode()
    def run(self) -> list[torch.Tensor]:
        """This layer's outputs for every batch (inputs left as they are)."""
        self.forwards += 1
        return [_call_layer(self.layer, b, self.autocast) for b in self.batches]

    @torch.no_grad()
    def advance_other(self, hiddens: list[torch.Tensor]) -> None:
        """Replace another stream's activations (one per batch, e.g. the float model's) by this
        layer's outputs on them, into the same buffers, as :meth:`advance` does. Under no_grad
        rather than inference mode, so a method may train against them."""
        self.forwards += 1
        for i, (h, b) in enumerate(zip(hiddens, self.batches)):
            hiddens[i] = self._output_into(h, b)


Solver = Callable[[LayerStep], dict]


def run_sequential(
    model: nn.Module,
    ids: torch.Tensor,
    solve: Solver,
    *,
    targets: list[str],
    ignore: list[str],
    batch_size: int,
    device: torch.device | str = "cpu",
    propagate: bool = True,
    autocast: torch.dtype | None = None,
    progress: Progress | None = None,
    description: str = "calibrating",
    store: LayerStore | None = None,
    records: dict | None = None,
) -> list[dict]:
    """Calibrate ``model`` layer by layer on ``ids`` ([samples, seqlen]); returns per-layer stats.

    ``propagate=False`` feeds each layer the float outputs of the previous layer instead of
    the compressed ones (one forward per layer less; used by observers that do not change
    weights). ``store`` saves each finished layer (resume) and, when streaming, loads each
    layer before and frees it after; ``records`` is the solver's per-Linear statistics dict,
    which the store saves and restores with the layers.
    """
    device = torch.device(device)
    progress = progress or NullProgress()
    chosen = select_linears(model, targets, ignore)
    prefix, layers = find_decoder_layers(model)
    was_training = model.training
    model.eval()
    stats: list[dict] = []
    world_tokens = ids.shape[0] * ids.shape[1]
    ids, row_offset, batch_size, fold = distributed.shard(ids, batch_size)
    if store is not None:
        store.before_capture(model, prefix, layers)
    with torch.inference_mode():
        batches = capture_first_layer_inputs(model, ids, batch_size, device)
    start = store.start(model, prefix, layers, batches) if store is not None else 0
    with progress.task(description, total=len(layers)) as advance:
        for i, layer in enumerate(layers):
            t0 = time.perf_counter()
            name = f"{prefix}.{i}"
            if i < start:  # finished by the interrupted run this one resumes
                stats.append(store.restore(i, name, layer, records))
                advance()
                continue
            linears = {n: m for n, m in chosen.items() if n.startswith(name + ".")}
            if store is not None:
                store.load(i, name, layer)
            layer.to(device)
            step = LayerStep(i, name, layer, linears, batches, autocast=autocast,
                             row_offset=row_offset, world_tokens=world_tokens, fold=fold)
            layer_stats: dict = {}
            feeds_next = i < len(layers) - 1  # nothing reads the last layer's outputs
            if linears and not propagate:
                float_outputs = step.run() if feeds_next else []
                layer_stats = solve(step) or {}
                distributed.broadcast_module(layer)
                for b, out in zip(batches, float_outputs):
                    b.hidden = out
            else:
                if linears:
                    layer_stats = solve(step) or {}
                    distributed.broadcast_module(layer)  # every rank propagates rank 0's layer
                if feeds_next:
                    step.advance()
            layer.to("cpu")
            trim()
            layer_stats.update(layer=name, seconds=round(time.perf_counter() - t0, 3))
            if store is not None:
                store.done(i, name, layer, layer_stats, batches, records, last=i == len(layers) - 1)
            stats.append(layer_stats)
            log.debug("layer %s done in %.2fs", name, layer_stats["seconds"])
            advance()
    if store is None or not store.streaming:  # streaming: nothing of the model is in memory now
        with layers_detached(model, prefix):
            model.to("cpu")
    model.train(was_training)
    return stats
