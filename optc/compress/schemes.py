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


# The floating-point element grids by bits: FP8 E4M3 (OCP FP8, ``float8_e4m3fn``: no infinities,
# largest finite 448) and FP4 E2M1 (OCP MX v1.0 Sec. 5.3.3: 0, 0.5, 1, 1.5, 2, 3, 4, 6).
FLOAT_MAX = {8: 448.0, 4: 6.0}
ScaleFormat = Literal["float", "e4m3", "e8m0", "k-quant"]
# Integer grids whose scales GGUF k-quants store (ggml-common.h): a float16 per 256 weights times
# a signed 6-bit (Q3_K) or 8-bit (Q6_K) code per sub-block of 16; for the types with a min
# (Q2_K, Q4_K, Q5_K) a second float16 times 4- or 6-bit codes gives each sub-block an offset
# (``W = s * (q - qmin) - o``: the zero point tensor holds ``o``, in weight units).
K_QUANT_GRIDS = {(2, False, 16): "q2_k", (3, True, 16): "q3_k", (4, False, 32): "q4_k",
                 (5, False, 32): "q5_k", (6, True, 16): "q6_k"}
# The 4-bit float grids compressed-tensors stores, by their scale format: NVFP4 (an FP8 E4M3
# scale per 16 values under one FP32 scale per tensor) and MXFP4 (OCP MX: an E8M0 power-of-two
# scale per 32 values).
FP4_GROUPS = {"e4m3": 16, "e8m0": 32}


class QuantScheme(BaseModel):
    """What grid a weight is quantized onto. Used directly as a recipe field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: int = Field(4, description="bits per weight, 2..8 (type float: 8 = FP8 E4M3, 4 = FP4 E2M1)")
    symmetric: bool = True
    group_size: int | None = Field(
        64, description="input columns per scale; null means one scale per output channel"
    )
    type: Literal["int", "float"] = Field("int", description="integer grid, or a floating-point element grid")
    scale_format: ScaleFormat | None = Field(
        None, description="how each scale is stored: float, e4m3 (NVFP4), e8m0 (MXFP4) or k-quant (GGUF "
                          "k-quants: a float16 per 256 weights times an integer code per group); "
                          "default float, and for 4-bit floats the one its group size implies"
    )
    block_rows: int | None = Field(
        None, description="FP8 block quantization: output rows sharing each scale, over group_size columns "
                          "(128 with group_size 128: one scale per 128 x 128 tile)"
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

    @model_validator(mode="after")
    def _float_grid(self) -> QuantScheme:
        if self.block_rows is not None and not (self.type == "float" and self.bits == 8 and self.block_rows > 0
                                                and self.group_size is not None):
            raise ValueError(f"block_rows ({self.block_rows}) is for FP8 weights (type float, bits 8) with a "
                             "group_size: one scale per block_rows x group_size tile")
        if self.type == "int":
            if self.scale_format == "k-quant":
                if self.kquant_kind is None:
                    grids = ", ".join(f"{k.upper()} (bits {b}, symmetric {str(s).lower()}, group_size {g})"
                                      for (b, s, g), k in K_QUANT_GRIDS.items())
                    raise ValueError(f"k-quant scales come with the grids of {grids}; got bits {self.bits}, "
                                     f"symmetric {str(self.symmetric).lower()}, group_size {self.group_size}")
                return self
            if self.scale_format not in (None, "float"):
                raise ValueError(f"scale_format {self.scale_format} is for 4-bit float grids (NVFP4, MXFP4), "
                                 "not integer ones")
            return self
        if self.bits not in FLOAT_MAX:
            raise ValueError(f"float grids are FP8 E4M3 (bits 8) or FP4 E2M1 (bits 4), got bits {self.bits}")
        if not self.symmetric:
            raise ValueError("float grids are symmetric (no zero point): set symmetric: true")
        if self.bits == 8:
            if self.scale_format not in (None, "float"):
                raise ValueError(f"FP8 weights take float scales, not scale_format {self.scale_format}")
            return self
        fmt = self.scale_format or {g: f for f, g in FP4_GROUPS.items()}.get(self.group_size)
        if fmt is None or fmt == "float":
            raise ValueError("FP4 weights are NVFP4 (group_size 16, e4m3 scales) or MXFP4 (group_size 32, "
                             f"e8m0 scales); got group_size {self.group_size}"
                             + (f" with scale_format {self.scale_format}" if self.scale_format else ""))
        if self.group_size != FP4_GROUPS[fmt]:
            name = "NVFP4" if fmt == "e4m3" else "MXFP4"
            raise ValueError(f"{name} ({fmt} scales) takes group_size {FP4_GROUPS[fmt]}, got {self.group_size}")
        object.__setattr__(self, "scale_format", fmt)
        return self

    @property
    def qmin(self) -> float:
        return -FLOAT_MAX[self.bits] if self.type == "float" else -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> float:
        return FLOAT_MAX[self.bits] if self.type == "float" else 2 ** (self.bits - 1) - 1

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else math.ceil(in_features / self.group_size)

    @property
    def kquant_kind(self) -> str | None:
        """The GGUF k-quant type (``q6_k``) whose two-level scales this grid has, or None."""
        if self.type != "int" or self.scale_format != "k-quant":
            return None
        return K_QUANT_GRIDS.get((self.bits, self.symmetric, self.group_size))

    @property
    def offset_grid(self) -> bool:
        """A k-quant grid with a min: its zero point tensor holds each group's offset ``o``
        (``W = s * (q - qmin) - o``) instead of an integer zero point."""
        return self.kquant_kind is not None and not self.symmetric

    def label(self) -> str:
        if self.scale_format == "k-quant":
            return f"{self.kquant_kind}-g{self.group_size}"
        g = "channel" if self.group_size is None else f"g{self.group_size}"
        if self.block_rows is not None:
            g = f"b{self.block_rows}x{self.group_size}"
        if self.type == "float":
            name = {"e4m3": "nvfp4", "e8m0": "mxfp4"}.get(self.scale_format or "", "fp8-e4m3")
            return f"{name}-{g}"
        return f"int{self.bits}-{'sym' if self.symmetric else 'asym'}-{g}"


class ActivationScheme(BaseModel):
    """How a Linear's input is quantized. Used directly as a recipe field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: Literal[8, 4] = Field(8, description="8: int8 or FP8 E4M3; 4: NVFP4 (type float, strategy group)")
    type: Literal["int", "float"] = Field("int", description="int8, or FP8 E4M3 (float)")
    strategy: Literal["tensor", "token", "group"] = Field(
        "tensor", description="one scale per tensor, one per token (row), or one per group of a token's "
        "values under a calibrated tensor scale (NVFP4)"
    )
    group_size: int | None = Field(None, description="strategy group: values per scale (NVFP4: 16)")
    dynamic: bool = Field(False, description="scales computed at run time instead of calibrated (strategy "
                          "group: the group scales; the tensor scale is calibrated)")
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
        fp4 = self.bits == 4 or self.strategy == "group" or self.group_size is not None
        if fp4 and self.bits == 8:
            raise ValueError("8-bit activations take one scale per tensor or per token; per-group ones "
                             "(FP8_BLOCK's groups of 128) are not supported: use strategy token, dynamic true")
        if fp4 and not (self.bits == 4 and self.type == "float" and self.strategy == "group"
                        and self.group_size == FP4_GROUPS["e4m3"] and self.dynamic):
            raise ValueError("4-bit activations are NVFP4: bits 4, type float, strategy group, group_size "
                             f"{FP4_GROUPS['e4m3']}, dynamic true (E4M3 scales per group at run time under "
                             "a calibrated FP32 tensor scale)")
        if fp4 and self.observer in ("mse", "kl"):
            raise ValueError(f"the {self.observer} observer searches an int8 grid; the NVFP4 tensor scale "
                             "takes minmax, moving_minmax or percentile")
        if self.strategy == "token" and not self.dynamic:
            raise ValueError("per-token activation scales exist only at run time: set dynamic: true")
        if self.type == "float" and not self.dynamic and self.observer in ("mse", "kl"):
            raise ValueError(f"the {self.observer} observer searches an int8 grid; static FP8 input scales "
                             "take minmax, moving_minmax or percentile")
        return self

    @property
    def tensor_group(self) -> bool:
        """NVFP4: dynamic group scales under a static (calibrated) tensor scale."""
        return self.strategy == "group"

    def label(self) -> str:
        if self.tensor_group:
            return f"nvfp4-g{self.group_size} dynamic, static tensor scale ({self.observer})"
        grid = f"int{self.bits}" if self.type == "int" else "fp8-e4m3"
        if self.dynamic:
            return f"{grid} dynamic per-{self.strategy}"
        detail = f"{self.observer} {self.percentile:g}" if self.observer == "percentile" else self.observer
        return f"{grid} static per-{self.strategy} ({detail})"


