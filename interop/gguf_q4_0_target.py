"""The GGUF target of the checkpoint-formats issue, on the fixed protocol.

A Q4_0 GGUF exported from optc's GPTQ (4-bit symmetric, groups of 32: each Q4_0 block is exactly
one GPTQ group) against the plain round-to-nearest Q4_0 of the same float model (gguf's reference
quantizer, what llama.cpp's converter writes). Both files are read back through transformers'
GGUF loader (``gguf_file=``) and scored on the first N non-overlapping 2048-token windows of
WikiText-2 raw test (40 in the fixed protocol; fewer as a cheaper proxy, scored first); GPTQ
calibrates on the first 128 512-token chunks of WikiText-2 validation. Files already written in
``--out`` are reused, so an interrupted run resumes at the scoring.

    OPTC_CACHE=/tmp/optc-cache nice -n 19 python interop/gguf_q4_0_target.py --out /tmp/q4_0-target
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from optc.data import CalibrationConfig, evaluation_tokens
from optc.evaluate.perplexity import paired_difference, perplexity
from optc.export.convert import export_model
from optc.export.load import load_checkpoint as load_model  # optc's readers for its own formats
from optc.methods import Workspace
from optc.methods.gptq import GPTQStage, run_gptq

DATA = Path(os.environ.get("OPTC_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--windows", type=int, nargs="+", default=[8, 40], help="window counts, scored in order")
    ap.add_argument("--group-size", type=int, default=32)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    files = {"rtn_q4_0": args.out / "rtn-q4_0" / "model-q4_0.gguf",
             f"gptq_g{args.group_size}_q4_0": args.out / f"gptq-g{args.group_size}-q4_0" / "model-q4_0.gguf"}
    results: dict = {"seqlen": 2048}
    rtn_file, gptq_file = files.values()
    if not rtn_file.exists():
        rtn_file.parent.mkdir(exist_ok=True)
        results["rtn_export"] = export_model(loaded.model, tok, {}, "gguf-q4_0", rtn_file.parent)
    if not gptq_file.exists():
        t0 = time.perf_counter()
        model = copy.deepcopy(loaded.model)
        calib = CalibrationConfig(dataset=str(DATA / "wikitext-2-valid.txt"), samples=128, seqlen=512)
        ws = Workspace(model, tok, calib)
        run_gptq(ws, GPTQStage(type="gptq", scheme={"bits": 4, "symmetric": True, "group_size": args.group_size}))
        results["gptq_calibration_seconds"] = round(time.perf_counter() - t0, 1)
        gptq_file.parent.mkdir(exist_ok=True)
        results["gptq_export"] = export_model(model, tok, ws.qparams, "gguf-q4_0", gptq_file.parent)
        del model, ws
    print(json.dumps(results), flush=True)
    del loaded
    tokens = evaluation_tokens(tok, str(DATA / "wikitext-2-raw-test.txt"))
    models = {name: AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32).eval()
              for name, f in files.items()}
    for windows in args.windows:
        scores = {name: perplexity(m, tokens, 2048, windows) for name, m in models.items()}
        rtn, gptq = scores.values()
        results[f"windows_{windows}"] = {**{n: s.perplexity for n, s in scores.items()},
                                         "gptq_vs_rtn": paired_difference(rtn, gptq)}
        print(json.dumps(results[f"windows_{windows}"]), flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
