"""Structured pruning: remove whole attention heads (or key/value groups) and MLP channels,
so the model's matrices really shrink and ``config.json`` stays a standard config.

Importance is activation-aware and exact for one unit at a time: the expected squared
contribution of a unit to the residual stream, read from the input Hessian
``H = 2 X X^T / n`` of the output projection (``o_proj`` / ``down_proj``), the same
``HessianAccumulator`` GPTQ and SparseGPT use. For an MLP channel ``j`` it is
``||W[:, j]||^2 H_jj``; for a head, ``tr(W_h H_hh W_h^T)`` over its ``head_dim`` columns.

After the units are chosen, the output projection is refit by least squares on the kept
inputs, ``W' = W H_{:,S} H_SS^{-1}``: the structured counterpart of SparseGPT's reconstruction
(it equals the OBS update for removing a whole group of columns, as used by ZipLM, Kurtic
et al., 2023), which lets the kept units absorb what the removed ones carried whenever
their activations correlate.

Layouts (which Linears hold which units) are data, as AWQ's mappings are. Every layer
loses the same number of units (which ones is chosen per layer), so one config describes
the whole pruned model.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from optc.model.anatomy import weight_2d
from optc.errors import OptcError

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Importance and reconstruction (pure tensor functions)


def channel_importance(W: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """``E||W[:, j] x_j||^2 = ||W[:, j]||^2 H_jj / 2`` per input channel ``j`` of ``W`` [N, K]."""
    return W.detach().float().pow(2).sum(dim=0) * torch.diag(H).float().to(W.device) / 2


def head_importance(W: torch.Tensor, H: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``E||W_h x_h||^2 = tr(W_h H_hh W_h^T) / 2`` per head ``h`` (``head_dim`` input columns
    each) of the attention output projection ``W`` [N, heads * head_dim]."""
    n, k = W.shape
    if k % head_dim:
        raise ValueError(f"{k} input columns do not split into heads of {head_dim}")
    heads = k // head_dim
    Wh = W.detach().float().reshape(n, heads, head_dim).transpose(0, 1)  # [heads, N, d]
    Hh = torch.stack([H[h * head_dim : (h + 1) * head_dim, h * head_dim : (h + 1) * head_dim]
                      for h in range(heads)]).float().to(W.device)  # [heads, d, d]
    return ((Wh @ Hh) * Wh).sum(dim=(1, 2)) / 2


def reconstruct(
    W: torch.Tensor, H: torch.Tensor, keep: torch.Tensor, dampening: float = 0.01
) -> torch.Tensor:
    """Least-squares refit of ``W`` [N, K] on the kept input columns ``keep`` (indices):
    ``argmin_W' ||W X - W' X_S||^2 = W H_{:,S} (H_SS + lambda I)^{-1}``, ``[N, |S|]``.

    ``lambda`` is ``dampening`` times the mean of ``diag(H_SS)``, as in GPTQ, so channels that
    never fired keep their weights instead of blowing up.
    """
    Wf = W.detach().float()
    Hf = H.detach().float().to(W.device)
    Hs = Hf[keep][:, keep].clone()
    diag = torch.arange(Hs.shape[0], device=Hs.device)
    Hs[diag, diag] += dampening * torch.diag(Hs).mean().clamp_min(1e-12)
    rhs = Wf @ Hf[:, keep]  # [N, |S|]
    L, info = torch.linalg.cholesky_ex(Hs)
    if info != 0:
        raise OptcError("structured pruning: the kept channels' Hessian is not positive definite")
    # Hs is symmetric, so W' Hs = rhs  <=>  Hs W'^T = rhs^T.
    return torch.cholesky_solve(rhs.T, L).T.to(W.dtype)


def keep_lowest_removed(importance: torch.Tensor, remove: int) -> torch.Tensor:
    """Sorted indices of the units kept when the ``remove`` least important go."""
    order = torch.argsort(importance, descending=True, stable=True)
    return order[: importance.numel() - remove].sort().values


