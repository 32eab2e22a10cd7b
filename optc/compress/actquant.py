"""Int8 activation fake-quantization of Linear inputs, as a W8A8 runtime computes it.

A quantized Linear's input ``x`` becomes ``clamp(round(x / s), -2^(b-1), 2^(b-1) - 1) * s``
(FP8: ``round_e4m3(x / s) * s``, E4M3 saturating at 448) before the matmul, so evaluating the model in optc measures what vLLM's int8 GEMM (or
compressed-tensors' own forward) computes:

- **static per-tensor**: one calibrated ``s`` per Linear input (``input_scale`` on disk);
- **dynamic per-tensor** / **per-token**: ``s`` computed from the tensor, or from each token's
  row, at run time (``s = max|x| / ((2^b - 1) / 2)``, FP8 ``max|x| / 448``), nothing stored.

- **NVFP4** (dynamic per group of 16 under a static tensor scale): a calibrated FP32
  ``g = 448 * 6 / amax`` per Linear input (``input_global_scale`` on disk); at run time each
  group's scale ``s = round_e4m3(g * max|x_group| / 6)`` and ``x = round_e2m1(x / (s / g)) * s / g``
  (compressed-tensors' ``calculate_qparams`` and ``_quantize`` for ``tensor_group`` with dynamic
  ``local``, the order of its float operations kept).

The grid is compressed-tensors' symmetric one (``amax`` maps to ``(2^b - 1) / 2``), so a
checkpoint reloaded by transformers + compressed-tensors computes the same logits.
Fake-quantization is attached as a forward pre-hook that stays on the module until
:func:`detach_input_quant`; :func:`input_quant_of` lists what a model carries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from optc.compress.fpquant import E4M3_MAX, round_e2m1_, round_e4m3
from optc.compress.schemes import FLOAT_MAX, ActivationScheme  # noqa: F401 - defined torch-free, re-exported

_HOOK_ATTR = "_optc_input_quant"


# compressed-tensors replaces a zero E4M3 group scale by float8_e4m3fn's eps.
_E4M3_EPS = 0.125


@dataclass
class InputQuant:
    """Solved input quantization of one Linear: ``scale`` [1] when static, else None;
    ``global_scale`` [1] for NVFP4's tensor scale (its group scales are dynamic)."""

    scheme: ActivationScheme
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.scheme.dynamic != (self.scale is None):
            raise ValueError("static activation quantization needs a scale; dynamic takes none")
        if self.scheme.tensor_group != (self.global_scale is not None):
            raise ValueError("NVFP4 activations need a calibrated tensor scale; other schemes take none")

    def threshold(self) -> float | None:
        """The calibrated clipping threshold ``max|x|`` maps to, or None when fully dynamic."""
        if self.global_scale is not None:
            return E4M3_MAX * FLOAT_MAX[4] / float(self.global_scale)
        if self.scale is not None:
            return float(self.scale) * half_range(self.scheme.bits, self.scheme.type == "float")
        return None


def nvfp4_input_global_scale(threshold: float) -> torch.Tensor:
    """NVFP4's static tensor scale ``448 * 6 / amax`` [1] (compressed-tensors' ``generate_gparam``;
    a zero range gives 1)."""
    g = E4M3_MAX * FLOAT_MAX[4] / threshold if threshold > 0 else 1.0
    return torch.tensor([g if math.isfinite(g) else 1.0], dtype=torch.float32)


