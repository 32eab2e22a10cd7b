"""The output Fisher of Linears: for each output channel, the mean squared gradient of the model's
loss at that output (the diagonal of the empirical Fisher at the Linear's output). Weighting a
Linear's output error by it turns "how much does this Linear's output move" into "how much does
the loss notice" (the second-order view of HAWQ-V2: Dong et al. 2020, section 3)."""

from __future__ import annotations

import torch


def output_fisher(model: torch.nn.Module, ids: torch.Tensor, linears: dict[str, torch.nn.Module],
                  batch_size: int = 1, device: torch.device | str = "cpu",
                  autocast: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``{name: [out_features] float64}``: the mean over ``ids``' tokens ([samples, seqlen]) of the
    squared gradient of the language-modelling loss at each output of each of ``linears``.

    The parameters get no gradients (only the activations' are formed), so the memory is the
    forward's activations of one batch. ``autocast``: the forward and backward's matmul dtype
    (e.g. bfloat16; None: the model's own)."""
    sums: dict[str, torch.Tensor] = {}
    handles = []

    def watch(name: str):
        def hook(_module, _inputs, out):
            def add(grad: torch.Tensor) -> None:
                g = grad.detach().reshape(-1, grad.shape[-1]).double().pow(2).sum(dim=0).cpu()
                sums[name] = sums[name] + g if name in sums else g
            out.register_hook(add)
        return hook

    frozen = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    model.eval()
    tokens = 0
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        handles = [m.register_forward_hook(watch(n)) for n, m in linears.items()]
        embed = model.get_input_embeddings()
        with torch.enable_grad():
            for batch in ids.split(batch_size):
                x = batch.to(device)
                embeds = embed(x).detach().requires_grad_(True)
                # Summed over tokens, so every token weighs the same whatever its batch.
                with torch.autocast(torch.device(device).type, dtype=autocast, enabled=autocast is not None):
                    loss = model(inputs_embeds=embeds, labels=x).loss * (x.shape[0] * (x.shape[1] - 1))
                loss.backward()
                tokens += x.numel()
    finally:
        for h in handles:
            h.remove()
        for p, flag in frozen:
            p.requires_grad_(flag)
        model.train(was_training)
    return {n: s / max(1, tokens) for n, s in sums.items()}
