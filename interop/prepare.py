"""`make test-interop`, step 1 (optc's venv): checkpoints of the default model in every
safetensors format optc writes, plus the numbers the foreign runtimes must reproduce.

One grid for all (round-to-nearest, 4-bit symmetric, groups of 64) so the formats differ only in
layout. For each checkpoint, optc's own reader scores the same windows the runtimes will score.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import torch

from optc.data import evaluation_tokens
from optc.evaluate.perplexity import perplexity, windows_of
from optc.export.convert import export_model
from optc.models import load_model
from optc.stages import RTNStage, Workspace, run_rtn

DATA = Path(os.environ.get("OPTC_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
# "dense" holds the same dequantized weights in float: the runtime's own baseline for them.
FORMATS = ("dense", "compressed-tensors", "gptq", "awq")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model("smollm2-135m")
    test = DATA / "wikitext-2-raw-test.txt"
    tokens = evaluation_tokens(loaded.tokenizer, str(test) if test.is_file() else "builtin")
    windows = [tokens[s : s + args.seqlen].tolist() for s, _ in windows_of(tokens, args.seqlen, args.seqlen, args.windows)]
    model = copy.deepcopy(loaded.model)
    ws = Workspace(model, loaded.tokenizer)
    run_rtn(ws, RTNStage(type="rtn", scheme={"bits": 4, "symmetric": True, "group_size": 64}))
    reference = {"seqlen": args.seqlen, "windows": windows, "scheme": "int4-sym-g64 (rtn)",
                 "float": perplexity(loaded.model, tokens, args.seqlen, args.windows).perplexity,
                 "in_memory": perplexity(model, tokens, args.seqlen, args.windows).perplexity, "formats": {}}
    for fmt in FORMATS:
        directory = args.out / fmt
        directory.mkdir(exist_ok=True)
        export_model(model, loaded.tokenizer, ws.qparams, fmt, directory)
        ppl = perplexity(load_model(str(directory)).model, tokens, args.seqlen, args.windows).perplexity
        reference["formats"][fmt] = {"optc_reader": ppl}
        print(f"{fmt}: optc reader perplexity {ppl:.4f}", flush=True)
    ids = torch.tensor(windows[0][:64])[None]
    with torch.no_grad():
        torch.save(model(ids).logits.float(), args.out / "reference_logits.pt")
    (args.out / "reference.json").write_text(json.dumps(reference) + "\n")


if __name__ == "__main__":
    main()
