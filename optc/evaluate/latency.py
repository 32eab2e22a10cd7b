"""CPU latency on real low-precision kernels: prefill time, decode tokens/s, peak memory.

A compressed checkpoint loads as a float model holding exactly its dequantized weights (the
right thing for accuracy). For speed, :func:`apply_kernels` swaps each quantized Linear for a
module that keeps the integer codes and calls a kernel torch ships for this CPU:

- ``int4``: ``aten._weight_int4pack_mm_for_cpu`` (the int4 weight-only CPU path torchao's
  ``Int4CPULayout`` calls): 4-bit codes packed by ``aten._convert_weight_to_int4pack_for_cpu``,
  per-group scale and zero, activations cast to bfloat16 inside the kernel.
- ``int8-dynamic``: ``aten._int_mm`` (int8 x int8 -> int32 GEMM) with activations quantized
  per token at run time and per-channel weight scales (W8A8-dynamic, the recipe of torchao's
  int8 dynamic-activation config). ``onednn::qlinear_pointwise`` was tried and not kept: on
  this CPU it took milliseconds for a 192-row weight at batch 1.
- ``int8-weight-only``: ``aten._weight_int8pack_mm``: int8 weights, bfloat16 activations.

torch's eager ``quantize_dynamic`` is not used: its quantized tensor types are deprecated.
A Linear whose scheme no kernel takes (say 3-bit, act-order groups, a shape the kernel
refuses) runs as a float matmul on its dequantized weights, and the report says so:
``kernels`` counts every Linear by what actually ran. Decode is timed token by token with a
KV cache, so its percentiles are per-token latencies.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from optc.model.anatomy import weight_2d
from optc.evaluate.protocol import KernelChoice
from optc.compress.quant import QuantParams, QuantScheme, compute_qparams, default_g_idx, quantize

log = logging.getLogger(__name__)


INT4_KERNEL = "aten._weight_int4pack_mm_for_cpu (int4 weight-only, bf16 activations)"
INT8_DYNAMIC_KERNEL = "aten._int_mm (int8 weights, int8 dynamic per-token activations)"
INT8_WO_KERNEL = "aten._weight_int8pack_mm (int8 weight-only, bf16 activations)"
_INT4_GROUPS = (256, 128, 64, 32)


def float_label(dtype: torch.dtype) -> str:
    return f"float fallback ({str(dtype).removeprefix('torch.')} matmul)"


def _frozen_bias(bias: torch.Tensor | None) -> torch.nn.Parameter | None:
    return None if bias is None else torch.nn.Parameter(bias.detach().float().clone(), requires_grad=False)


# --- kernel modules ----------------------------------------------------------------------


class Int4WeightOnlyLinear(torch.nn.Module):
    """y = x W^T + b with W held as packed 4-bit codes (aten int4pack CPU kernel)."""

    kernel = INT4_KERNEL

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        # The kernel dequantizes w = (u - 8) * s + z_f from unsigned codes u in [0, 15]; our
        # signed codes q = u - 8 with w = (q - z) s, hence z_f = -z s.
        unsigned = (codes.to(torch.int32) + 8).contiguous()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1))
        sz = torch.stack([scale.t(), (-zero.float() * scale).t()], dim=-1)  # [G, N, 2]
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16).contiguous())
        self.group = group
        self.out_features = codes.shape[0]
        self.bias = _frozen_bias(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed, self.group, self.scales_and_zeros
        ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class Int8DynamicLinear(torch.nn.Module):
    """W8A8-dynamic: per-token symmetric int8 activations times per-channel int8 weights,
    accumulated exactly in int32 by ``aten._int_mm``."""

    kernel = INT8_DYNAMIC_KERNEL

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight_t", codes.to(torch.int8).t().contiguous())  # [K, N]
        self.register_buffer("scale", (scale.reshape(1, -1).float() / 127).contiguous())
        self.out_features = codes.shape[0]
        self.bias = _frozen_bias(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        # Each token's absmax maps to 127 (symmetric, zero point 0). Written with few ops: at
        # batch-1 decode every extra elementwise call costs about as much as the GEMM saves.
        amax = torch.linalg.vector_norm(x2, ord=math.inf, dim=1, keepdim=True).clamp_min_(1e-8)
        xq = torch.mul(x2, 127 / amax).round_().to(torch.int8)  # |x| * 127 / amax <= 127: no clamp
        y = torch._int_mm(xq, self.weight_t) * (amax * self.scale)  # scale already holds the /127
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


class Int8WeightOnlyLinear(torch.nn.Module):
    """Per-channel int8 weights, bfloat16 activations (aten._weight_int8pack_mm)."""

    kernel = INT8_WO_KERNEL

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", codes.to(torch.int8).contiguous())  # [N, K]
        self.register_buffer("scale", scale.reshape(-1).to(torch.bfloat16))
        self.out_features = codes.shape[0]
        self.bias = _frozen_bias(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight, self.scale
        ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


# --- choosing and applying kernels -------------------------------------------------------


def _contiguous_groups(p: QuantParams) -> bool:
    return torch.equal(p.g_idx.cpu(), default_g_idx(p.g_idx.numel(), p.scheme))


def _int4_group(p: QuantParams, k: int) -> int | None:
    """The kernel group size that reproduces ``p``'s grid exactly, if there is one."""
    if p.scheme.group_size is None:
        # One scale per row is the same grid as any group size that divides K, repeated.
        return next((g for g in _INT4_GROUPS if k % g == 0), None)
    g = p.scheme.group_size
    return g if g in _INT4_GROUPS and k % g == 0 else None