def fake_quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, group_size: int = 16) -> torch.Tensor:
    """NVFP4 activation fake quantization of ``x`` ([..., K], ``K`` a multiple of ``group_size``),
    in ``x``'s dtype, with compressed-tensors' operations in their order."""
    if x.shape[-1] % group_size:
        raise ValueError(f"NVFP4 activations need a width divisible by {group_size}, got {x.shape[-1]}")
    # The group maximum over 6 in x's dtype, the rest in float32 (the FP32 tensor scale promotes
    # it there in compressed-tensors), the result back in x's dtype.
    g = global_scale.to(x.device, torch.float32)
    xg = x.unflatten(-1, (x.shape[-1] // group_size, group_size))
    amax = torch.maximum(xg.amax(dim=-1, keepdim=True), -xg.amin(dim=-1, keepdim=True))
    s = round_e4m3(g * (amax / FLOAT_MAX[4]))
    s = torch.where(s == 0, torch.full_like(s, _E4M3_EPS), s)
    step = s / g
    q = round_e2m1_((xg / step).clamp_(-FLOAT_MAX[4], FLOAT_MAX[4]))
    return (q * step).flatten(-2).to(x.dtype)


def half_range(bits: int, float_grid: bool = False) -> float:
    """The value ``max|x|`` maps to: ``(2^b - 1) / 2`` on the int grid, 448 for FP8 E4M3."""
    return E4M3_MAX if float_grid else (2**bits - 1) / 2


def scale_from_threshold(threshold: float, bits: int = 8, float_grid: bool = False) -> torch.Tensor:
    """Static per-tensor ``input_scale`` [1] for a clipping threshold (0 guarded like
    compressed-tensors, which replaces a zero scale by the dtype's eps)."""
    s = threshold / half_range(bits, float_grid)
    return torch.tensor([s if s > 0 else torch.finfo(torch.float32).eps], dtype=torch.float32)


def dynamic_scale(x: torch.Tensor, strategy: str, bits: int = 8, float_grid: bool = False) -> torch.Tensor:
    """Run-time scale of ``x`` ([..., K]): one per row (``token``) or one overall (``tensor``)."""
    a = x.detach().abs()
    amax = a.amax(dim=-1, keepdim=True) if strategy == "token" else a.amax().reshape(1)
    s = amax.float() / half_range(bits, float_grid)
    return torch.where(s > 0, s, torch.full_like(s, torch.finfo(torch.float32).eps))


def fake_quantize_activation(
    x: torch.Tensor, scale: torch.Tensor, bits: int = 8, float_grid: bool = False
) -> torch.Tensor:
    """``clamp(round(x / s)) * s`` on the signed ``bits`` grid (or E4M3's), in ``x``'s dtype."""
    s = scale.to(x.device, torch.float32)
    if float_grid:
        return (round_e4m3(x.float() / s) * s).to(x.dtype)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return (torch.round(x.float() / s).clamp_(qmin, qmax) * s).to(x.dtype)


def quantize_input(x: torch.Tensor, iq: InputQuant) -> torch.Tensor:
    """Fake-quantize a Linear input as ``iq`` prescribes."""
    if iq.global_scale is not None:
        return fake_quantize_nvfp4(x, iq.global_scale, iq.scheme.group_size or 16)
    fp = iq.scheme.type == "float"
    scale = iq.scale if iq.scale is not None else dynamic_scale(x, iq.scheme.strategy, iq.scheme.bits, fp)
    return fake_quantize_activation(x, scale, iq.scheme.bits, fp)


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(|x|^2 / |x - x_hat|^2)`` in dB."""
    signal = float(x.double().pow(2).sum())
    noise = float((x.double() - x_hat.double()).pow(2).sum())
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def attach_input_quant(module: nn.Module, iq: InputQuant) -> None:
    """Fake-quantize ``module``'s input on every forward (replaces an earlier attachment)."""
    detach_input_quant(module)

    def hook(_mod: nn.Module, args: tuple) -> tuple:
        return (quantize_input(args[0], iq), *args[1:])

    handle = module.register_forward_pre_hook(hook)
    setattr(module, _HOOK_ATTR, (iq, handle))


def detach_input_quant(module: nn.Module) -> None:
    entry = getattr(module, _HOOK_ATTR, None)
    if entry is not None:
        entry[1].remove()
        delattr(module, _HOOK_ATTR)


def input_quant_of(model: nn.Module) -> dict[str, InputQuant]:
    """Module name -> the input quantization attached to it."""
    return {
        name: getattr(m, _HOOK_ATTR)[0]
        for name, m in model.named_modules()
        if getattr(m, _HOOK_ATTR, None) is not None
    }
