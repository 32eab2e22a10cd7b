"""The peer row of issue 3's wall-time target, measured on the host at hand: llm-compressor's
GPTQ on the fixed protocol (W4 sym group 64, 128 x 512 WikiText-2 validation tokens,
`lm_head` unquantized), start to written checkpoint.

Runs in its own venv (llm-compressor pins its own transformers); optc is not imported, so the
default model is read from the float checkpoint optc converts it to (run `make demo` or any
optc command once first). Usage, timing the whole process:

    python3 -m venv .venv-llmc && .venv-llmc/bin/pip install torch==2.13.0 'llmcompressor==0.14.*'
    /usr/bin/time -v .venv-llmc/bin/python bench/peer_llmcompressor.py out/peer-gptq [--best]

``--best`` is the best setting we found for it (MSE-searched scales plus activation ordering);
without it, its defaults.
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from peer_protocol import SAMPLES, SEQLEN, calibration_chunks, float_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("output")
    ap.add_argument("--best", action="store_true")
    args = ap.parse_args()

    model, tok = float_model()
    chunks = calibration_chunks(tok)
    data = Dataset.from_dict({"input_ids": chunks.tolist(), "attention_mask": torch.ones_like(chunks).tolist()})
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
    if args.best:
        weights |= {"observer": "mse", "actorder": "weight"}
    recipe = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"])
    oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=SEQLEN, num_calibration_samples=SAMPLES)
    model.save_pretrained(args.output, save_compressed=True)
    tok.save_pretrained(args.output)


if __name__ == "__main__":
    main()
