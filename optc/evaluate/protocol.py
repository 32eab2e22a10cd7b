"""The evaluation protocol: one definition of what a perplexity evaluation reads, shared by
recipes (``evaluation:``), ``optc eval`` and the evaluation suite, so a recipe's report and a
later ``optc eval`` of its checkpoint measure the same windows unless told otherwise.

Torch-free: the recipe schema imports it.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

KernelChoice = Literal["auto", "int4", "int8-dynamic", "int8-weight-only", "float"]
KERNEL_CHOICES: tuple[str, ...] = get_args(KernelChoice)


class EvalProtocol(BaseModel):
    """The text and the windows perplexity is measured on."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field("builtin", description="evaluation text: builtin, wikitext2, c4, a .txt/.jsonl path, or a "
                         "datasets source (parquet/arrow/CSV/JSON file or folder, save_to_disk directory, hub id)")
    split: str | None = Field(None, description="split of a datasets source (default: test, else validation)")
    text_column: str | None = Field(None, description="column of a datasets source (default: text, else messages)")
    seqlen: int = Field(512, gt=0, description="tokens per window")
    windows: int | None = Field(16, gt=0, description="first N windows; null means all")
    stride: int | None = Field(None, gt=0, description="sliding-window stride (null: seqlen)")
    batch_size: int = Field(1, gt=0, description="windows per forward")


    def source(self):
        """The evaluation text as an :class:`optc.data.DataSource`."""
        from optc.data import DataSource

        return DataSource(dataset=self.dataset, split=self.split, text_column=self.text_column)


class LatencyOptions(BaseModel):
    """Batch-1 prefill and decode timing on low-precision kernels."""

    model_config = ConfigDict(extra="forbid")

    kernel: str = "auto"
    prompt_tokens: int = 128
    new_tokens: int = 32
    repeats: int = 5
    threads: int | None = None

    @field_validator("kernel")
    @classmethod
    def _known_kernel(cls, v: str) -> str:
        if v not in KERNEL_CHOICES:
            raise ValueError(f"unknown kernel {v!r} (expected one of {', '.join(KERNEL_CHOICES)})")
        return v
