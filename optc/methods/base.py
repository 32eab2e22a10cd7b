"""Config pieces the method configs share (torch-free: the recipe schema is built from them)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from optc.compress.schemes import QuantScheme
from optc.model.patterns import check_patterns
from optc.units import parse_size

# One planned weight scheme of a quantizing stage: (where in the config, scheme or None for
# "left in float", whether act-order groups are permuted on disk).
PlannedScheme = tuple[str, QuantScheme | None, bool]


class LinearsConfig(BaseModel):
    """A stage acting on the Linears its ``targets`` select (and ``ignore`` does not)."""

    model_config = ConfigDict(extra="forbid")

    targets: list[str] = Field(
        [".*"], description="regexes (re.search) over Linear names inside decoder layers"
    )
    ignore: list[str] = Field(["lm_head"], description="regexes of Linears to leave alone")

    @field_validator("targets", "ignore")
    @classmethod
    def _valid_regex(cls, v: list[str]) -> list[str]:
        check_patterns(v, "target/ignore")
        return v


class Override(BaseModel):
    """Mixed precision: Linears matching ``pattern`` get ``scheme`` (null: left in float)."""

    model_config = ConfigDict(extra="forbid")

    pattern: str
    scheme: QuantScheme | None

    @field_validator("pattern")
    @classmethod
    def _valid_regex(cls, v: str) -> str:
        check_patterns([v], "override")
        return v


def _symmetric_candidates() -> list[QuantScheme | None]:
    # Group sizes beyond 64 are what frees bits for the sensitive Linears: 96 and 192 divide the
    # 576- and 1536-wide inputs of the default model, 128 the power-of-two widths of most others (a
    # size that divides no width is stored as the finer size that does, so it is never chosen).
    # No int2: the second-order estimate underrates it, and with it the 3.25-bit mix scored worse
    # (30.86 against 29.93 on the default model); a target below int3 g192 is refused with the
    # candidates listed, so a user can add it.
    return [QuantScheme(bits=b, group_size=g) for b in (3, 4) for g in (64, 96, 128, 192)] + [
        QuantScheme(bits=8, group_size=64), None]


def _asymmetric_candidates() -> list[QuantScheme | None]:
    # A zero point per group costs as many bits as a code, and at 3 bits it buys more than it
    # costs: on the default model at 3.25 bits per weight this set scored 28.58 against the
    # symmetric set's 29.28 (fixed protocol), the int3 Linears taking groups of 192 and 288.
    return [QuantScheme(bits=3, group_size=64)] + [
        QuantScheme(bits=3, group_size=g, symmetric=False) for g in (64, 96, 192, 288)] + [
        QuantScheme(bits=4, group_size=g) for g in (64, 192)] + [
        QuantScheme(bits=4, group_size=g, symmetric=False) for g in (96, 192)] + [
        QuantScheme(bits=8, group_size=64)]


def _gguf_candidates() -> list[QuantScheme | None]:
    # The grids GGUF's block types hold (--format gguf stores each Linear in its grid's type):
    # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32-weight groups), the k-quants Q2_K to Q6_K (rows of whole
    # 256-weight super-blocks only; the others take the legacy types), and F16.
    legacy = [QuantScheme(bits=b, group_size=32, symmetric=sym) for b in (4, 5) for sym in (True, False)]
    kquants = [QuantScheme(bits=b, symmetric=sym, group_size=g, scale_format="k-quant")
               for b, sym, g in ((2, False, 16), (3, True, 16), (4, False, 32), (5, False, 32), (6, True, 16))]
    return [*legacy, QuantScheme(bits=8, group_size=32), *kquants, None]


# Named candidate lists a budget may give instead of its own list.
CANDIDATE_SETS = {"symmetric": _symmetric_candidates, "asymmetric": _asymmetric_candidates,
                  "gguf": _gguf_candidates}


def nominal_bits(scheme: QuantScheme | None) -> float:
    """Bits per weight of ``scheme`` with 16-bit scales (and packed zero points when asymmetric)
    on rows its groups divide: what a budget's bits per weight are checked against before a model
    is loaded (the allocation then counts exactly what the format stores)."""
    if scheme is None:
        return 16.0
    if scheme.group_size is None:
        return float(scheme.bits)
    return scheme.bits + (16 + (0 if scheme.symmetric else scheme.bits)) / scheme.group_size


class Budget(BaseModel):
    """Compress to a budget: each Linear the stage quantizes gets one of ``candidates``, chosen to
    minimise the summed estimated output error with the average bits per weight over the decoder
    Linears (``bits_per_weight``) or the weights' size on disk (``size``) at or under the target."""

    model_config = ConfigDict(extra="forbid")

    bits_per_weight: float | None = Field(
        None, gt=0, description="average stored bits per decoder-Linear weight, scales and zero points included")
    size: int | str | None = Field(
        None, description="size of the checkpoint's weight files, e.g. 80MiB or 2GB (tokenizer and card not counted)")
    candidates: list[QuantScheme | None] = Field(
        default_factory=_symmetric_candidates,
        description="schemes a Linear may get (null: left in float), or a named set: symmetric (the default: int3 "
        "and int4 at groups 64-192, int8, float), asymmetric (zero points per group: lower error per bit at 3 "
        "bits; transformers 5.25 loads such mixes only decoded module by module) or gguf (the grids GGUF's block "
        "types hold, for --format gguf)")
    sensitivity: Literal["fisher", "output"] = Field(
        "fisher", description="a candidate's estimated loss: its Linear's output error tr(dW H dW^T) weighted per output "
        "channel by the loss's mean squared gradient there (fisher: one backward pass per sample), or unweighted "
        "(output: cheaper, but later layers' larger activations make their errors look larger than they cost)")
    samples: int = Field(
        8, gt=0, description="calibration sequences of the sensitivity pass (the first ones of the stage's)")
    observer: Literal["minmax", "mse"] | None = Field(
        None, description="the grid each candidate's error is estimated on: null: the stage's own observer "
        "(GPTQ's mse search; minmax for a stage without one)")
    fused: bool = Field(
        False, description="give the Linears vLLM fuses into one module (a layer's q/k/v_proj, its gate/up_proj) one "
        "scheme together, which vLLM needs to load the mix (transformers, GPTQModel and llama.cpp load them apart); "
        "it costs accuracy: the small k/v_proj then take q_proj's bits")

    @field_validator("candidates", mode="before")
    @classmethod
    def _named_set(cls, v):
        if isinstance(v, str):
            if v not in CANDIDATE_SETS:
                raise ValueError(f"{v!r} is neither a list of schemes nor a candidate set ({', '.join(CANDIDATE_SETS)})")
            return CANDIDATE_SETS[v]()
        return v

    @field_validator("size")
    @classmethod
    def _valid_size(cls, v: int | str | None) -> int | str | None:
        if v is not None and parse_size(v) <= 0:
            raise ValueError(f"size must be positive, got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Budget:
        if (self.bits_per_weight is None) == (self.size is None):
            raise ValueError("give exactly one of bits_per_weight and size")
        if not self.candidates:
            raise ValueError("candidates is empty: list the schemes a Linear may get")
        labels = [scheme_label(c) for c in self.candidates]
        if len(set(labels)) < len(labels):
            raise ValueError(f"candidates repeat a scheme: {', '.join(labels)}")
        if self.bits_per_weight is not None:
            lo, hi = min(map(nominal_bits, self.candidates)), max(map(nominal_bits, self.candidates))
            if not lo <= self.bits_per_weight <= hi:
                raise ValueError(
                    f"bits_per_weight {self.bits_per_weight} is outside what the candidates reach "
                    f"({lo:g} to {hi:g} bits per weight: {', '.join(labels)})")
        return self

    def target_bytes(self) -> int | None:
        return None if self.size is None else parse_size(self.size)


def scheme_label(scheme: QuantScheme | None) -> str:
    """A candidate's name in messages and reports (``float`` for a Linear left in float)."""
    return "float" if scheme is None else scheme.label()


class WeightQuantConfig(LinearsConfig):
    """A stage quantizing weights: one scheme, mixed precision by ``overrides``. Every method
    of kind ``quantize`` has such a config, so the size estimate and the export-format check
    read ``scheme_for`` / ``planned_schemes`` whatever the method."""

    scheme: QuantScheme = QuantScheme()
    overrides: list[Override] = Field(default_factory=list)
    budget: Budget | None = Field(
        None, description="choose each Linear's scheme among candidates to meet a size or bits-per-weight target "
        "(ignore and overrides stay fixed)")

    def scheme_for(self, name: str) -> QuantScheme | None:
        for o in self.overrides:
            if re.search(o.pattern, name):
                return o.scheme
        return self.scheme

    def permuted_groups(self) -> bool:
        """Whether the grids it writes have act-order groups permuted on disk (g_idx)."""
        return False

    def planned_schemes(self) -> list[PlannedScheme]:
        """Every scheme the config can give a Linear: the default (none with a budget, which gives
        every Linear without an override one of its candidates), then each override's."""
        permuted = self.permuted_groups()
        candidates = [] if self.budget is None else [
            (f"budget candidate {scheme_label(c)}", c, permuted) for c in self.budget.candidates]
        default = [("scheme", self.scheme, permuted)] if self.budget is None else []
        return default + [
            (f"override {o.pattern!r}", o.scheme, permuted) for o in self.overrides
        ] + candidates
