"""Running estimate of a layer's input Hessian ``H = 2/n * sum_t x_t x_t^T`` (GPTQ convention).

Works for ``nn.Linear`` and GPT-2 ``Conv1D`` alike: both see input activations ``[..., K]``.
``n`` counts rows (tokens), so ``H`` is a true average whatever the batch shapes.

Only the block upper triangle of ``X^T X`` is accumulated (column blocks of ``_BLOCK``: a
diagonal block and the blocks right of it per step) and ``H`` is read back mirrored: on the
default model that is 56% of the multiply-adds for ``down_proj``'s 1536 x 1536 Hessian and 67%
for the 576 x 576 ones, 30% less time measured on this CPU, and the result is exactly symmetric.
"""

from __future__ import annotations

import math

import torch

_BLOCK = 192  # columns per block: large enough for an efficient matmul on each block row


class HessianAccumulator:
    """Accumulates ``H`` in float32, one batch of activations at a time."""

    def __init__(
        self,
        in_features: int,
        device: torch.device | str | None = None,
        matmul_dtype: torch.dtype | None = None,
    ) -> None:
        self.in_features = in_features
        self.matmul_dtype = matmul_dtype
        self.nsamples = 0
        # Allocated on the first batch's device unless one is given, so calibration on a
        # GPU keeps H there without the caller having to say so.
        self._H: torch.Tensor | None = (
            None if device is None else torch.zeros(in_features, in_features, device=device)
        )

    @property
    def H(self) -> torch.Tensor:
        if self._H is None:
            return torch.zeros(self.in_features, self.in_features)
        return torch.triu(self._H) + torch.triu(self._H, 1).T

    def add(self, x: torch.Tensor) -> None:
        """Fold in activations ``x`` of shape ``[..., K]``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs [..., {self.in_features}], got {tuple(x.shape)}")
        x = x.detach().reshape(-1, self.in_features)
        n = x.shape[0]
        if n == 0:
            return
        if self._H is None:
            self._H = torch.zeros(self.in_features, self.in_features, device=x.device)
        total = self.nsamples + n
        # Rescaling the running mean (rather than summing and dividing at the end) keeps
        # the magnitudes bounded over millions of tokens, as the reference implementation does.
        self._H.mul_(self.nsamples / total)
        if self.matmul_dtype == torch.bfloat16:
            # Opt-in (bf16 autocast calibration): a bf16 matmul is ~2.6x faster on AMX CPUs;
            # its ~0.2% relative error in H is far below GPTQ's dampening.
            xb = x.to(self._H.device, torch.bfloat16)
            for s in range(0, self.in_features, _BLOCK):
                e = min(s + _BLOCK, self.in_features)
                self._H[s:e, s:].add_((xb[:, s:e].T @ xb[:, s:]).to(torch.float32), alpha=2.0 / total)
        else:
            x = x.to(self._H.device, torch.float32) * math.sqrt(2.0 / total)
            for s in range(0, self.in_features, _BLOCK):
                e = min(s + _BLOCK, self.in_features)
                self._H[s:e, s:].addmm_(x[:, s:e].T, x[:, s:])
        self.nsamples = total

    def merge(self, other: HessianAccumulator) -> None:
        """Combine with an accumulator fed disjoint data (e.g. another rank's)."""
        if other.in_features != self.in_features:
            raise ValueError("cannot merge Hessians of different sizes")
        if other.nsamples == 0:
            return
        total = self.nsamples + other.nsamples
        h = other.H.to(self.H.device) * (other.nsamples / total)
        self._H = self.H.mul_(self.nsamples / total).add_(h)
        self.nsamples = total

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        """``H`` times ``nsamples`` is additive, so it can be all-reduced with a plain sum."""
        return {"H_sum": self.H * self.nsamples, "nsamples": self.nsamples}

    def load_state_dict(self, state: dict[str, torch.Tensor | int]) -> None:
        n = int(state["nsamples"])
        h_sum = state["H_sum"]
        assert isinstance(h_sum, torch.Tensor)
        self.nsamples = n
        self._H = h_sum.float() / n if n else torch.zeros_like(h_sum, dtype=torch.float32)