class KVCacheScheme(BaseModel):
    """How the attention's key and value cache is quantized: one static scale per decoder layer
    for the keys (after the rotary embedding) and one for the values. Used directly as a
    recipe field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: Literal[8] = 8
    type: Literal["int", "float"] = Field("float", description="FP8 E4M3 (float) or int8")
    observer: ObserverName = Field(
        "minmax", description="how each layer's scale is chosen: minmax, moving_minmax, percentile, mse or kl"
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
    def _consistent(self) -> KVCacheScheme:
        if self.type == "float" and self.observer in ("mse", "kl"):
            raise ValueError(f"the {self.observer} observer searches an int8 grid; FP8 cache scales take "
                             "minmax, moving_minmax or percentile")
        return self

    def activation_scheme(self) -> ActivationScheme:
        """The same grid and observer as a static per-tensor activation scheme (what the
        observers and the fake quantization take)."""
        return ActivationScheme(bits=self.bits, type=self.type, strategy="tensor", dynamic=False,
                                observer=self.observer, percentile=self.percentile,
                                averaging_constant=self.averaging_constant)

    def label(self) -> str:
        grid = f"int{self.bits}" if self.type == "int" else "fp8-e4m3"
        detail = f"{self.observer} {self.percentile:g}" if self.observer == "percentile" else self.observer
        return f"{grid} per-layer ({detail})"


def parse_pattern(pattern: str) -> tuple[int, int]:
    """``"2:4"`` -> ``(2, 4)``, refusing patterns that keep nothing or everything."""
    try:
        n, m = (int(x) for x in pattern.split(":"))
    except ValueError:
        raise ValueError(f"pattern {pattern!r} is not of the form N:M (e.g. 2:4)") from None
    if not 0 < n < m:
        raise ValueError(f"pattern {pattern!r} needs 0 < N < M")
    return n, m
