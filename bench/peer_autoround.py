"""The optimized-rounding peer, measured on the host at hand: Intel's AutoRound on the fixed
protocol (W4 sym group 64 by default, 128 x 512 WikiText-2 validation tokens, `lm_head`
unquantized), start to written compressed-tensors checkpoint.

Runs in its own venv (AutoRound pins its own transformers); optc is not imported, so the default
model is read from the float checkpoint optc converts it to (run `make demo` or any optc command
once first). Usage, timing the whole process:

    python3 -m venv .venv-ar && .venv-ar/bin/pip install torch==2.13.0 'auto-round==0.16.1'
    /usr/bin/time -v .venv-ar/bin/python bench/peer_autoround.py out/peer-round [--light] [--bits 3 --asym]

Without flags, its defaults (200 iterations at learning rate 1/iters, batch 8); ``--light`` is
its light preset (50 iterations at 5e-3). AutoRound writes the compressed-tensors checkpoint one
folder down (``out/peer-round/smollm2-135m-w4g64``); it is evaluated like optc's:
`python bench/hf_ppl.py out/peer-round/smollm2-135m-w4g64 ../shared/data/wikitext-2-raw-test.txt`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from auto_round import AutoRound
from peer_protocol import SAMPLES, SEQLEN, calibration_chunks, float_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("output")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--asym", action="store_true", help="a zero point per group (default symmetric)")
    ap.add_argument("--light", action="store_true", help="its light preset: 50 iterations at lr 5e-3")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true", help="pass enable_torch_compile=False")
    args = ap.parse_args()

    model, tok = float_model()
    chunks = list(calibration_chunks(tok)[:, None])  # one [1, SEQLEN] batch per sample
    iters = args.iters if args.iters is not None else (50 if args.light else 200)
    options = {"lr": 5e-3} if args.light and args.iters is None else {}
    if args.no_compile:
        options["enable_torch_compile"] = False
    ar = AutoRound(
        model, tokenizer=tok, bits=args.bits, group_size=args.group_size, sym=not args.asym, iters=iters,
        dataset=chunks, nsamples=SAMPLES, seqlen=SEQLEN, batch_size=8, device_map="cpu", **options,
    )
    # lm_head stays unquantized: AutoRound's default (quant_lm_head=False), as in optc's recipes.
    ar.quantize_and_save(args.output, format="llm_compressor")
    # AutoRound writes the checkpoint (tokenizer included) one folder down, named after the model.
    written = [p.parent for p in Path(args.output).glob("*/config.json")]
    print(f"wrote {', '.join(map(str, written))}")


if __name__ == "__main__":
    main()
