"""The model being compressed and what the stages so far recorded about it.

Importable without torch (its tensor fields are only annotations), so the registry can name it.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optc.data import CalibrationConfig
from optc.progress import NullProgress, Progress

if TYPE_CHECKING:
    import torch

    from optc.compress.quant import QuantParams
    from optc.methods.recover_training import Adapter


@dataclass
class Workspace:
    """The model being compressed and what the stages so far have recorded about it."""

    model: torch.nn.Module
    tokenizer: object
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    device: str = "cpu"
    progress: Progress = field(default_factory=NullProgress)
    qparams: dict[str, QuantParams] = field(default_factory=dict)
    # Keep masks by module name, held packed (PackedMasks: a bit per weight); a plain dict given
    # here is packed.
    masks: MutableMapping[str, torch.Tensor] = field(default_factory=dict)
    nm: tuple[int, int] | None = None  # the N:M pattern the masks follow, if any
    teacher: torch.nn.Module | None = None  # the uncompressed model, for distillation
    evaluate: Callable[[torch.nn.Module], dict] | None = None  # the recipe's evaluation
    state_dir: Path | None = None  # where a recovery keeps its resumable state
    adapter: Adapter | None = None  # a recovery adapter to write beside the checkpoint
    # optc.run.state.LayerStore (not imported: the run sits above the methods): saves finished
    # layers (resume); streams them when streaming.
    store: Any | None = None
    _ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        from optc.compress.masks import PackedMasks

        if not isinstance(self.masks, PackedMasks):
            self.masks = PackedMasks(self.masks)

    def calibration_ids(self) -> torch.Tensor:
        if self._ids is None:
            self._ids = self.calibration.token_ids(self.tokenizer)
        return self._ids
