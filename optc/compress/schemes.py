"""The pydantic schemes recipes name, without torch: weight grids, activation quantization, the
observer names and N:M patterns.

The recipe schema (``optc.recipe``) and every method's config are built from these, so parsing or
validating a recipe never imports torch; the tensor code re-imports them from here
(``optc.compress.quant``, ``optc.compress.actquant``, ``optc.compress.masks``).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ObserverName = Literal["minmax", "moving_minmax", "percentile", "mse", "kl"]
OBSERVERS: tuple[str, ...] = ("minmax", "moving_minmax", "percentile", "mse", "kl")


# Above any Linear's width a group is one per row, which null says; a larger number only pads
# every row to that many columns (an int64 overflow, or gigabytes, in the kernels).
MAX_GROUP_SIZE = 65536


class QuantScheme(BaseModel):
    """What grid a weight is quantized onto. Used directly as a recipe field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: int = Field(4, description="bits per weight, 2..8")
    symmetric: bool = True
    group_size: int | None = Field(
        64, description="input columns per scale; null means one scale per output channel"
    )

    @field_validator("bits")
    @classmethod
    def _bits_range(cls, v: int) -> int:
        if not 2 <= v <= 8:
            raise ValueError(f"bits must be between 2 and 8, got {v}")
        return v

    @field_validator("group_size")
    @classmethod
    def _group_positive(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v <= 0:
            raise ValueError(f"group_size must be positive (or null for per-channel), got {v}")
        if v is not None and v > MAX_GROUP_SIZE:
            raise ValueError(f"group_size must be at most {MAX_GROUP_SIZE} (null: one scale per output "
                             f"channel), got {v}")
        return None if v == -1 else v

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else math.ceil(in_features / self.group_size)

    def label(self) -> str:
        g = "channel" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.bits}-{'sym' if self.symmetric else 'asym'}-{g}"


class ActivationScheme(BaseModel):
    """How a Linear's input is quantized. Used directly as a recipe field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: Literal[8] = 8
    strategy: Literal["tensor", "token"] = Field(
        "tensor", description="one scale per tensor, or one per token (row)"
    )
    dynamic: bool = Field(False, description="scales computed at run time instead of calibrated")
    observer: ObserverName = Field(
        "minmax", description="static scales: minmax, moving_minmax, percentile, mse or kl"
    )
    percentile: float = Field(99.99, description="percentile observer: share of |x| kept, in (0, 100]")
    averaging_constant: float = Field(0.01, gt=0, le=1, description="moving_minmax: EMA constant")

    @field_validator("percentile")
    @classmethod
    def _percentile_range(cls, v: float) -> float:
        if not 0 < v <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ActivationScheme:
        if self.strategy == "token" and not self.dynamic:
            raise ValueError("per-token activation scales exist only at run time: set dynamic: true")
        return self

    def label(self) -> str:
        if self.dynamic:
            return f"int{self.bits} dynamic per-{self.strategy}"
        detail = f"{self.observer} {self.percentile:g}" if self.observer == "percentile" else self.observer
        return f"int{self.bits} static per-{self.strategy} ({detail})"


def parse_pattern(pattern: str) -> tuple[int, int]:
    """``"2:4"`` -> ``(2, 4)``, refusing patterns that keep nothing or everything."""
    try:
        n, m = (int(x) for x in pattern.split(":"))
    except ValueError:
        raise ValueError(f"pattern {pattern!r} is not of the form N:M (e.g. 2:4)") from None
    if not 0 < n < m:
        raise ValueError(f"pattern {pattern!r} needs 0 < N < M")
    return n, m
