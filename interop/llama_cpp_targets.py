"""optc's GGUF files against llama.cpp's own quantizer, judged by llama.cpp's own tools.

For each of Q4_0, Q4_K_M, Q3_K_M and Q2_K, on the default model:

- llama.cpp: ``llama-quantize`` of optc's F16 export of the float model, without and with an
  importance matrix from ``llama-imatrix`` on the fixed protocol's calibration text (the first 128
  chunks of 512 tokens of WikiText-2 validation);
- optc: the recipe ``gguf-<type>`` (GPTQ on every tensor's type grid, the same 128 x 512 tokens);

then ``llama-perplexity --kl-divergence`` against the logits of ``--base`` (an F32 GGUF of the
float model by llama.cpp's ``convert_hf_to_gguf.py``; default optc's F16 export) on WikiText-2 raw test
(``-c 2048``, the first ``--chunks`` chunks) and ``llama-bench`` (batch 1, prompt 128, 32 new
tokens). Writes ``llama_cpp_targets.md`` in ``--out``:

    python interop/llama_cpp_targets.py --bin BUILD/bin --out out/interop/llama-cpp-targets
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_check import DATA, number, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q4_0", "q4_k_m", "q3_k_m", "q2_k"]


def measure(bin_dir: Path, path: Path, base: Path, threads: list[str], log: Path, bench: bool) -> dict:
    text = run([str(bin_dir / "llama-perplexity"), "-m", str(path), "-c", "2048", *threads,
                "--kl-divergence-base", str(base), "--kl-divergence"], log)
    size = path.stat().st_size
    row = {"bytes": size, "ppl": number(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", text),
           "mean_kld": number(r"Mean\s+KLD:\s*([-0-9.]+)", text), "kld_99": number(r"99\.0%\s+KLD:\s*([-0-9.]+)", text),
           "same_top": number(r"Same top p:\s*([0-9.]+)", text)}
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    row["bpw"] = 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)
    if bench:
        out = run([str(bin_dir / "llama-bench"), "-m", str(path), "-p", "128", "-n", "32", "-r", "3", *threads,
                   "-o", "json"], log.with_suffix(".bench.log"))
        runs = json.loads(out[out.index("["): out.rindex("]") + 1])
        row["decode_tps"] = next(r["avg_ts"] for r in runs if r["n_gen"] > 0)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, required=True, help="llama.cpp's build/bin")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--types", nargs="+", choices=TARGETS, default=TARGETS)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--base", type=Path, help="GGUF whose logits are the KLD base (default: the F16 export)")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    threads = ["-t", str(args.threads)]
    valid, test = DATA / "wikitext-2-valid.txt", DATA / "wikitext-2-raw-test.txt"
    optc = [sys.executable, "-m", "optc"]
    f16 = out / "f16" / "model-f16.gguf"
    if not f16.exists():
        subprocess.run([*optc, "export", "smollm2-135m", "--format", "gguf-f16", "--output", str(f16.parent),
                        "--overwrite"], check=True)
    base = out / "f16.kld"
    run([str(args.bin / "llama-perplexity"), "-m", str(args.base or f16), "-f", str(test), "-c", "2048", "--chunks",
         str(args.chunks), *threads, "--kl-divergence-base", str(base)], out / "f16.base.log")
    imatrix = out / "imatrix.gguf"
    run([str(args.bin / "llama-imatrix"), "-m", str(f16), "-f", str(valid), "-c", "512", "--chunks", "128",
         *threads, "--no-ppl", "-o", str(imatrix)], out / "imatrix.log")
    rows = []
    for qtype in args.types:
        files = {}
        for who, extra in (("llama.cpp", []), ("llama.cpp + imatrix", ["--imatrix", str(imatrix)])):
            path = out / f"llama-{qtype}{'-imatrix' if extra else ''}.gguf"
            run([str(args.bin / "llama-quantize"), *extra, str(f16), str(path), qtype.upper(), str(args.threads)],
                path.with_suffix(".log"))
            files[who] = path
        target = out / f"optc-{qtype}"
        subprocess.run([*optc, "run", str(ROOT / "recipes" / f"gguf-{qtype}.yaml"), "--dataset", str(valid),
                        "--no-eval", "--output", str(target), "--overwrite", "-q"], check=True)
        files["optc"] = next(target.glob("*.gguf"))
        for who, path in files.items():
            row = {"type": qtype.upper(), "who": who,
                   **measure(args.bin, path, base, threads, out / f"{path.stem}.kld.log", not args.no_bench)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| type | quantizer | file (bytes) | bits per weight | mean KLD | KLD p99 | same top token | perplexity | "
             "decode tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = f"{r['decode_tps']:.1f}" if "decode_tps" in r else "-"
        lines.append(f"| {r['type']} | {r['who']} | {r['bytes']:,} | {r['bpw']:.3f} | {r['mean_kld']:.5f} | "
                     f"{r['kld_99']:.4f} | {r['same_top']:.2f}% | {r['ppl']:.3f} | {speed} |")
    table = "\n".join(lines) + "\n"
    (out / "llama_cpp_targets.md").write_text(table)
    print(table)


if __name__ == "__main__":
    sys.exit(main())
