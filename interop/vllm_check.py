"""`make test-interop`, step 2 (vLLM CPU venv): vLLM itself serves optc's checkpoints.

Perplexity from prompt log-probabilities (``SamplingParams(max_tokens=1, prompt_logprobs=0)``) on
the windows ``prepare.py`` scored with optc's reader. vLLM's CPU W4A16 kernel has no float32 path;
it runs in float16 (the default here) or bfloat16, where vLLM 0.32's kernel rounds the dequantized
weights and its outputs toward zero (``vllm_kernel_check.py`` measures that), which costs a few
percent of perplexity whatever the checkpoint. Each quantized checkpoint is judged against vLLM's
score of ``dense`` (the same dequantized weights, served by the same vLLM in the same dtype),
within ``--tolerance`` (default 1%); the optc-reader score is reported beside it. The W8A8
checkpoints (``int8-*``: int8 weights and int8 activations) have no dense twin, so they are judged
against optc's reader, which quantizes the activations the same way.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
from pathlib import Path


# vLLM's CPU int8 GEMM with static per-tensor input scales runs one 8 x 512-token step in more
# than its default 300 s limit on a 2-core machine.
os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")


def vllm_perplexity(directory: Path, windows: list[list[int]], seqlen: int, memory: float, dtype: str) -> float:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # On CPU, gpu_memory_utilization is the fraction of host memory vLLM reserves (mostly KV cache).
    llm = LLM(model=str(directory), dtype=dtype, max_model_len=seqlen + 64, enforce_eager=True,
              gpu_memory_utilization=memory)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows],
                           SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll, count = 0.0, 0
    for window, out in zip(windows, outputs):
        for token, logprobs in zip(window[1:], out.prompt_logprobs[1:]):
            nll -= logprobs[token].logprob
            count += 1
    del llm
    gc.collect()
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--formats", nargs="+", default=["dense", "compressed-tensors", "gptq", "awq", "int8-dynamic"],
                    help="int8-static too: vLLM's static int8 CPU GEMM took over 30 min for the 8 windows here")
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--memory", type=float, default=0.25, help="fraction of host memory vLLM may reserve")
    args = ap.parse_args()
    ref = json.loads((args.out / "reference.json").read_text())
    results, ok = {}, True
    for fmt in args.formats:
        want = ref["formats"][fmt]["optc_reader"]
        try:
            got = vllm_perplexity(args.out / fmt, ref["windows"], ref["seqlen"], args.memory, args.dtype)
        except Exception as exc:  # noqa: BLE001 - a runtime that cannot load the file is a result
            results[fmt] = {"optc_reader": want, "vllm": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
            ok = False
            continue
        rel = got / want - 1
        results[fmt] = {"optc_reader": want, "vllm": got, "relative_to_optc": rel}
        dense = (results.get("dense") or {}).get("vllm")
        if fmt.startswith("int8"):
            ok &= abs(rel) <= args.tolerance
            dense = None  # weight-only dense weights are not these
        elif fmt != "dense" and dense is not None:
            results[fmt]["relative_to_vllm_dense"] = got / dense - 1
            ok &= abs(got / dense - 1) <= args.tolerance
        print(f"{fmt}: vLLM {got:.4f} vs optc {want:.4f} ({100 * rel:+.2f}%)"
              + (f", vs vLLM dense {100 * (got / dense - 1):+.2f}%" if fmt != "dense" and dense else ""), flush=True)
    (args.out / f"vllm_results_{args.dtype}.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
