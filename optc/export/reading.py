"""A float model holding exactly a quantized checkpoint's dequantized weights (optc's own readers:
no optimum, gptqmodel or autoawq needed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from optc.errors import OptcError

# directory -> (float state dict, module name -> QuantParams)
StateReader = Callable[[Path], tuple[dict, dict]]


def load_dequantized(path: Path, dtype: torch.dtype, read: StateReader) -> tuple[torch.nn.Module, dict]:
    """The model of ``path``'s config (its quantization block removed) with the state ``read``
    returns, tied weights re-tied, in eval mode; and the grids."""
    state, qparams = read(path)
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    model.eval()  # from_config builds in training mode (dropout on)
    current = model.state_dict()
    loaded = {current[k].data_ptr() for k in state if k in current}
    # A missing key is fine only when it is tied to a loaded tensor (lm_head -> embeddings).
    absent = [k for k in missing if current[k].data_ptr() not in loaded]
    if unexpected or absent:
        raise OptcError(
            f"{path}: checkpoint does not match its config "
            f"(missing {absent[:3]}, unexpected {unexpected[:3]})"
        )
    return model, qparams
