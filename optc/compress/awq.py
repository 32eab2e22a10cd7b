"""AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration") as pure functions, plus the per-architecture scaling mappings kept as data.

Section numbers refer to the paper. The search details (group-normalised ``w_mean``, duo
scaling, ``s / sqrt(max * min)`` normalisation, per-group clip search) follow the authors'
reference code as carried on by AutoAWQ and llm-compressor, so that our scales mean the same.
Where we differ, on purpose: both searches measure the output error on every calibration token
through the input's Gram matrix (the reference samples tokens), and the scale is chosen for the
clipped quantizer that will be used.

Conventions: ``X`` is ``[T, K]`` (tokens, in_features), weights are ``[N, K]`` as in
``nn.Linear``; groups run along ``K`` and the last one may be shorter (see ``quant``).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from optc.model.anatomy import weight_2d
from optc.compress.quant import QuantScheme, compute_qparams, fake_quantize, group_view
from optc.errors import OptcError

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# §3.2 scale search


@dataclass
class AWQScaleResult:
    scale: torch.Tensor  # s [K] float32; all ones when no scaling beat the unscaled weights
    ratio: float  # best alpha (0.0 when the unscaled weights won)
    loss: float  # output MSE with the chosen s
    loss_no_scale: float  # output MSE of plain RTN (s = 1)
    # per weight: awq_search_clip's ranges for W s, where the search computed them (else None)
    clip: list[torch.Tensor | None] | None = None


def gram(X: torch.Tensor) -> torch.Tensor:
    """``G = X^T X / T`` of activations ``[..., K]``: the statistic both searches take."""
    x = X.detach().reshape(-1, X.shape[-1]).float()
    return x.T @ x / max(1, x.shape[0])


def _output_mse(D: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Mean squared output error ``||X D^T||^2 / (T N)`` of a weight error ``D`` [N, K]."""
    return ((D @ G) * D).sum() / D.shape[0]


def awq_search_scale(
    G: torch.Tensor,
    x_mean: torch.Tensor,
    weights: Sequence[torch.Tensor],
    scheme: QuantScheme,
    *,
    grid: int = 20,
    duo_scaling: bool = True,
    clip: Sequence[bool] | None = None,
    refine: int = 3,
) -> AWQScaleResult:
    """Per-input-channel scale ``s`` for Linears that share one input (§3.2).

    ``G`` is the input's Gram matrix ``X^T X / T`` over every calibration token and
    ``x_mean`` its mean ``|x|`` per channel. Searches ``s = x_mean^alpha / w_mean^(1 - alpha)``
    (``duo_scaling``; else ``x_mean^alpha``) over ``alpha = i / grid``, minimising the
    output error ``|| X W^T - (X / s) Q(W s)^T ||^2 = tr(D G D^T)``, ``D = W - Q(W s) / s``,
    over all rows of all ``weights``. ``s = 1`` is always a candidate, so the result never
    does worse than plain RTN.

    ``clip[i]`` says that ``weights[i]`` will be quantized with :func:`awq_search_clip`'s
    ranges: the ``refine`` best candidates (and ``s = 1``) are then measured again with their
    own clip search, so ``s`` is chosen for the quantizer that will really be used (the
    reference code searches ``s`` with plain min-max grids and clips afterwards).
    """
    G = G.float()
    ws_ = [wi.detach().float().to(G.device) for wi in weights]
    clip = [False] * len(ws_) if clip is None else list(clip)
    if len(clip) != len(ws_):
        raise ValueError(f"clip has {len(clip)} entries for {len(ws_)} weights")
    w = torch.cat(ws_, dim=0)
    x_mean = x_mean.float().to(G.device)
    # w_mean: |W| normalised by each (row, group)'s max, then averaged over rows; the
    # reference code's measure of how salient each input channel is to the weights.
    # Zero columns add nothing to abs-max, dot products or squared errors.
    aw = group_view(w.abs(), scheme.group_size)
    w_mean = (aw / (aw.amax(dim=-1, keepdim=True) + 1e-6)).flatten(1)[:, : w.shape[1]].mean(0)

    def loss_of(s: torch.Tensor, with_clip: bool) -> tuple[float, list[torch.Tensor | None]]:
        # Q(W s) / s applied to X equals Q(W s) applied to X / s.
        Gs = scaled_gram(G, s) if with_clip else G
        err, ranges = 0.0, []
        for wi, ci in zip(ws_, clip):
            wsi = wi * s
            rng = awq_search_clip(Gs, wsi, scheme) if ci and with_clip else None
            w_hat = fake_quantize(wsi, compute_qparams(wsi, scheme, clip=1.0 if rng is None else rng)) / s
            err += _output_mse(wi - w_hat, G).item() * wi.shape[0]
            ranges.append(rng)
        return err / w.shape[0], ranges

    ones = torch.ones_like(x_mean)
    candidates: list[tuple[float, torch.Tensor]] = []
    for i in range(grid):
        alpha = i / grid
        if duo_scaling:
            s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        else:
            s = x_mean.pow(alpha).clamp(min=1e-4)
        # Centre s in log space so neither the weights nor the folded norm blow up.
        s = s / (s.max() * s.min()).sqrt()
        candidates.append((alpha, torch.where(torch.isfinite(s), s, ones)))
    plain = [loss_of(s, False) for _, s in candidates]
    if any(clip):
        # A clip search per candidate costs about ten plain measurements: the grid is ranked
        # with min-max grids and only its best few are measured with clipping.
        order = sorted(range(grid), key=lambda i: plain[i][0])[:refine]
        unscaled = loss_of(ones, True)
        measured = [(candidates[i], loss_of(candidates[i][1], True)) for i in order]
    else:
        unscaled = loss_of(ones, False)
        measured = list(zip(candidates, plain))
    loss_no_scale = unscaled[0]
    best = AWQScaleResult(ones, 0.0, loss_no_scale, loss_no_scale, unscaled[1])
    for (alpha, s), (loss, ranges) in measured:
        if loss < best.loss:
            best = AWQScaleResult(s, alpha, loss, loss_no_scale, ranges)
    log.debug("awq scale: alpha=%.2f loss %.4g (rtn %.4g)", best.ratio, best.loss, loss_no_scale)
    return best


