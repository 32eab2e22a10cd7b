#!/usr/bin/env bash
# Release a compressed model from CI: compress with a recipe, evaluate against the float
# model, check the gates, and package the checkpoint, both reports and a sha256 manifest.
#
#   examples/release.sh RECIPE OUT_DIR
#
# Settings (environment variables, all optional):
#   MODEL      model to compress (default: the recipe's own `model:`)
#   BASELINE   model to compare with (default: MODEL, else smollm2-135m)
#   DATASET    evaluation text (default: builtin); never the calibration text
#   SEQLEN     tokens per evaluation window (default: 512)
#   WINDOWS    evaluation windows (default: 16)
#   GATES      gates, separated by ';' (default: 'ppl_increase<=5%;kl_mean<=0.05')
#   LATENCY    1 to time decode/prefill and record it in the report (default: 0)
#   OPTC       the optc command (default: optc)
#
# Output: OUT_DIR/NAME/ (checkpoint/, evaluation/report.{json,md}, SHA256SUMS) and
# OUT_DIR/NAME.tar.gz, where NAME is the recipe's file name without .yaml.
#
# Exit codes:
#   0  released
#   1  optc refused the input (recipe, model, dataset, gate syntax...): one line on stderr
#   2  usage error (wrong arguments, OUT_DIR/NAME already exists)
#   3  a gate failed: the evaluation report is in OUT_DIR/NAME.rejected/, nothing packaged
#   4  the model computed NaN or infinite values (optc's own code; the evaluation report, if
#      any, is in OUT_DIR/NAME.rejected/), nothing packaged
#   5  packaging failed (the manifest did not verify)
set -euo pipefail

usage() { echo "usage: $0 RECIPE OUT_DIR" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
recipe=$1
out=$2
name=$(basename "${recipe%.yaml}")
optc=${OPTC:-optc}
gates=${GATES:-'ppl_increase<=5%;kl_mean<=0.05'}
release="$out/$name"
[[ -e "$release" ]] && { echo "release: $release already exists" >&2; exit 2; }
mkdir -p "$out"
work=$(mktemp -d "$out/.$name.XXXXXX")
trap 'rm -rf "$work"' EXIT

model_args=()
[[ -n "${MODEL:-}" ]] && model_args=(--model "$MODEL")
baseline=${BASELINE:-${MODEL:-smollm2-135m}}

echo "release: compressing with $recipe" >&2
# A gate that needs the checkpoint's own evaluation runs below; the run itself only compresses.
$optc run "$recipe" "${model_args[@]}" --no-eval --quiet --output "$work/checkpoint" || exit $?

gate_args=()
IFS=';' read -r -a gate_list <<< "$gates"
for g in "${gate_list[@]}"; do
    [[ -n "$g" ]] && gate_args+=(--gate "$g")
done
latency_args=()
[[ "${LATENCY:-0}" == 1 ]] && latency_args=(--latency)

echo "release: evaluating against $baseline" >&2
set +e
$optc eval "$work/checkpoint" --baseline "$baseline" --dataset "${DATASET:-builtin}" \
    --seqlen "${SEQLEN:-512}" --windows "${WINDOWS:-16}" "${gate_args[@]}" "${latency_args[@]}" \
    --output "$work/evaluation"
rc=$?
set -e
if [[ $rc -eq 3 || $rc -eq 4 ]]; then
    rm -rf "$out/$name.rejected"
    mv "$work/evaluation" "$out/$name.rejected"
    echo "release: gate failed, not released; report: $out/$name.rejected/report.md" >&2
    exit $rc
fi
[[ $rc -eq 0 ]] || exit $rc

# Every file, relative to the release root, hashed; the manifest is verified before packaging.
(
    cd "$work"
    find checkpoint evaluation -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum > SHA256SUMS
    sha256sum --check --quiet SHA256SUMS
) || { echo "release: manifest did not verify" >&2; exit 5; }
mv "$work" "$release"
trap - EXIT
tar -czf "$out/$name.tar.gz" -C "$out" "$name" || exit 5
echo "release: $release ($(wc -l < "$release/SHA256SUMS") files) and $out/$name.tar.gz" >&2
