"""Running a model up to its decoder layers: the first layer's inputs, captured once, are what
layer-by-layer calibration and layer-major evaluation both start from."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optc.model.anatomy import find_decoder_layers


class StopForward(Exception):
    """Raised by the capture hook once the first layer's inputs are stored."""


@dataclass
class Batch:
    hidden: torch.Tensor
    args: tuple
    kwargs: dict


@contextmanager
def layers_detached(model: nn.Module, prefix: str) -> Iterator[nn.ModuleList]:
    """Temporarily take the decoder stack out of the model (to move the rest to a device)."""
    parent_name, _, attr = prefix.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    layers = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList())
    try:
        yield layers
    finally:
        setattr(parent, attr, layers)


def same_or(previous: Any, value: Any) -> Any:
    """``previous`` where it holds exactly the same tensors as ``value``, else ``value``."""
    if isinstance(value, torch.Tensor) and isinstance(previous, torch.Tensor):
        same = previous.shape == value.shape and previous.dtype == value.dtype and torch.equal(previous, value)
        return previous if same else value
    if isinstance(value, tuple) and isinstance(previous, tuple) and len(value) == len(previous):
        shared = tuple(same_or(p, v) for p, v in zip(previous, value))
        return previous if all(a is b for a, b in zip(shared, previous)) else value
    return value


def capture_first_layer_inputs(
    model: nn.Module, ids: torch.Tensor, batch_size: int, device: torch.device
) -> list[Batch]:
    """Run the model on ``ids`` up to its first decoder layer and keep that layer's inputs."""
    prefix, layers = find_decoder_layers(model)
    batches: list[Batch] = []

    def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        rest = args[1:] if args else ()
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value")}
        kwargs["use_cache"] = False
        if batches:  # one copy of what every batch shares (rotary cos/sin, position ids)
            kwargs = {k: same_or(batches[-1].kwargs.get(k), v) for k, v in kwargs.items()}
        batches.append(Batch(hidden.detach(), rest, kwargs))
        raise StopForward

    with layers_detached(model, prefix) as detached:
        model.to(device)
    handle = layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        layers[0].to(device)
        for start in range(0, ids.shape[0], batch_size):
            try:
                model(ids[start : start + batch_size].to(device), use_cache=False)
            except StopForward:
                pass
    finally:
        handle.remove()
        layers[0].to("cpu")
        del detached
    return batches
