#!/usr/bin/env bash
# Two-rank gloo calibration equals one rank: GPTQ w4a16 on the default model, 32 x 512 calibration
# tokens of WikiText-2 validation, then both checkpoints evaluated in one paired pass on WikiText-2
# raw test (16 x 512). The report's perplexity change between them is the number to read (target:
# within 0.1%). Usage: bench/distributed.sh [OUT_DIR]  (OPTC_DATA: folder with the two files)
set -euo pipefail
OUT=${1:-out/distributed}
DATA=${OPTC_DATA:-/work/shared/data}
OPTC=${OPTC:-.venv/bin/optc}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
CALIB=(--recipe w4a16-gptq --dataset "$DATA/wikitext-2-valid.txt" --samples 32 --seqlen 512 --no-eval -q --overwrite)
"$OPTC" quantize "${CALIB[@]}" --output "$OUT/one-rank"
"$TORCHRUN" --standalone --nproc-per-node 2 -m optc quantize "${CALIB[@]}" --output "$OUT/two-ranks"
"$OPTC" eval "$OUT/two-ranks" --baseline "$OUT/one-rank" --dataset "$DATA/wikitext-2-raw-test.txt" \
    --seqlen 512 --windows 16 --output "$OUT/two-ranks-vs-one" --overwrite
