"""Recovery after compression: a short LoRA fine-tune with distillation from the float model.

The compressed model's Linears get LoRA adapters (:mod:`optc.compress.lora`); only the
adapters train. Pruned Linears train a masked update (their zeros never move); quantized
Linears train either against their fixed quantized weights (``export: adapter``: the adapter is
the correction, written beside the checkpoint in peft's format) or through their fixed grid
(``export: merge``: straight-through rounding, so the merged weights re-quantized onto the same
scales and zero points are exactly the trained ones and the checkpoint format is unchanged).

Training state (adapters, optimizer, RNG, step, loss history) is saved every ``save_every``
steps; a run started again with ``resume`` continues from the last saved step and ends with
the same weights as a run that was never interrupted (the data order is a function of the
seed and the step).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from optc.model.anatomy import select_linears, set_weight_2d, weight_2d
from optc.compress.actquant import input_quant_of
from optc.compress.lora import (
    cross_entropy,
    kd_loss,
    kd_loss_topk,
    lora_init,
    merged_weight,
    next_token_logp,
    topk_logits,
)
from optc.compress.masks import nm_violations
from optc.compress.quant import QuantParams, fake_quantize
from optc.errors import OptcError
from optc.methods.common import activation_checkpointing
from optc.progress import NullProgress, Progress

if TYPE_CHECKING:
    from optc.methods.recover import RecoverStage

log = logging.getLogger(__name__)

STATE_FILE = "state.safetensors"


class LoraLinear(nn.Module):
    """A frozen Linear (or GPT-2 Conv1D) ``base`` plus a trainable LoRA update.

    Without a mask or grid the update runs as its own low-rank path (the base weight needs no
    gradient, so the backward pass is cheap); with either, the effective weight is built
    explicitly, because ``M * (B A)`` is not low rank and ``Q(W0 + dW)`` is not linear in dW.
    """

    def __init__(
        self,
        base: nn.Module,
        a: torch.Tensor,
        b: torch.Tensor,
        scaling: float,
        mask: torch.Tensor | None,
        qparams: QuantParams | None,
        dropout: float,
    ) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(b)
        self.scaling = scaling
        self.mask = mask
        self.qparams = qparams
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    latent: torch.Tensor | None = None  # float weights whose rounding is the base (see float_latents)

    def effective_weight(self) -> torch.Tensor:
        w0 = weight_2d(self.base) if self.latent is None else self.latent
        return merged_weight(w0, self.lora_A, self.lora_B, self.scaling, self.mask, self.qparams)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w0, bias = weight_2d(self.base), self.base.bias
        if self.mask is None and self.qparams is None:
            low_rank = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)
            return F.linear(x, w0, bias) + low_rank * self.scaling
        return F.linear(x, self.effective_weight(), bias)


@dataclass
class Adapter:
    """A trained adapter kept separate from the checkpoint (``export: adapter``)."""

    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # Linear name -> (A [r, K], B [N, r])
    rank: int
    alpha: float
    dropout: float
    base_model: str
    conv1d: bool  # GPT-2 Conv1D weights are stored transposed (peft's fan_in_fan_out)
    base_weights: dict[str, torch.Tensor] = field(default_factory=dict)  # exact pre-merge weights


def check_recoverable(model: nn.Module, cfg: RecoverStage) -> dict[str, nn.Module]:
    """The Linears ``cfg`` adapts, refusing what cannot be trained (before any work)."""
    linears = select_linears(model, cfg.targets, cfg.ignore)
    for name, module in linears.items():
        n, k = weight_2d(module).shape
        if cfg.rank > min(n, k):
            raise OptcError(
                f"LoRA rank {cfg.rank} is larger than {name} ({n} x {k}) allows: rank must be "
                f"at most {min(n, k)} (lower --rank or exclude the Linear with ignore)"
            )
    quantized_inputs = sorted(set(input_quant_of(model)) & set(linears))
    if quantized_inputs:
        raise OptcError(
            f"recovery trains through float activations; {quantized_inputs[0]} has quantized "
            "inputs (W8A8): recover before the w8a8 stage or exclude it with ignore"
        )
    return linears


def float_latents(
    teacher: nn.Module | None, linears: dict[str, nn.Module], qparams: dict[str, QuantParams]
) -> dict[str, torch.Tensor]:
    """The teacher's float weights of the quantized Linears whose rounding onto their grid
    is exactly the quantized weight (RTN; not GPTQ, which moved the codes).

    Training ``Q(W + dW)`` from the quantized ``W`` itself starts every weight at the centre of
    its rounding interval, half a step from any other code, so a small update changes nothing;
    from the float ``W`` the weights that were nearly rounded the other way flip first."""
    if teacher is None:
        return {}
    found = {}
    for name, module in linears.items():
        p = qparams.get(name)
        if p is None:
            continue
        try:
            w = weight_2d(teacher.get_submodule(name)).detach()
        except AttributeError:
            continue
        if w.shape == weight_2d(module).shape and torch.equal(fake_quantize(w, p), weight_2d(module).detach()):
            found[name] = w
    return found


def attach_adapters(
    model: nn.Module,
    linears: dict[str, nn.Module],
    cfg: RecoverStage,
    masks: Mapping[str, torch.Tensor],
    qparams: dict[str, QuantParams],
    latents: dict[str, torch.Tensor] | None = None,
) -> dict[str, LoraLinear]:
    """Replace each Linear by a :class:`LoraLinear`; every other parameter is frozen."""
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(cfg.seed)
    grid = cfg.export == "merge"  # adapter export: train against the fixed quantized weights
    wrappers: dict[str, LoraLinear] = {}
    for name in sorted(linears):
        base = linears[name]
        w0 = weight_2d(base)
        a, b = lora_init(cfg.rank, w0.shape[1], w0.shape[0], g)
        mask = masks.get(name)
        wrap = LoraLinear(
            base, a.to(w0.dtype), b.to(w0.dtype), cfg.alpha / cfg.rank,
            None if mask is None else mask.to(w0.device), qparams.get(name) if grid else None,
            cfg.dropout,
        )
        if grid and latents and name in latents:
            wrap.latent = latents[name]
        _replace(model, name, wrap)
        wrappers[name] = wrap
    return wrappers


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def merge_adapters(model: nn.Module, wrappers: dict[str, LoraLinear], keep_base: bool) -> tuple[dict[str, dict], dict]:
    """Write each effective weight into its Linear and put the Linear back.

    Returns per-Linear statistics and, when ``keep_base``, the exact weights before merging
    (to restore for an adapter export)."""
    stats: dict[str, dict] = {}
    base_weights: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, wrap in wrappers.items():
            w0 = weight_2d(wrap.base).detach().clone()
            w = wrap.effective_weight().detach()
            set_weight_2d(wrap.base, w)
            _replace(model, name, wrap.base)
            if keep_base:
                base_weights[name] = w0
            entry = {"delta_rel": round(float((w - w0).norm() / w0.norm().clamp_min(1e-12)), 6)}
            if wrap.qparams is not None:
                entry["codes_changed"] = round(float((w != w0).float().mean()), 6)
            stats[name] = entry
    return stats, base_weights


def restore_base(model: nn.Module, adapter: Adapter) -> None:
    """Put the pre-recovery weights back (the checkpoint of an adapter export holds them)."""
    for name, w in adapter.base_weights.items():
        set_weight_2d(model.get_submodule(name), w)


def write_adapter(adapter: Adapter, directory: Path) -> list[str]:
    """``adapter_config.json`` + ``adapter_model.safetensors`` in peft's LoRA format."""
    from peft import LoraConfig

    config = LoraConfig(
        r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
        target_modules=sorted(adapter.tensors), bias="none", task_type="CAUSAL_LM",
        fan_in_fan_out=adapter.conv1d,
    )
    config.base_model_name_or_path = adapter.base_model
    config.save_pretrained(str(directory))
    tensors = {}
    for name, (a, b) in adapter.tensors.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.detach().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach().contiguous()
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return ["adapter_config.json", "adapter_model.safetensors"]


