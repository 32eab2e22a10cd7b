"""Config pieces the method configs share (torch-free: the recipe schema is built from them)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from optc.compress.schemes import QuantScheme
from optc.model.patterns import check_patterns

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


class WeightQuantConfig(LinearsConfig):
    """A stage quantizing weights: one scheme, mixed precision by ``overrides``. Every method
    of kind ``quantize`` has such a config, so the size estimate and the export-format check
    read ``scheme_for`` / ``planned_schemes`` whatever the method."""

    scheme: QuantScheme = QuantScheme()
    overrides: list[Override] = Field(default_factory=list)

    def scheme_for(self, name: str) -> QuantScheme | None:
        for o in self.overrides:
            if re.search(o.pattern, name):
                return o.scheme
        return self.scheme

    def permuted_groups(self) -> bool:
        """Whether the grids it writes have act-order groups permuted on disk (g_idx)."""
        return False

    def planned_schemes(self) -> list[PlannedScheme]:
        """Every scheme the config can give a Linear: the default, then each override's."""
        permuted = self.permuted_groups()
        return [("scheme", self.scheme, permuted)] + [
            (f"override {o.pattern!r}", o.scheme, permuted) for o in self.overrides
        ]
