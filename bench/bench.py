"""`make bench`: the fixed protocol on the default model, one process per recipe.

Protocol (see README): float32 SmolLM2-135M; calibration on the first 128 non-overlapping
512-token chunks of WikiText-2 validation; perplexity on the first 40 non-overlapping
2048-token windows of WikiText-2 raw test, and the same on an out-of-domain text that no stage
ever sees (the King James Bible, ``bench/ood_text.py``). Each recipe runs as its own `optc quantize` process
so wall time and peak RSS are those of the whole command, start to written checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ood_text import fetch as fetch_ood

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("OPTC_DATA", ROOT.parent / "shared" / "data"))
CALIB = DATA / "wikitext-2-valid.txt"
TEST = DATA / "wikitext-2-raw-test.txt"
OPTC = [sys.executable, "-m", "optc"]
RECIPES = ["w4a16-rtn", "w4a16-gptq", "w4a16-awq", "w8a16-gptq"]
# Pruning rows: each is written in its recipe's own format (dense for prune-only recipes).
RECIPES += ["prune-2of4-magnitude", "prune-2of4-wanda", "prune-2of4-sparsegpt", "prune-50-wanda",
            "prune-heads", "sparse-2of4-w4a16"]
# W8A8 rows: one per static activation observer, then SmoothQuant, then the default int8.
RECIPES += ["int8-minmax", "int8-moving-minmax", "int8-percentile", "int8-mse", "int8-kl",
            "int8-smoothquant", "int8"]


def run_child(cmd: list[str]) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        os.execvp(cmd[0], cmd)
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} failed")
    return time.perf_counter() - t0, usage.ru_maxrss / 2**20, ""


def evaluate(model: str, windows: int, text: Path = TEST) -> float:
    out = subprocess.run(
        [*OPTC, "eval", model, "--dataset", str(text), "--seqlen", "2048", "--windows", str(windows), "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    metrics = json.loads(out)["metrics"]
    return metrics["perplexity_model"]["perplexity"]


def evaluate_hf(model: str, windows: int) -> float:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hf_ppl.py"), model, str(TEST), "--windows", str(windows)],
        check=True, capture_output=True, text=True,
    ).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipes", nargs="*", default=RECIPES)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--format", default=None, help="force one export format (default: each recipe's own)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results.md")
    ap.add_argument("--no-transformers", action="store_true",
                    help="skip the second evaluation through plain transformers")
    ap.add_argument("--no-baseline", action="store_true", help="skip the float32 row")
    ap.add_argument("--no-ood", action="store_true", help="skip the out-of-domain perplexity")
    args = ap.parse_args()
    ood = None if args.no_ood else fetch_ood()

    def ood_ppl(model: str) -> float | None:
        return None if ood is None else evaluate(model, args.windows, ood)

    for f in (CALIB, TEST):
        if not f.is_file():
            raise SystemExit(f"missing {f} (set OPTC_DATA to the folder holding WikiText-2)")
    rows = [] if args.no_baseline else [
        ("float32 baseline", evaluate("smollm2-135m", args.windows), ood_ppl("smollm2-135m"), None, None, None, None)]
    work = Path(tempfile.mkdtemp(prefix="optc-bench-"))
    try:
        for recipe in args.recipes:
            out_dir = work / recipe
            cmd = [*OPTC, "quantize", "--recipe", recipe, "--dataset", str(CALIB), "--samples", "128",
                   "--seqlen", "512", "--no-eval", "--output", str(out_dir)]
            cmd += ["--format", args.format] if args.format else []
            seconds, rss, _ = run_child(cmd)
            size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
            written = json.loads((out_dir / "report.json").read_text())["checkpoint"]["format"]
            hf = None
            if written.startswith("compressed-tensors") and not args.no_transformers:
                hf = evaluate_hf(str(out_dir), args.windows)
            rows.append((recipe, evaluate(str(out_dir), args.windows), ood_ppl(str(out_dir)), hf, seconds, rss,
                         size / 2**20))
            # one line per finished recipe, so a long run that dies keeps what it measured
            print(f"{recipe}: done {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        "| recipe | WikiText-2 perplexity (optc) | out-of-domain perplexity (KJV) | WikiText-2 (transformers) "
        "| quantize wall (s) | peak RSS (GiB) | checkpoint (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, ppl, ood_p, hf, sec, rss, size in rows:
        fmt = lambda v, d: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        lines.append(
            f"| {name} | {ppl:.2f} | {fmt(ood_p, 2)} | {fmt(hf, 2)} | {fmt(sec, 0)} | {fmt(rss, 2)} | {fmt(size, 1)} |"
        )
    table = "\n".join(lines)
    print(table)
    args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