# --- training -------------------------------------------------------------------------------


def _order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Chunk indices of ``step``'s batch: a fresh seeded permutation of the chunks per epoch,
    so the order depends only on (seed, step) and a resumed run reads the same batches."""
    out, orders = [], {}
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch = pos // n
        if epoch not in orders:
            orders[epoch] = _order(n, seed, epoch)
        out.append(int(orders[epoch][pos % n]))
    return out


def total_steps(cfg: RecoverStage, seqlen: int) -> int | None:
    """The step budget from ``steps`` and ``tokens`` (None: only ``max_minutes`` bounds it)."""
    limits = []
    if cfg.steps is not None:
        limits.append(cfg.steps)
    if cfg.tokens is not None:
        limits.append(max(1, math.ceil(cfg.tokens / (cfg.batch_size * seqlen))))
    return min(limits) if limits else None


def learning_rate(cfg: RecoverStage, fraction: float) -> float:
    """Linear warm-up over the first ``warmup`` of the run, then cosine decay to 10%."""
    if cfg.warmup and fraction < cfg.warmup:
        return cfg.lr * max(fraction / cfg.warmup, 0.02)
    t = (fraction - cfg.warmup) / max(1e-12, 1 - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t))))


def _fingerprint(cfg: RecoverStage, chunks: torch.Tensor, names: list[str]) -> str:
    # What decides the trajectory; budgets that only stop it early (max_minutes) and the
    # bookkeeping fields may change between an interrupted run and its resumption.
    fields = cfg.model_dump(mode="json", exclude={"resume", "save_every", "state_dir", "max_minutes", "eval_before"})
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    digest.update(chunks.numpy().tobytes())
    digest.update("\n".join(names).encode())
    return digest.hexdigest()[:20]


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` as JSON, its tensors moved to ``tensors`` (safetensors holds no pickles)."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {"__items__": [[k, _encode(v, tensors)] for k, v in obj.items()]}  # optimizer: int keys
    if isinstance(obj, list | tuple):
        return [_encode(v, tensors) for v in obj]
    return obj


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__items__" in obj:
            return {k: _decode(v, tensors) for k, v in obj["__items__"]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


def _save_state(path: Path, state: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors)
    save_file(tensors, str(tmp), metadata={"optc_state": json.dumps(tree)})
    os.replace(tmp, path)  # a reader (or an interrupt) never sees half a state file


def _read_state(path: Path) -> Any:
    with safe_open(str(path), framework="pt") as f:
        tree = json.loads((f.metadata() or {})["optc_state"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return _decode(tree, tensors)


def check_resumable(state_dir: Path | None) -> None:
    """Refuse ``resume`` without a saved state to resume from."""
    if state_dir is None:
        raise OptcError("resume needs a state directory (--state-dir, or the --output whose run it resumes)")
    if not (Path(state_dir) / STATE_FILE).is_file():
        raise OptcError(f"resume: no saved recovery state in {state_dir} (start without --resume)")


def _load_state(path: Path, fingerprint: str) -> dict:
    check_resumable(path.parent)
    try:
        state = _read_state(path)
    except (OSError, RuntimeError, EOFError, KeyError, ValueError, SafetensorError) as exc:
        raise OptcError(f"resume: {path} is unreadable ({exc})") from None
    if state.get("fingerprint") != fingerprint:
        raise OptcError(
            f"resume: the state in {path.parent} belongs to a different recovery run (other "
            "settings, data or Linears); start without --resume or use another --state-dir"
        )
    return state


class _TeacherCache:
    """Top-k teacher logits of each training chunk, computed once and kept on disk."""

    def __init__(self, directory: Path, k: int, key: str) -> None:
        self.dir, self.k = directory, k
        self.dir.mkdir(parents=True, exist_ok=True)
        stamp = self.dir / "key.txt"
        if not stamp.is_file() or stamp.read_text() != key:
            for f in self.dir.glob("chunk-*.safetensors"):
                f.unlink()
            stamp.write_text(key)

    def get(self, teacher: nn.Module, chunks: torch.Tensor, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        values, index = [], []
        for i in idx:
            path = self.dir / f"chunk-{i}.safetensors"
            if path.is_file():
                v, j = _read_state(path)
            else:
                with torch.no_grad():
                    logits = teacher(input_ids=chunks[i : i + 1], use_cache=False).logits
                v, j = topk_logits(logits[0], self.k)
                _save_state(path, (v, j))
            values.append(v)
            index.append(j)
        return torch.stack(values), torch.stack(index)


def train_adapters(
    model: nn.Module,
    wrappers: dict[str, LoraLinear],
    teacher: nn.Module | None,
    chunks: torch.Tensor,
    cfg: RecoverStage,
    state_dir: Path | None,
    progress: Progress | None = None,
) -> dict:
    """Train the adapters on ``chunks`` ([n, seqlen] token ids); returns the run's statistics."""
    progress = progress or NullProgress()
    n, seqlen = chunks.shape
    limit = total_steps(cfg, seqlen)
    budget = None if cfg.max_minutes is None else 60.0 * cfg.max_minutes
    params = [p for w in wrappers.values() for p in (w.lora_A, w.lora_B)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    names = sorted(wrappers)
    fingerprint = _fingerprint(cfg, chunks, names)
    state_path = None if state_dir is None else Path(state_dir) / STATE_FILE
    step, losses, spent = 0, [], 0.0
    if cfg.resume:
        check_resumable(state_dir)
        state = _load_state(state_path, fingerprint)
        with torch.no_grad():
            for name in names:
                a, b = state["adapters"][name]
                wrappers[name].lora_A.copy_(a)
                wrappers[name].lora_B.copy_(b)
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step, losses, spent = state["step"], state["losses"], state["seconds"]
        log.info("resuming recovery at step %d", step)
    cache = None
    if cfg.loss != "ce" and cfg.teacher_cache == "topk":
        if state_dir is None:
            raise OptcError("teacher_cache: topk needs a state directory to keep the logits in")
        cache = _TeacherCache(Path(state_dir) / f"teacher-top{cfg.teacher_topk}", cfg.teacher_topk, fingerprint)
    model.train()
    t0, start_step = time.perf_counter(), step
    stopped = "steps"

    def save() -> None:
        if state_path is None:
            return
        _save_state(state_path, {
            "fingerprint": fingerprint, "step": step, "losses": losses,
            "seconds": spent + time.perf_counter() - t0,
            "adapters": {nm: (wrappers[nm].lora_A.detach().clone(), wrappers[nm].lora_B.detach().clone()) for nm in names},
            "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
        })

    try:
        with (activation_checkpointing(model, cfg.gradient_checkpointing),
              progress.task("recover", total=limit) as advance):
            for _ in range(step):
                advance()  # a resumed bar starts where the saved run stopped
            while limit is None or step < limit:
                elapsed = spent + time.perf_counter() - t0
                if budget is not None and elapsed >= budget:
                    stopped = "max_minutes"
                    break
                fraction = max(step / limit if limit else 0.0, elapsed / budget if budget else 0.0)
                for group in opt.param_groups:
                    group["lr"] = learning_rate(cfg, fraction)
                idx = batch_indices(n, cfg.batch_size, step, cfg.seed)
                ids = chunks[idx]
                loss = _loss(model, teacher, cache, chunks, idx, ids, cfg)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                opt.step()
                losses.append(round(loss.item(), 5))
                step += 1
                if cfg.save_every and step % cfg.save_every == 0:
                    save()
                recent = losses[-10:]
                advance(f"loss {sum(recent) / len(recent):.3f}")
    finally:
        model.eval()
        for p in params:
            p.requires_grad_(False)
    seconds = spent + time.perf_counter() - t0
    if state_path is not None and state_path.exists():
        state_path.unlink()  # finished: nothing left to resume
    tokens = step * cfg.batch_size * seqlen
    run_steps = step - start_step
    return {
        "steps": step, "tokens": tokens, "seconds": round(seconds, 2), "stopped_by": stopped,
        "steps_per_second": round(run_steps / max(1e-9, time.perf_counter() - t0), 4),
        "resumed_at": start_step if cfg.resume else None,
        # Means over the first and last tenth of the run (at most 10 steps each).
        "loss_start": _mean(losses[: _edge(losses)]), "loss_end": _mean(losses[-_edge(losses):]),
        "loss_curve": _downsample(losses, 50),
    }


def _loss(model, teacher, cache, chunks, idx, ids, cfg: RecoverStage) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False).logits
    # One student log-softmax serves both terms when they share the temperature (it is the
    # largest tensor of the step: batch x seqlen x vocabulary).
    logp = next_token_logp(logits) if cfg.loss != "kd" or cfg.temperature == 1.0 else None
    ce = cross_entropy(logits, ids, logp) if cfg.loss != "kd" else None
    if cfg.loss == "ce":
        return ce
    s_logp = logp if cfg.temperature == 1.0 else None
    if cache is not None:
        values, index = cache.get(teacher, chunks, idx)
        kd = kd_loss_topk(logits, values, index, cfg.temperature, s_logp)
    else:
        with torch.no_grad():
            t_logits = teacher(input_ids=ids, use_cache=False).logits
        kd = kd_loss(logits, t_logits, cfg.temperature, s_logp)
    if cfg.loss == "kd":
        return kd
    return (1 - cfg.kd_weight) * ce + cfg.kd_weight * kd


def _edge(xs: list[float]) -> int:
    return max(1, min(10, len(xs) // 10))


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 5) if xs else None


def _downsample(xs: list[float], points: int) -> list[float]:
    """Means of ``points`` consecutive stretches of the loss history (the curve to plot)."""
    if len(xs) <= points:
        return list(xs)
    edges = [round(i * len(xs) / points) for i in range(points + 1)]
    return [round(sum(xs[a:b]) / (b - a), 5) for a, b in zip(edges, edges[1:])]


def pattern_violations(model: nn.Module, names: list[str], nm: tuple[int, int] | None) -> int:
    """N:M groups broken after merging (0 when the masked update kept the pattern)."""
    if nm is None:
        return 0
    return sum(nm_violations(weight_2d(model.get_submodule(n)).detach(), *nm) for n in names)

