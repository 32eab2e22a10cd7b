#!/usr/bin/env bash
# A GPTQ run of the default model killed with SIGKILL after layer 10 and resumed writes the same
# checkpoint, byte for byte, as an uninterrupted run. w4a16-gptq, 32 x 512 calibration tokens of
# WikiText-2 validation, one thread in every run (the resume state is tied to the thread count).
# Prints the sha256 of every file of both checkpoints; report.json is compared without its
# timing fields and output path (report.md shows the timings, so it differs too). Usage: bench/resume_check.sh [OUT_DIR] [LAYER]  (OPTC_DATA: folder with the data)
set -euo pipefail
OUT=${1:-out/resume}
LAYER=${2:-10}
DATA=${OPTC_DATA:-/work/shared/data}
OPTC=${OPTC:-.venv/bin/optc}
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1
export OPTC_RESUME_INTERVAL=${OPTC_RESUME_INTERVAL:-0}  # save every layer: the kill lands right after layer LAYER
ARGS=(--recipe w4a16-gptq --dataset "$DATA/wikitext-2-valid.txt" --samples 32 --seqlen 512 --no-eval -q)
rm -rf "$OUT" && mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

"$OPTC" quantize "${ARGS[@]}" --output "$OUT/straight"

"$OPTC" quantize "${ARGS[@]}" --output "$OUT/killed" &
pid=$!
state="$OUT/.killed.optc-resume/progress.json"
until [ -f "$state" ] && [ "$("$PY" -c "import json,sys; print(len(json.load(open(sys.argv[1]))['layers']))" "$state" 2>/dev/null || echo 0)" -ge "$LAYER" ]; do
    kill -0 "$pid" 2>/dev/null || { echo "the run ended before layer $LAYER"; exit 1; }
    sleep 0.2
done
kill -9 "$pid"
wait "$pid" || true
echo "killed after $("$PY" -c "import json,sys; print(len(json.load(open(sys.argv[1]))['layers']))" "$state") layers; output dir present: $([ -e "$OUT/killed" ] && echo yes || echo no)"

"$OPTC" quantize "${ARGS[@]}" --output "$OUT/killed" --resume

(cd "$OUT/straight" && find . -type f ! -name "report.*" | sort | xargs sha256sum) > "$OUT/straight.sha256"
(cd "$OUT/killed" && find . -type f ! -name "report.*" | sort | xargs sha256sum) > "$OUT/killed.sha256"
cat "$OUT/killed.sha256"
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
volatile = {"created", "environment", "timings", "seconds", "path"}  # path: the two output dirs
def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k not in volatile}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x
a, b = (strip(json.loads((out / d / "report.json").read_text())) for d in ("straight", "killed"))
print("report.json (timings aside):", "identical" if a == b else "DIFFERENT")
EOF
if cmp -s "$OUT/straight.sha256" "$OUT/killed.sha256"; then
    echo "checkpoints byte-identical"
else
    diff "$OUT/straight.sha256" "$OUT/killed.sha256"; echo "checkpoints DIFFER"; exit 1
fi