def kernel_for(p: QuantParams, n: int, k: int, choice: KernelChoice = "auto") -> tuple[str | None, str]:
    """(kernel kind or None, kernel name or why none) for a [n, k] Linear quantized with ``p``."""
    if choice == "float":
        return None, "float requested (--kernel float)"
    if not _contiguous_groups(p):
        return None, "act-order groups (permuted g_idx): no CPU kernel"
    bits = p.scheme.bits
    if bits == 4 and choice in ("auto", "int4"):
        if n % 16:
            return None, f"int4 kernel needs out_features divisible by 16 (got {n})"
        if _int4_group(p, k) is None:
            return None, (f"int4 kernel needs a group size of 32/64/128/256 dividing in_features "
                          f"(got {p.scheme.group_size}, in_features {k})")
        return "int4", INT4_KERNEL
    if bits == 8 and choice in ("auto", "int8-dynamic", "int8-weight-only"):
        if not p.scheme.symmetric or p.scheme.group_size is not None:
            return None, "int8 kernels need symmetric per-channel weights"
        if choice == "int8-dynamic":
            return "int8-dynamic", INT8_DYNAMIC_KERNEL
        # auto: weight-only keeps the checkpoint's W8A16 numerics, and measured faster at
        # batch-1 decode here (per-token activation quantization costs ~6 extra ops per Linear).
        return "int8-weight-only", INT8_WO_KERNEL
    return None, f"no CPU kernel for {p.scheme.label()} (kernel={choice})"


def _kernel_module(kind: str, module: torch.nn.Module, p: QuantParams) -> torch.nn.Module:
    w = weight_2d(module).detach().float()
    codes = quantize(w, p)  # exact: the weights are already on p's grid
    bias = getattr(module, "bias", None)
    if kind == "int4":
        n, k = w.shape
        g = _int4_group(p, k)
        scale, zero = p.scale.float(), p.zero
        if p.scheme.group_size is None:
            scale, zero = scale.expand(n, k // g), zero.expand(n, k // g)
        return Int4WeightOnlyLinear(codes, scale.contiguous(), zero.contiguous(), g, bias)
    if kind == "int8-dynamic":
        return Int8DynamicLinear(codes, p.scale.float(), bias)
    return Int8WeightOnlyLinear(codes, p.scale.float(), bias)


_AVAILABLE: dict[str, bool] = {}


def kernel_available(kind: str) -> bool:
    """Whether the kernel runs in this torch build on this CPU (probed once on tiny shapes)."""
    if kind not in _AVAILABLE:
        lin = torch.nn.Linear(64, 32)
        scheme = QuantScheme(bits=4 if kind == "int4" else 8, group_size=32 if kind == "int4" else None)
        p = compute_qparams(lin.weight.detach(), scheme)
        try:
            with torch.inference_mode():
                _kernel_module(kind, lin, p)(torch.randn(2, 64))
            _AVAILABLE[kind] = True
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            log.info("kernel %s unavailable: %s", kind, exc)
            _AVAILABLE[kind] = False
    return _AVAILABLE[kind]


@dataclass
class KernelSummary:
    kernel: str  # one line: what ran for the quantized Linears
    counts: dict[str, int]  # kernel name -> Linears that ran on it
    fallbacks: dict[str, str] = field(default_factory=dict)  # Linear -> why it ran in float

    def to_dict(self) -> dict:
        return asdict(self)


def float_summary(model: torch.nn.Module) -> KernelSummary:
    """What runs for a model with no quantized weights."""
    label = float_label(next(model.parameters()).dtype)
    return KernelSummary(kernel=f"{label}: no quantized weights", counts={})


def apply_kernels(model: torch.nn.Module, qparams: dict[str, QuantParams],
                  choice: KernelChoice = "auto") -> KernelSummary:
    """Swap quantized Linears of ``model`` (in place) for kernel modules; see the module doc."""
    if not qparams:
        return float_summary(model)
    dtype = next(model.parameters()).dtype
    counts: Counter[str] = Counter()
    fallbacks: dict[str, str] = {}
    for name, p in qparams.items():
        module = model.get_submodule(name)
        n, k = weight_2d(module).shape
        kind, reason = kernel_for(p, n, k, choice)
        if kind is not None and not kernel_available(kind):
            kind, reason = None, f"{reason}: not available in this torch build"
        if kind is None:
            counts[float_label(dtype)] += 1
            fallbacks[name] = reason
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, _kernel_module(kind, module, p))
        counts[reason] += 1
    if not fallbacks:
        kernel = next(iter(counts))
    elif len(fallbacks) == len(qparams):
        kernel = f"{float_label(dtype)} for all {len(qparams)} quantized Linears (dequantized weights)"
    else:
        kernel = "mixed: " + "; ".join(f"{v} x {k}" for k, v in counts.items())
    return KernelSummary(kernel=kernel, counts=dict(counts), fallbacks=fallbacks)


