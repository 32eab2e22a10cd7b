"""``optc imatrix``: the importance matrix of a model on calibration text, for llama.cpp."""

from __future__ import annotations

import logging
from pathlib import Path

from optc.data import CalibrationConfig, check_dataset
from optc.errors import OptcError
from optc.progress import NullProgress, Progress

log = logging.getLogger(__name__)


def model_imatrix(model: str, output: Path, calibration: CalibrationConfig, *, overwrite: bool = False,
                  device: str = "cpu", progress: Progress | None = None) -> dict:
    """Measure ``model``'s imatrix on ``calibration`` (float model, every decoder Linear) and write
    it to ``output`` in llama.cpp's GGUF imatrix layout."""
    import torch

    from optc.export.load import load_checkpoint
    from optc.methods.imatrix import measure_imatrix
    from optc.methods.workspace import Workspace

    output = Path(output).expanduser()
    if output.exists() and not (overwrite and output.is_file()):
        raise OptcError(f"{output} exists (pass --overwrite to replace a file)")
    check_dataset(calibration.dataset, "calibration", network=False)
    torch.manual_seed(calibration.seed)
    loaded = load_checkpoint(model)
    if loaded.qparams:
        log.warning("%s holds quantized weights: its imatrix measures the quantized model's inputs", model)
    ws = Workspace(loaded.model, loaded.tokenizer, calibration, device, progress or NullProgress())
    summary = measure_imatrix(ws, output, calibration.datasets()[0])
    return {**summary, "model": model}
