"""What the peer scripts share: the fixed protocol's model and calibration tokens, read without
optc (each peer runs in its own venv). The default model is the float checkpoint optc converts it
to (run `make demo` or any optc command once first)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("OPTC_DATA", ROOT.parent / "shared" / "data"))
MODEL = Path(os.environ.get("OPTC_CACHE", Path.home() / ".cache" / "optc")) / "models" / "smollm2-135m"
SAMPLES, SEQLEN = 128, 512


def float_model():
    """The default model in float32 and its tokenizer."""
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32), AutoTokenizer.from_pretrained(MODEL)


def calibration_chunks(tok) -> torch.Tensor:
    """The protocol's calibration tokens: the first 128 non-overlapping 512-token chunks of
    WikiText-2 validation, [SAMPLES, SEQLEN]."""
    ids = tok(DATA.joinpath("wikitext-2-valid.txt").read_text(), return_tensors="pt").input_ids[0]
    return ids[: SAMPLES * SEQLEN].view(SAMPLES, SEQLEN)
