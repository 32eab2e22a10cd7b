"""Which of optc's floating-point checkpoints (FP8, FP8 tiles, NVFP4, MXFP4, an FP8 KV cache)
vLLM on CPU serves: each is loaded by vLLM and scored on the first windows of a text, beside
plain transformers (+ compressed-tensors) on the same windows; one that vLLM refuses is listed
with the first line of its reason.

Runs in the vLLM CPU venv (`make test-interop` builds it):

    .venv-vllm/bin/python interop/vllm_float_check.py ../shared/data/wikitext-2-raw-test.txt out/fp8 out/nvfp4 ...
"""

from __future__ import annotations

import argparse
import json
import math
import traceback
from pathlib import Path

from vllm_check import vllm_perplexity  # sets vLLM's model-execution timeout before vLLM loads


def windows_of(directory: Path, text: Path, count: int, seqlen: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(directory)(text.read_text(encoding="utf-8")).input_ids
    return [ids[i * seqlen:(i + 1) * seqlen] for i in range(count)]


def transformers_perplexity(directory: Path, windows: list[list[int]]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto").eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            logits = model(ids).logits[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            count += len(w) - 1
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("text", type=Path)
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    results = {}
    for directory in args.checkpoints:
        windows = windows_of(directory, args.text, args.windows, args.seqlen)
        row: dict = {}
        scores = (("transformers", lambda: transformers_perplexity(directory, windows)),
                  ("vllm", lambda: vllm_perplexity(directory, windows, args.seqlen, 0.25, "bfloat16")))
        for reader, score in scores:
            try:
                row[reader] = round(score(), 4)
            except Exception as exc:  # noqa: BLE001 - any refusal is the result to report
                # vLLM's engine process logs the root cause above its own one-line error.
                reason = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
                row[reader] = "refused: " + (reason[-1][:300] if reason else type(exc).__name__)
        results[directory.name] = row
        print(directory.name, json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