# --- timing ----------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _summary(ms: list[float]) -> dict:
    return {
        "p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95), "p99_ms": percentile(ms, 99),
        "mean_ms": sum(ms) / len(ms), "samples": len(ms),
    }


@dataclass
class LatencyResult:
    kernel: str
    kernels: dict[str, int]
    prompt_tokens: int
    new_tokens: int
    repeats: int
    threads: int
    prefill: dict  # p50/p95/p99/mean ms over repeats
    decode: dict  # p50/p95/p99/mean ms per token over every decoded token
    decode_tokens_per_s: float  # 1000 / median per-token latency
    prefill_tokens_per_s: float  # prompt tokens / median prefill time
    weights_mb: float  # parameters and buffers as the model ran (packed codes, not floats)
    peak_rss_mb: float | None  # this process's peak resident memory while this model ran
    peak_above_start_mb: float | None  # ... above its resident memory when the run began

    def to_dict(self) -> dict:
        return asdict(self)


@contextmanager
def _threads(n: int | None) -> Iterator[int]:
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _proc_mb(field_name: str) -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    # Writing 5 to clear_refs resets this process's high-water mark (VmHWM) to its current RSS.
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    hwm, rss = _proc_mb("VmHWM"), _proc_mb("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 1


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers, tied tensors once."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers 5 renamed ``past_key_values`` to ``cache`` (the old name warns).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def _one_run(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> tuple[float, list[float]]:
    kwarg = _cache_kwarg(model)
    t0 = time.perf_counter()
    out = model(input_ids=prompt, use_cache=True)
    prefill = time.perf_counter() - t0
    token = out.logits[:, -1:].argmax(dim=-1)
    steps = []
    for _ in range(new_tokens):
        cache = out.get("cache", None) or out.get("past_key_values", None)
        t0 = time.perf_counter()
        out = model(input_ids=token, use_cache=True, **{kwarg: cache})
        token = out.logits[:, -1:].argmax(dim=-1)
        steps.append(time.perf_counter() - t0)
    return prefill * 1000, [s * 1000 for s in steps]


def measure_latency(
    models: dict[str, tuple[torch.nn.Module, KernelSummary]],
    prompt: torch.Tensor,
    new_tokens: int = 32,
    repeats: int = 5,
    threads: int | None = None,
    on_run: Callable[[], None] | None = None,
) -> dict[str, LatencyResult]:
    """Prefill and per-token decode latency of each named model, batch 1, greedy decoding.

    Models take turns run by run, so a slowdown from other work on the machine falls on all
    of them alike rather than on whichever ran last.
    """
    if prompt.dim() == 1:
        prompt = prompt[None]
    if repeats < 1 or new_tokens < 1 or prompt.shape[1] < 1:
        raise ValueError("latency needs repeats >= 1, new_tokens >= 1 and a non-empty prompt")
    prefill: dict[str, list[float]] = {k: [] for k in models}
    decode: dict[str, list[float]] = {k: [] for k in models}
    peak: dict[str, tuple[float, float] | None] = {k: None for k in models}
    with _threads(threads) as n_threads:
        for model, _ in models.values():
            _one_run(model, prompt, min(4, new_tokens))  # warm-up: allocator, kernel dispatch
        for _ in range(repeats):
            for name, (model, _) in models.items():
                start = _proc_mb("VmRSS") if _reset_peak_rss() else None
                p, steps = _one_run(model, prompt, new_tokens)
                prefill[name].append(p)
                decode[name] += steps
                if on_run is not None:
                    on_run()
                hwm = _proc_mb("VmHWM")
                if start is not None and hwm is not None:
                    prev = peak[name] or (0.0, 0.0)
                    peak[name] = (max(prev[0], hwm), max(prev[1], hwm - start))
    results = {}
    for name, (model, summary) in models.items():
        pre, dec = _summary(prefill[name]), _summary(decode[name])
        results[name] = LatencyResult(
            kernel=summary.kernel, kernels=summary.counts, prompt_tokens=prompt.shape[1],
            new_tokens=new_tokens, repeats=repeats, threads=n_threads, prefill=pre, decode=dec,
            decode_tokens_per_s=1000 / dec["p50_ms"],
            prefill_tokens_per_s=1000 * prompt.shape[1] / pre["p50_ms"],
            weights_mb=round(model_bytes(model) / 2**20, 2),
            peak_rss_mb=None if peak[name] is None else round(peak[name][0], 1),
            peak_above_start_mb=None if peak[name] is None else round(peak[name][1], 1),
        )
    return results