def select_heads(
    importance: torch.Tensor, kv_heads: int, remove_per_group: int = 0, remove_groups: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept query heads and kept key/value heads.

    Query head ``h`` reads key/value head ``h // (heads / kv_heads)`` (transformers'
    ``repeat_kv``). Either whole groups go (the ``remove_groups`` groups of least total
    importance, with their key/value head), or every group loses its ``remove_per_group``
    least important query heads, so all groups stay equal and GQA stays valid.
    """
    heads = importance.numel()
    rep = heads // kv_heads
    per_group = importance.reshape(kv_heads, rep)
    kept_groups = keep_lowest_removed(per_group.sum(dim=1), remove_groups)
    q = []
    for g in kept_groups.tolist():
        q.append(keep_lowest_removed(per_group[g], remove_per_group) + g * rep)
    return torch.cat(q), kept_groups


# --------------------------------------------------------------------------------------------
# Layouts (data) and model surgery


@dataclass(frozen=True)
class AttentionLayout:
    q: str
    k: str
    v: str
    o: str


@dataclass(frozen=True)
class MLPLayout:
    up: tuple[str, ...]  # Linears whose output rows are the channels
    down: str  # the Linear whose input columns are the channels
    config_key: str  # config field holding the channel count


ATTENTION_LAYOUTS = (
    # Llama, Qwen2, Mistral: head_dim is a config field, so heads can go without it changing.
    AttentionLayout("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
)
MLP_LAYOUTS = (
    MLPLayout(("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj", "intermediate_size"),  # Llama family
    MLPLayout(("fc1",), "fc2", "ffn_dim"),  # OPT
    MLPLayout(("mlp.c_fc",), "mlp.c_proj", "n_inner"),  # GPT-2 (Conv1D)
)


def _has(layer: nn.Module, names: Sequence[str]) -> bool:
    mods = dict(layer.named_modules())
    return all(n in mods for n in names)


def mlp_layout(layer: nn.Module) -> MLPLayout:
    for lay in MLP_LAYOUTS:
        if _has(layer, (*lay.up, lay.down)):
            return lay
    raise OptcError(
        f"structured pruning does not know the MLP of {type(layer).__name__} "
        f"(known: {', '.join('/'.join((*m.up, m.down)) for m in MLP_LAYOUTS)})"
    )


def attention_layout(layer: nn.Module, config) -> AttentionLayout:
    """The attention layout, refused where the config derives ``head_dim`` from the head count
    (OPT, GPT-2): there, fewer heads cannot be described by a standard config."""
    for lay in ATTENTION_LAYOUTS:
        if _has(layer, (lay.q, lay.k, lay.v, lay.o)):
            attn = layer.get_submodule(lay.q.rpartition(".")[0])
            if getattr(attn, "head_dim", None) and hasattr(attn, "num_key_value_groups"):
                return lay
    raise OptcError(
        f"head pruning is not available for {type(config).__name__}: its attention derives "
        "head_dim from hidden_size / num_attention_heads, so a model with fewer heads has no "
        "standard config (MLP channel pruning works)"
    )


def _slice_linear(module: nn.Module, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None,
                  weight: torch.Tensor | None = None) -> nn.Module:
    """A new Linear (or Conv1D) holding ``module``'s rows/cols (or ``weight`` [N', K'])."""
    w = weight_2d(module).detach()
    if rows is not None:
        w = w[rows]
    if cols is not None:
        w = w[:, cols]
    if weight is not None:
        w = weight
    bias = getattr(module, "bias", None)
    if bias is not None and rows is not None:
        bias = bias.detach()[rows]
    out_f, in_f = w.shape
    if isinstance(module, Conv1D):
        new = Conv1D(out_f, in_f).to(device=w.device, dtype=module.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(w.t())
            new.bias.copy_(bias if bias is not None else torch.zeros(out_f))
        return new
    new = nn.Linear(in_f, out_f, bias=bias is not None, device="meta", dtype=module.weight.dtype)
    new.weight = nn.Parameter(_reuse_storage(module.weight.detach(), w), requires_grad=module.weight.requires_grad)
    if bias is not None:
        new.bias = nn.Parameter(bias.clone(), requires_grad=module.bias.requires_grad)
    return new


def _reuse_storage(old: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w`` written over the front of ``old``'s buffer (``w`` has fewer elements).

    A loaded model's weights are views of the memory-mapped checkpoint, whose pages stay resident
    after the tensor that used them is dropped: a freshly allocated smaller weight per Linear grew
    the structured run's peak RSS by most of the pruned model's size. Writing into the old buffer
    keeps the process at one copy.
    """
    if not old.is_contiguous() or old.dtype != w.dtype or old.device != w.device:
        return w.contiguous().clone()
    front = old.view(-1)[: w.numel()]
    w = w.contiguous()
    if w.data_ptr() == front.data_ptr():  # nothing to move
        return front.view(w.shape)
    front.copy_(w.clone().view(-1) if _overlaps(w, old) else w.view(-1))
    return front.view(w.shape)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _replace(layer: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(layer.get_submodule(parent) if parent else layer, attr, new)


def _rows_of(units: torch.Tensor, size: int) -> torch.Tensor:
    """Row indices of ``units`` that are ``size`` rows each."""
    return (units[:, None] * size + torch.arange(size, device=units.device)[None, :]).flatten()


@dataclass
class Surgery:
    """What was removed from one layer: kept indices per (layer-relative) Linear name."""

    rows: dict[str, torch.Tensor]
    cols: dict[str, torch.Tensor]


def prune_mlp_channels(
    layer: nn.Module, layout: MLPLayout, keep: torch.Tensor, down_weight: torch.Tensor | None = None
) -> Surgery:
    """Keep MLP channels ``keep`` (indices): rows of the up Linears, columns of down
    (``down_weight``, when given, replaces down's kept columns, e.g. a refit)."""
    for name in layout.up:
        _replace(layer, name, _slice_linear(layer.get_submodule(name), rows=keep))
    down = layer.get_submodule(layout.down)
    _replace(layer, layout.down, _slice_linear(down, cols=keep, weight=down_weight))
    return Surgery({n: keep for n in layout.up}, {layout.down: keep})


def prune_attention_heads(
    layer: nn.Module, layout: AttentionLayout, keep_q: torch.Tensor, keep_kv: torch.Tensor,
    o_weight: torch.Tensor | None = None,
) -> Surgery:
    """Keep query heads ``keep_q`` and key/value heads ``keep_kv`` (indices, in order)."""
    attn = layer.get_submodule(layout.q.rpartition(".")[0])
    hd = attn.head_dim
    q_rows, kv_rows = _rows_of(keep_q, hd), _rows_of(keep_kv, hd)
    _replace(layer, layout.q, _slice_linear(layer.get_submodule(layout.q), rows=q_rows))
    _replace(layer, layout.k, _slice_linear(layer.get_submodule(layout.k), rows=kv_rows))
    _replace(layer, layout.v, _slice_linear(layer.get_submodule(layout.v), rows=kv_rows))
    _replace(layer, layout.o, _slice_linear(layer.get_submodule(layout.o), cols=q_rows, weight=o_weight))
    # repeat_kv reads this per module; everything else reshapes with -1 heads.
    attn.num_key_value_groups = keep_q.numel() // keep_kv.numel()
    return Surgery({layout.q: q_rows, layout.k: kv_rows, layout.v: kv_rows}, {layout.o: q_rows})


@torch.inference_mode()
def forward_latency(model: nn.Module, tokens: int = 256, repeats: int = 5) -> float:
    """Median seconds of one forward of ``model`` over ``tokens`` fixed token ids, after one
    untimed warm-up (the median resists the outliers of a shared machine)."""
    vocab = int(getattr(model.config, "vocab_size", 100))
    ids = ((torch.arange(tokens) * 7919) % vocab)[None, :].to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        model(ids, use_cache=False)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids, use_cache=False)
            times.append(time.perf_counter() - t0)
    finally:
        model.train(was_training)
    return statistics.median(times)


@dataclass
class StructuredPlan:
    """How many units every decoder layer loses (the same in all layers)."""

    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    remove_per_group: int = 0  # query heads removed from every key/value group
    remove_groups: int = 0  # key/value groups removed with all their query heads
    channels: int = 0
    remove_channels: int = 0
    attention: AttentionLayout | None = None
    mlp: MLPLayout | None = None

    @property
    def new_kv_heads(self) -> int:
        return self.kv_heads - self.remove_groups

    @property
    def new_heads(self) -> int:
        return self.new_kv_heads * (self.heads // self.kv_heads - self.remove_per_group)

    @property
    def new_channels(self) -> int:
        return self.channels - self.remove_channels


def _count(fraction: float, total: int) -> int:
    return int(fraction * total + 0.5)  # round half up: 0.25 of 3 heads is 1


def plan_structured(
    model: nn.Module, layer: nn.Module, *, heads: float = 0.0, kv_heads: float = 0.0,
    mlp: float = 0.0, channel_multiple: int = 1,
) -> StructuredPlan:
    """Turn removal fractions into per-layer counts, refusing what cannot be built: a
    fraction that removes nothing, or one that removes every head / group / channel."""
    cfg = model.config
    plan = StructuredPlan()
    if heads or kv_heads:
        plan.attention = attention_layout(layer, cfg)
        attn = layer.get_submodule(plan.attention.q.rpartition(".")[0])
        plan.heads = cfg.num_attention_heads
        plan.kv_heads = getattr(cfg, "num_key_value_heads", None) or plan.heads
        plan.head_dim = attn.head_dim
        rep = plan.heads // plan.kv_heads
        plan.remove_groups = _count(kv_heads, plan.kv_heads)
        if rep == 1:  # plain multi-head attention: a head is its own key/value group
            plan.remove_groups = _count(max(heads, kv_heads), plan.kv_heads)
        else:
            plan.remove_per_group = _count(heads, rep)
            if heads and not plan.remove_per_group:
                raise OptcError(
                    f"heads={heads} removes no head: each of the {plan.kv_heads} key/value groups "
                    f"has {rep} query heads, so the smallest step is 1/{rep}"
                )
            if plan.remove_per_group >= rep:
                raise OptcError(f"heads={heads} would prune every query head of each layer")
        if (kv_heads or rep == 1) and not plan.remove_groups:
            raise OptcError(
                f"{'kv_heads' if kv_heads else 'heads'}={kv_heads or heads} removes no head: "
                f"there are {plan.kv_heads} key/value groups, so the smallest step is 1/{plan.kv_heads}"
            )
        if plan.remove_groups >= plan.kv_heads:
            raise OptcError(f"kv_heads={kv_heads or heads} would prune every head of each layer")
    if mlp:
        plan.mlp = mlp_layout(layer)
        plan.channels = weight_2d(layer.get_submodule(plan.mlp.down)).shape[1]
        keep = plan.channels - _count(mlp, plan.channels)
        keep -= keep % channel_multiple
        if keep <= 0:
            raise OptcError(f"mlp={mlp} would prune every MLP channel of each layer")
        plan.remove_channels = plan.channels - keep
        if not plan.remove_channels:
            raise OptcError(f"mlp={mlp} removes no channel of {plan.channels}")
    return plan


def apply_plan_to_config(config, plan: StructuredPlan) -> dict:
    """Write the new shapes into ``config`` (so ``save_pretrained`` writes them); returns them."""
    changed: dict = {}
    if plan.attention is not None:
        # head_dim must be explicit: with fewer heads, hidden_size / heads no longer gives it.
        changed.update(head_dim=plan.head_dim, num_attention_heads=plan.new_heads,
                       num_key_value_heads=plan.new_kv_heads)
    if plan.mlp is not None:
        changed[plan.mlp.config_key] = plan.new_channels
    for key, value in changed.items():
        setattr(config, key, value)
    return changed
