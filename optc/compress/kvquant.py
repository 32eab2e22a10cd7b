"""Key/value cache fake-quantization, as a runtime with a quantized KV cache computes it.

An attention layer's keys (after the rotary embedding) and values are written to the cache as
``Q(x) = round(x / s) * s`` on FP8 E4M3 (saturating at 448) or on the signed int8 grid
(``clamp(round(x / s), -128, 127) * s``), with one static scale ``s`` per layer for the keys
(``k_scale``) and one for the values (``v_scale``), calibrated as ``amax / 448`` (FP8) or
``amax / 127.5`` (int8) over the calibration tokens: compressed-tensors' ``kv_cache_scheme``
(strategy ``tensor``, ``quantization/lifecycle/forward.py``'s ``forward_quantize`` on the
states its ``QuantizedKVCache`` receives) and vLLM's ``k_scale`` / ``v_scale``. Attention then
reads the quantized keys and values, so every later token sees the error.

The hook: the attention module's forward takes the cache object as an argument (``cache`` in
transformers 5, ``past_key_values`` / ``past_key_value`` before) and calls its ``update(keys,
values, ...)`` with the new states, whether or not a real cache exists. A forward pre-hook hands
the module a wrapper whose ``update`` quantizes the states and passes them on to the real cache
(or returns them when there is none). :func:`attach_kv_quant` keeps it on until
:func:`detach_kv_quant`; :func:`kv_quant_of` lists what a model carries; :func:`observe_kv`
feeds the states to a callback instead (calibration).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optc.compress.actquant import fake_quantize_activation
from optc.compress.schemes import KVCacheScheme  # noqa: F401 - defined torch-free, re-exported
from optc.model.anatomy import CACHE_ARGUMENTS, cache_argument

_HOOK_ATTR = "_optc_kv_quant"


@dataclass
class KVQuant:
    """Solved cache quantization of one attention layer: ``k_scale`` and ``v_scale`` [1]."""

    scheme: KVCacheScheme
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, scheme: KVCacheScheme) -> torch.Tensor:
    """``x`` on the cache's grid with the static ``scale``, in ``x``'s dtype."""
    return fake_quantize_activation(x, scale, scheme.bits, scheme.type == "float")


class _CacheWrapper:
    """Stands in for the attention's cache: ``update`` transforms the new keys and values, then
    hands them to the real cache (or returns them when the forward has none)."""

    def __init__(self, inner: Any, transform: Callable[[torch.Tensor, torch.Tensor], tuple]) -> None:
        self._inner = inner
        self._transform = transform

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        key_states, value_states = self._transform(key_states, value_states)
        if self._inner is None:
            return key_states, value_states
        return self._inner.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Whatever else the attention asks of its cache (sequence length, sliding windows) is
        # the real cache's; with none, the attribute is missing as it would be on None.
        inner = self.__dict__["_inner"]
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


def _wrap_cache(module: nn.Module, transform: Callable[[torch.Tensor, torch.Tensor], tuple]):
    """Register a pre-hook giving ``module`` a cache wrapper on every forward; returns the handle."""
    arg = cache_argument(module)
    if arg is None:
        raise ValueError(f"{type(module).__name__}.forward takes no cache argument "
                         f"({', '.join(CACHE_ARGUMENTS)})")

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple:
        # The caller may still use a deprecated name the forward renames: wrap what it passed.
        key = next((n for n in CACHE_ARGUMENTS if n in kwargs), arg)
        kwargs[key] = _CacheWrapper(kwargs.get(key), transform)
        return args, kwargs

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def attach_kv_quant(module: nn.Module, kq: KVQuant) -> None:
    """Quantize the keys and values ``module`` (an attention layer) caches, on every forward."""
    detach_kv_quant(module)

    def transform(k: torch.Tensor, v: torch.Tensor) -> tuple:
        return quantize_kv(k, kq.k_scale, kq.scheme), quantize_kv(v, kq.v_scale, kq.scheme)

    setattr(module, _HOOK_ATTR, (kq, _wrap_cache(module, transform)))


def detach_kv_quant(module: nn.Module) -> None:
    entry = getattr(module, _HOOK_ATTR, None)
    if entry is not None:
        entry[1].remove()
        delattr(module, _HOOK_ATTR)


def kv_quant_of(model: nn.Module) -> dict[str, KVQuant]:
    """Attention module name -> the cache quantization attached to it."""
    return {
        name: getattr(m, _HOOK_ATTR)[0]
        for name, m in model.named_modules()
        if getattr(m, _HOOK_ATTR, None) is not None
    }


@contextmanager
def observe_kv(module: nn.Module, fn: Callable[[torch.Tensor, torch.Tensor], None]) -> Iterator[list[int]]:
    """Within the block, ``fn(keys, values)`` sees every update ``module`` makes to its cache
    (keys and values ``[batch, kv_heads, tokens, head_dim]``), before any quantization attached
    to it. Yields a one-element list counting the updates (zero: the forward never reached
    the cache, so this architecture's attention cannot be hooked)."""
    calls = [0]

    def transform(k: torch.Tensor, v: torch.Tensor) -> tuple:
        calls[0] += 1
        fn(k, v)
        return k, v

    # Registered last, this hook runs after a quantizing one: its wrapper is the outer one, so
    # it sees the states before they are quantized.
    handle = _wrap_cache(module, transform)
    try:
        yield calls
    finally:
        handle.remove()
