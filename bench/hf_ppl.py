"""Perplexity with plain transformers only (no optc code): the independent reader.

Loads a checkpoint with ``AutoModelForCausalLM.from_pretrained`` (compressed-tensors
checkpoints decompress through the installed ``compressed-tensors`` package) and computes the
fixed protocol: the text tokenized whole, the first N non-overlapping windows, exp(mean NLL).
"""

from __future__ import annotations

import argparse
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=40)
    # compressed-tensors 0.20 decompresses NVFP4/MXFP4 weights in bfloat16 only: those load in
    # the dtype their config declares ("auto").
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="float32")
    # transformers 5.25 with compressed-tensors 0.20 cannot load asymmetric pack-quantized
    # checkpoints the default way (the empty model's zero points are not given their packed
    # shape: llm-compressor#1618); its dequantize-on-load path reads them, one scheme per
    # checkpoint.
    ap.add_argument("--dequantize", action="store_true", help="CompressedTensorsConfig(dequantize=True)")
    args = ap.parse_args()
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    extra = {}
    if args.dequantize:
        from transformers import CompressedTensorsConfig

        extra["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **extra).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    with open(args.text, encoding="utf-8") as fh:
        ids = tok(fh.read(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in range(args.windows):
            x = ids[w * args.seqlen : (w + 1) * args.seqlen][None]
            loss = model(input_ids=x, labels=x).loss  # mean over seqlen - 1 targets
            nll += float(loss) * (x.shape[1] - 1)
            count += x.shape[1] - 1
    print(f"{math.exp(nll / count):.6f}")


if __name__ == "__main__":
    main()