def scaled_gram(G: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The Gram matrix of ``X / s`` (the input the scaled weights ``W s`` see)."""
    inv = 1.0 / s.float().to(G.device)
    return G * inv[:, None] * inv[None, :]


# --------------------------------------------------------------------------------------------
# Weight clipping (the reference code's ``auto_clip``)


def _group_blocks(G: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """The diagonal ``g x g`` blocks of ``G`` [K, K] as ``[groups, g, g]`` (a short last
    group zero-padded, which adds nothing to any error)."""
    k = G.shape[0]
    g = k if group_size is None else group_size
    groups = math.ceil(k / g)
    pad = groups * g - k
    Gp = nn.functional.pad(G, (0, pad, 0, pad)) if pad else G
    idx = torch.arange(groups, device=G.device)
    return Gp.reshape(groups, g, groups, g)[idx, :, idx, :]


def awq_search_clip(
    G: torch.Tensor,
    W: torch.Tensor,
    scheme: QuantScheme,
    *,
    grid: int = 20,
    max_shrink: float = 0.5,
) -> torch.Tensor:
    """Per-(row, group) range shrink ``[N, G]`` for ``compute_qparams(W, scheme, clip=...)``.

    For each group the error measured is that of the group's own contribution to the output,
    ``X_g W_g^T`` versus ``X_g Q(W_g)^T`` (AutoAWQ ``_compute_best_clip``), over shrink
    factors ``1 - i/grid`` for ``i < max_shrink * grid``. The reference measures it on 512
    sampled tokens; the diagonal blocks of the Gram matrix ``G`` give it on all of them. Pass
    the already-scaled ``W * s`` and :func:`scaled_gram` when clipping after
    :func:`awq_search_scale`.
    """
    w = W.detach().float().to(G.device)
    h = _group_blocks(G.float(), scheme.group_size)  # [G, g, g]

    def group_err(clip: float) -> torch.Tensor:
        d = w - fake_quantize(w, compute_qparams(w, scheme, clip=clip))
        dg = group_view(d, scheme.group_size).transpose(0, 1)  # [G, N, g]
        return ((dg @ h) * dg).sum(-1).T  # [N, G]

    best_err = group_err(1.0)
    best_clip = torch.ones_like(best_err)
    for i in range(1, int(max_shrink * grid)):
        p = 1.0 - i / grid
        err = group_err(p)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_clip = torch.where(better, torch.full_like(best_clip, p), best_clip)
    return best_clip


# --------------------------------------------------------------------------------------------
# Mappings: which preceding module can absorb 1/s for which Linears (§3.2, "fuse the scale")


@dataclass(frozen=True)
class MappingSpec:
    """Regexes (``re.fullmatch`` on names relative to a decoder layer)."""

    prev: str
    linears: tuple[str, ...]
    # (layer, prev, linears) -> whether folding is valid for this instance.
    condition: Callable[[nn.Module, nn.Module, list[nn.Module]], bool] | None = None


@dataclass(frozen=True)
class ArchMappings:
    name: str
    specs: tuple[MappingSpec, ...]


@dataclass
class Mapping:
    """One resolved mapping: ``prev``'s output is the shared input of ``linears``."""

    prev_name: str
    prev: nn.Module
    linear_names: list[str]
    linears: list[nn.Module]


def _out_features(m: nn.Module) -> int:
    return weight_2d(m).shape[0] if m.weight.dim() == 2 else m.weight.numel()


def _prev_feeds_linears(_layer: nn.Module, prev: nn.Module, linears: list[nn.Module]) -> bool:
    # v_proj -> o_proj under GQA: v has fewer outputs than o has inputs (heads are repeated),
    # so one s per v output cannot be folded exactly. (Tying the scales of the query heads
    # that read one value head makes it exact, but measured worse on the default model:
    # perplexity 24.79 against 24.67 without the mapping.)
    return all(weight_2d(lin).shape[1] == _out_features(prev) for lin in linears)


def _norm_before(layer: nn.Module, _prev: nn.Module, _linears: list[nn.Module]) -> bool:
    # OPT-350m is post-LN: its layer norms do not feed the projections they are named after.
    return bool(getattr(layer, "do_layer_norm_before", True))


_QKV = (r"self_attn\.q_proj", r"self_attn\.k_proj", r"self_attn\.v_proj")

AWQ_MAPPINGS: tuple[ArchMappings, ...] = (
    # Llama, Qwen2, Mistral (and other Llama-layout models).
    ArchMappings("llama", (
        MappingSpec(r"input_layernorm", _QKV),
        MappingSpec(r"self_attn\.v_proj", (r"self_attn\.o_proj",), _prev_feeds_linears),
        MappingSpec(r"post_attention_layernorm", (r"mlp\.gate_proj", r"mlp\.up_proj")),
        # act(gate) * up is linear in up, so up's outputs can absorb 1/s.
        MappingSpec(r"mlp\.up_proj", (r"mlp\.down_proj",)),
    )),
    ArchMappings("opt", (
        MappingSpec(r"self_attn_layer_norm", _QKV, _norm_before),
        MappingSpec(r"self_attn\.v_proj", (r"self_attn\.out_proj",), _prev_feeds_linears),
        MappingSpec(r"final_layer_norm", (r"fc1",), _norm_before),
        # ReLU(x / s) = ReLU(x) / s for s > 0 (positive homogeneity).
        MappingSpec(r"fc1", (r"fc2",)),
    )),
    # GPT-2: c_fc -> c_proj is absent because GELU is not positively homogeneous.
    ArchMappings("gpt2", (
        MappingSpec(r"ln_1", (r"attn\.c_attn",)),
        MappingSpec(r"ln_2", (r"mlp\.c_fc",)),
    )),
)


def _match(names: list[str], pattern: str) -> list[str]:
    return [n for n in names if re.fullmatch(pattern, n)]


def resolve_mappings(
    layer: nn.Module, table: Sequence[ArchMappings] = AWQ_MAPPINGS
) -> list[Mapping]:
    """The mappings of the first ``table`` entry whose patterns all match ``layer``'s modules."""
    names = [n for n, _ in layer.named_modules() if n]
    for arch in table:
        patterns = [p for spec in arch.specs for p in (spec.prev, *spec.linears)]
        if not all(_match(names, p) for p in patterns):
            continue
        out = []
        for spec in arch.specs:
            (prev_name, *extra) = _match(names, spec.prev)
            if extra:
                raise OptcError(f"AWQ mapping pattern {spec.prev!r} matches several modules")
            linear_names = [n for p in spec.linears for n in _match(names, p)]
            prev = layer.get_submodule(prev_name)
            linears = [layer.get_submodule(n) for n in linear_names]
            if spec.condition is not None and not spec.condition(layer, prev, linears):
                log.debug("awq: skip %s -> %s (%s)", prev_name, linear_names, arch.name)
                continue
            out.append(Mapping(prev_name, prev, linear_names, linears))
        return out
    raise OptcError(
        f"AWQ does not know how to scale decoder layer {type(layer).__name__}: "
        f"supported layouts are {', '.join(a.name for a in table)}"
    )


# --------------------------------------------------------------------------------------------
# Folding s into the model (§3.2: s is fused into the previous operator, so inference is free)


def _is_norm(m: nn.Module, k: int) -> bool:
    w = getattr(m, "weight", None)
    return (
        isinstance(w, torch.Tensor) and w.dim() == 1 and w.numel() == k
        and all(p.dim() <= 1 for p in m.parameters(recurse=False))
    )


def _rescale_(t: torch.Tensor, factor: torch.Tensor) -> None:
    # In float32 then back, so half-precision weights round only once.
    t.copy_((t.float() * factor.to(t.device)).to(t.dtype))


@torch.no_grad()
def _fold_into_norm(norm: nn.Module, s: torch.Tensor) -> None:
    w = norm.weight
    saved = [p.detach().clone() for p in norm.parameters(recurse=False)]
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(4, w.numel(), generator=gen).to(w.device, w.dtype)
    before = norm(probe).float()
    for p in norm.parameters(recurse=False):
        _rescale_(p, 1.0 / s)
    after = norm(probe).float() * s.to(w.device)
    # The shape test cannot tell y = x*w from e.g. Gemma's y = x*(1 + w); the probe can.
    if not torch.allclose(after, before, rtol=1e-2, atol=1e-2 * before.abs().max().item()):
        for p, old in zip(norm.parameters(recurse=False), saved):
            p.copy_(old)
        raise OptcError(
            f"AWQ cannot fold scales into {type(norm).__name__}: its output is not "
            f"proportional to its weight"
        )


@torch.no_grad()
def apply_scale(prev: nn.Module, linears: Sequence[nn.Module], s: torch.Tensor) -> None:
    """Divide ``prev``'s outputs by ``s`` and multiply ``s`` into ``linears``' input columns.

    ``prev`` is a norm (1-D ``weight`` of size K; weight and bias scaled), a Linear (rows of
    weight and bias) or a Conv1D (columns). The float function of the layer is unchanged up
    to rounding, provided whatever lies between ``prev`` and ``linears`` commutes with a
    positive per-channel scale.
    """
    s = s.detach().float()
    if not (torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError("AWQ scales must be finite and positive")
    k = s.numel()
    for lin in linears:
        if weight_2d(lin).shape[1] != k:
            raise OptcError(f"{type(lin).__name__} has {weight_2d(lin).shape[1]} inputs, s has {k}")
    if not _is_norm(prev, k) and _out_features(prev) != k:
        raise OptcError(f"{type(prev).__name__} has {_out_features(prev)} outputs, s has {k}")
    if isinstance(prev, Conv1D):
        _rescale_(prev.weight, 1.0 / s[None, :])
        _rescale_(prev.bias, 1.0 / s)
    elif isinstance(getattr(prev, "weight", None), torch.Tensor) and prev.weight.dim() == 2:
        _rescale_(prev.weight, 1.0 / s[:, None])
        if prev.bias is not None:
            _rescale_(prev.bias, 1.0 / s)
    elif _is_norm(prev, k):
        _fold_into_norm(prev, s)
    else:
        raise OptcError(f"AWQ cannot fold scales into {type(prev).__name__}")
    for lin in linears:
        _rescale_(lin.weight, s[:, None] if isinstance(lin, Conv1D) else s[None, :])
