"""`make test-interop`, step 1 (optc's venv): checkpoints of the default model in every
safetensors format optc writes, plus the numbers the foreign runtimes must reproduce.

One weight grid for the weight-only formats (round-to-nearest, 4-bit symmetric, groups of 64) so
they differ only in layout, plus two compressed-tensors ``int-quantized`` W8A8 checkpoints
(round-to-nearest int8 per-channel weights): ``int8-dynamic`` (per-token activation scales
computed at run time, as ``int8.yaml``) and ``int8-static`` (calibrated per-tensor min-max scales on 16 x
512 tokens of WikiText-2 validation; ``down_proj`` inputs dynamic per token). ``gptq-mix``
is a GPTQ checkpoint with per-module settings (GPTQModel's ``dynamic`` map): the same int4 g64
grid, ``down_proj`` int8, layer 1's q/k/v int2 (one fused key), layer 0's ``o_proj`` left float.
For each checkpoint, optc's own reader scores the same windows the runtimes will score.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import torch

from optc.data import CalibrationConfig, evaluation_tokens
from optc.evaluate.perplexity import perplexity, windows_of
from optc.export.load import load_checkpoint as load_model  # optc's readers for its own formats
from optc.compress.actquant import input_quant_of
from optc.export.source import ModelSource
from optc.run.pipeline import export_checkpoint
from optc.methods import Workspace
from optc.methods.rtn import RTNStage, run_rtn
from optc.methods.w8a8 import W8A8Stage, run_w8a8

DATA = Path(os.environ.get("OPTC_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
# "dense" holds the same dequantized weights in float: the runtime's own baseline for them.
FORMATS = ("dense", "compressed-tensors", "gptq", "awq")
MIXES = {"gptq-mix": ("gptq", {"ignore": ["lm_head", r"layers\.0\.self_attn\.o_proj"], "overrides": [
    {"pattern": "down_proj", "scheme": {"bits": 8, "group_size": 64}},
    {"pattern": r"layers\.1\.self_attn\.[qkv]_proj", "scheme": {"bits": 2, "group_size": 64}}]})}
W8A8 = {
    "int8-dynamic": {"activations": {"strategy": "token", "dynamic": True}},
    # vLLM's CPU backend has no W8A16 kernel, so down_proj (whose inputs static per-tensor int8
    # ruins) gets dynamic per-token scales instead of int8-kl.yaml's 16-bit inputs.
    "int8-static": {"activations": {"observer": "minmax"},
                    "activation_overrides": [{"pattern": "down_proj", "activations": {"strategy": "token", "dynamic": True}}]},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--formats", nargs="+", choices=[*FORMATS, *MIXES, *W8A8], default=[*FORMATS, *MIXES, *W8A8],
                    help="checkpoints to (re)write; the others keep their entries in reference.json")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                    help="unquantized tensors' dtype (optc run's default for this float32 GGUF source: bfloat16)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model("smollm2-135m")
    test = DATA / "wikitext-2-raw-test.txt"
    tokens = evaluation_tokens(loaded.tokenizer, str(test) if test.is_file() else "builtin")
    windows = [tokens[s : s + args.seqlen].tolist() for s, _ in windows_of(tokens, args.seqlen, args.seqlen, args.windows)]
    model = copy.deepcopy(loaded.model)
    ws = Workspace(model, loaded.tokenizer)
    run_rtn(ws, RTNStage(type="rtn", scheme={"bits": 4, "symmetric": True, "group_size": 64}))
    previous = args.out / "reference.json"
    reference = json.loads(previous.read_text()) if previous.is_file() else {}
    if reference.get("windows") != windows:
        reference = {"seqlen": args.seqlen, "windows": windows, "scheme": "int4-sym-g64 (rtn)",
                     "float": perplexity(loaded.model, tokens, args.seqlen, args.windows).perplexity,
                     "in_memory": perplexity(model, tokens, args.seqlen, args.windows).perplexity, "formats": {}}
    for fmt in (f for f in FORMATS if f in args.formats):
        directory = args.out / fmt
        directory.mkdir(exist_ok=True)
        # dense stays float32: the runtime's own baseline for the same weights, cast once by it.
        export_checkpoint(ModelSource(model, loaded.tokenizer, ws.qparams), fmt, directory, "2GB",
                          None if fmt == "dense" else dtype)
        ppl = perplexity(load_model(str(directory)).model, tokens, args.seqlen, args.windows).perplexity
        reference["formats"][fmt] = {"optc_reader": ppl}
        print(f"{fmt}: optc reader perplexity {ppl:.4f}", flush=True)
    def own_checkpoint(name: str, fmt: str, run) -> None:
        """A copy of the float model quantized by ``run(workspace)``, written as ``fmt`` and scored
        by optc's reader and in memory."""
        quantized = copy.deepcopy(loaded.model)
        own_ws = Workspace(quantized, loaded.tokenizer, calib)
        run(own_ws)
        directory = args.out / name
        directory.mkdir(exist_ok=True)
        src = ModelSource(quantized, loaded.tokenizer, own_ws.qparams, input_quant_of(quantized))
        export_checkpoint(src, fmt, directory, "2GB", dtype)
        ppl = perplexity(load_model(str(directory)).model, tokens, args.seqlen, args.windows).perplexity
        reference["formats"][name] = {"optc_reader": ppl,
                                      "in_memory": perplexity(quantized, tokens, args.seqlen, args.windows).perplexity}
        print(f"{name}: optc reader perplexity {ppl:.4f}", flush=True)

    valid = DATA / "wikitext-2-valid.txt"
    calib = CalibrationConfig(dataset=str(valid) if valid.is_file() else "builtin", samples=16, seqlen=512)
    for name, (fmt, extra) in ((n, m) for n, m in MIXES.items() if n in args.formats):
        scheme = {"bits": 4, "symmetric": True, "group_size": 64}
        own_checkpoint(name, fmt, lambda w, extra=extra: run_rtn(w, RTNStage(type="rtn", scheme=scheme, **extra)))
    for name, extra in ((n, e) for n, e in W8A8.items() if n in args.formats):
        # int-quantized: the inputs are quantized too
        own_checkpoint(name, "compressed-tensors",
                       lambda w, extra=extra: run_w8a8(w, W8A8Stage(type="w8a8", method="rtn", **extra)))
    ids = torch.tensor(windows[0][:64])[None]
    with torch.no_grad():
        torch.save(model(ids).logits.float(), args.out / "reference_logits.pt")
    (args.out / "reference.json").write_text(json.dumps(reference) + "\n")


if __name__ == "__main__":
    main()
