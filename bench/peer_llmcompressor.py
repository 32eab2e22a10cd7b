"""llm-compressor 0.14 on the fixed protocol (128 x 512 WikiText-2 validation tokens, `lm_head`
unquantized), start to written checkpoint: the peer rows of docs/benchmarks.md.

Runs in its own venv (llm-compressor pins its own transformers); optc is not imported, so the
default model is read from the float checkpoint optc converts it to (run `make demo` or any
optc command once first). Usage, timing the whole process:

    python3 -m venv .venv-llmc && .venv-llmc/bin/pip install torch==2.13.0 'llmcompressor==0.14.*'
    /usr/bin/time -v .venv-llmc/bin/python bench/peer_llmcompressor.py out/peer-gptq [--best]
    .venv-llmc/bin/python bench/peer_llmcompressor.py out/peer-nvfp4 --scheme NVFP4

Schemes:

- ``w4a16`` (default): its GPTQ, W4 symmetric group 64; ``--best`` is the best setting we found
  for it (MSE-searched scales plus activation ordering), without it its defaults.
- ``FP8_DYNAMIC``, ``NVFP4``, ``NVFP4A16``, ``MXFP4A16``: its presets of those names through
  ``QuantizationModifier`` (round-to-nearest, as its examples for them do; the calibration
  tokens set the NVFP4 global scales); ``--gptq`` runs the preset through ``GPTQModifier``
  instead.
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from peer_protocol import SAMPLES, SEQLEN, calibration_chunks, float_model

PRESETS = ("FP8_DYNAMIC", "NVFP4", "NVFP4A16", "MXFP4A16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("output")
    ap.add_argument("--scheme", choices=("w4a16", *PRESETS), default="w4a16")
    ap.add_argument("--best", action="store_true", help="w4a16: MSE-searched scales and activation ordering")
    ap.add_argument("--gptq", action="store_true", help="a preset through GPTQModifier")
    args = ap.parse_args()

    model, tok = float_model()
    chunks = calibration_chunks(tok)
    data = Dataset.from_dict({"input_ids": chunks.tolist(), "attention_mask": torch.ones_like(chunks).tolist()})
    if args.scheme == "w4a16":
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
        if args.best:
            weights |= {"observer": "mse", "actorder": "weight"}
        recipe = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                              ignore=["lm_head"])
    else:
        modifier = GPTQModifier if args.gptq else QuantizationModifier
        recipe = modifier(targets="Linear", scheme=args.scheme, ignore=["lm_head"])
    oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=SEQLEN, num_calibration_samples=SAMPLES)
    model.save_pretrained(args.output, save_compressed=True)
    tok.save_pretrained(args.output)


if __name__ == "__main__":
    main()
