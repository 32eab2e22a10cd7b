"""`make test-interop`: llama.cpp's own tools load every GGUF type optc writes and agree with optc.

For each type, the default model quantized by round-to-nearest on the grid the type holds exactly
(Q4_0/Q5_0/Q8_0: symmetric 4/5/8 bits; Q4_1/Q5_1: asymmetric 4/5 bits; groups of 32), and for
each llama.cpp mix (Q2_K ... Q6_K) on the grid of every tensor's type (k-quant super-blocks where
the rows are whole super-blocks, llama.cpp's fallback types elsewhere), is exported by optc and
then, with llama.cpp's binaries:

- ``llama-perplexity`` scores WikiText-2 raw test (``-c 2048``, the first ``--chunks`` chunks;
  llama.cpp scores the second half of each chunk) against the logits of optc's F16 export of the
  float model (``--kl-divergence-base``): perplexity, mean and 99th-percentile KLD, same top token;
- optc reads the same file (transformers' GGUF loader under optc's reader) and scores the very
  tokens llama.cpp scored (read back from the base logits file), the same positions, the same BOS
  rule: the two perplexities must agree within ``--tolerance``;
- ``llama-bench`` (batch 1, ``-t`` threads): prompt and decode tokens per second;
- ggml's own dequantization of every tensor (``to_float`` of its type, called in libggml-base)
  equals the ``gguf`` package's bit for bit (which the main suite proves equal to optc's weights).

    python interop/llama_cpp_check.py --bin BUILD/bin --out out/interop/llama-cpp
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from optc.data import evaluation_tokens
from optc.export.formats import FORMATS
from optc.export.gguf_mix import MIXES
from optc.export.load import load_checkpoint
from optc.export.source import ModelSource
from optc.methods import Workspace
from optc.methods.base import Override
from optc.methods.rtn import RTNStage, run_rtn
from optc.run.pipeline import export_checkpoint

DATA = Path(os.environ.get("OPTC_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
# GGUF type -> the grid it holds exactly (None: float16 weights, the KLD base)
TYPES = {
    "f16": None,
    "q8_0": {"bits": 8, "symmetric": True, "group_size": 32},
    "q5_1": {"bits": 5, "symmetric": False, "group_size": 32},
    "q5_0": {"bits": 5, "symmetric": True, "group_size": 32},
    "q4_1": {"bits": 4, "symmetric": False, "group_size": 32},
    "q4_0": {"bits": 4, "symmetric": True, "group_size": 32},
}


def run(cmd: list[str], log: Path) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text(out.stdout + out.stderr)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}); see {log}:\n{out.stderr[-2000:]}")
    return out.stdout + out.stderr


def number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if m is None:
        raise SystemExit(f"llama.cpp output has no match for {pattern!r}")
    return float(m.group(1))


def base_tokens(path: Path) -> tuple[int, np.ndarray]:
    """n_ctx and the [chunks, n_ctx] tokens of a ``--kl-divergence-base`` file (perplexity.cpp:
    ``_logits_``, uint32 n_ctx, int32 n_vocab, int32 n_chunk, int32 tokens[n_chunk * n_ctx])."""
    with path.open("rb") as f:
        if f.read(8) != b"_logits_":
            raise SystemExit(f"{path} is not a llama.cpp logits file")
        n_ctx, _n_vocab, n_chunk = np.frombuffer(f.read(12), dtype="<i4")
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype="<i4")
    return int(n_ctx), tokens.reshape(n_chunk, n_ctx)


def ggml_matches_gguf(bin_dir: Path, path: Path) -> list[str]:
    """Tensors of ``path`` that llama.cpp's own dequantization (ggml's ``to_float`` of each type,
    from libggml-base) reads differently from the ``gguf`` package's reader, which the main suite
    proves equal to optc's weights; empty when every one agrees bit for bit."""
    import ctypes

    from gguf import GGUFReader, dequantize

    class Traits(ctypes.Structure):  # ggml.h: struct ggml_type_traits
        _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                    ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                    ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]

    to_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)
    lib = ctypes.CDLL(str(next(bin_dir.glob("libggml-base.so*"))))
    lib.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    differ = []
    for t in GGUFReader(str(path)).tensors:
        if t.tensor_type.name in ("F32", "F16"):
            continue
        raw = np.ascontiguousarray(t.data)
        out = np.empty(int(t.n_elements), dtype=np.float32)
        to_float(lib.ggml_get_type_traits(int(t.tensor_type)).contents.to_float)(
            raw.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
        if not np.array_equal(out, dequantize(raw, t.tensor_type).reshape(-1)):
            differ.append(t.name)
    return differ


@torch.inference_mode()
def llama_protocol_ppl(model: torch.nn.Module, chunks: np.ndarray, bos: int | None) -> float:
    """Perplexity as perplexity.cpp computes it: each chunk's first token replaced by BOS when the
    vocabulary adds one, logits at positions n_ctx/2 .. n_ctx-2 scored on the next token."""
    nll, count = 0.0, 0
    for chunk in chunks:
        ids = torch.from_numpy(chunk.astype(np.int64)).clone()
        if bos is not None:
            ids[0] = bos
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
        first = ids.numel() // 2
        nll += float(F.cross_entropy(logits[first:-1], ids[first + 1 :], reduction="sum"))
        count += ids.numel() - 1 - first
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, required=True, help="llama.cpp's build/bin")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tolerance", type=float, default=0.01, help="relative perplexity agreement")
    ap.add_argument("--types", nargs="+", choices=[*TYPES, *MIXES], default=[*TYPES, *MIXES])
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    test = DATA / "wikitext-2-raw-test.txt"
    loaded = load_checkpoint("smollm2-135m")
    files: dict[str, Path] = {}
    for qtype in dict.fromkeys(["f16", *args.types]):
        directory = args.out / qtype
        directory.mkdir(exist_ok=True)
        model, qparams = loaded.model, {}
        if qtype in MIXES:  # every Linear on the grid of its tensor type in the mix
            schemes = FORMATS[f"gguf-{qtype}"].linear_schemes(loaded.model)
            stage = RTNStage(type="rtn", overrides=[Override(pattern=f"^{re.escape(n)}$", scheme=sc)
                                                    for n, sc in schemes.items()])
        else:
            stage = None if TYPES[qtype] is None else RTNStage(type="rtn", scheme=TYPES[qtype])
        if stage is not None:
            model = copy.deepcopy(loaded.model)
            ws = Workspace(model, loaded.tokenizer)
            run_rtn(ws, stage)
            qparams = ws.qparams
        export_checkpoint(ModelSource(model, loaded.tokenizer, qparams), f"gguf-{qtype}", directory, "2GB")
        files[qtype] = directory / f"model-{qtype}.gguf"
    threads = ["-t", str(args.threads)]
    base = args.out / "f16.kld"
    run([str(args.bin / "llama-perplexity"), "-m", str(files["f16"]), "-f", str(test), "-c", "2048",
         "--chunks", str(args.chunks), *threads, "--kl-divergence-base", str(base)], args.out / "f16.base.log")
    n_ctx, chunks = base_tokens(base)
    # llama.cpp tokenizes with the file's own vocabulary and pre-tokenizer; optc's evaluation
    # tokenizes with the tokenizer transformers rebuilt from it.
    ours = evaluation_tokens(loaded.tokenizer, str(test))[: chunks.size].numpy()
    theirs = chunks.reshape(-1)[: ours.size]
    differ = np.flatnonzero(ours != theirs)
    tokens = (f"optc's tokenizer and llama.cpp's give the same {chunks.size} tokens" if not differ.size
              else f"optc's tokenizer and llama.cpp's first differ at token {int(differ[0])} of {chunks.size}")
    print(tokens, flush=True)
    rows, failures = [], []
    for qtype in args.types:
        path = files[qtype]
        text = run([str(args.bin / "llama-perplexity"), "-m", str(path), "-c", str(n_ctx), *threads,
                    "--kl-divergence-base", str(base), "--kl-divergence"], args.out / f"{qtype}.kld.log")
        if differ := ggml_matches_gguf(args.bin, path):
            failures.append(f"{qtype}: llama.cpp dequantizes {len(differ)} tensor(s) differently, {differ[0]} first")
        reread = load_checkpoint(str(path))
        add_bos = bool(getattr(reread.tokenizer, "add_bos_token", False))
        optc_ppl = llama_protocol_ppl(reread.model, chunks, reread.tokenizer.bos_token_id if add_bos else None)
        row = {
            "type": qtype.upper(),
            "bytes": path.stat().st_size,
            "llama_ppl": number(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", text),
            "optc_ppl": optc_ppl,
            "mean_kld": number(r"Mean\s+KLD:\s*([-0-9.]+)", text),
            "kld_99": number(r"99\.0%\s+KLD:\s*([-0-9.]+)", text),
            "same_top": number(r"Same top p:\s*([0-9.]+)", text),
        }
        if not args.no_bench:
            bench = run([str(args.bin / "llama-bench"), "-m", str(path), "-p", "128", "-n", "32", "-r", "2",
                         *threads, "-o", "json"], args.out / f"{qtype}.bench.log")
            runs = json.loads(bench[bench.index("[") : bench.rindex("]") + 1])
            row["prompt_tps"] = next(r["avg_ts"] for r in runs if r["n_prompt"] > 0)
            row["decode_tps"] = next(r["avg_ts"] for r in runs if r["n_gen"] > 0)
        rel = abs(row["optc_ppl"] - row["llama_ppl"]) / row["llama_ppl"]
        if rel > args.tolerance:
            failures.append(f"{qtype}: llama.cpp {row['llama_ppl']:.4f} vs optc {row['optc_ppl']:.4f} ({rel:.2%})")
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = ["| type | file (MiB) | llama-perplexity | optc, same tokens | mean KLD | KLD p99 | same top token | "
             "prompt tok/s | decode tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = (f"{r['prompt_tps']:.0f} | {r['decode_tps']:.1f}" if "decode_tps" in r else "- | -")
        lines.append(f"| {r['type']} | {r['bytes'] / 2**20:.1f} | {r['llama_ppl']:.3f} | {r['optc_ppl']:.3f} | "
                     f"{r['mean_kld']:.5f} | {r['kld_99']:.4f} | {r['same_top']:.2f}% | {speed} |")
    table = "\n".join(lines)
    table += f"\n\nTokens: {tokens} (WikiText-2 raw test).\n"
    (args.out / "llama_cpp.md").write_text(table)
    print(table)
    if failures:
        raise SystemExit("perplexity disagrees:\n" + "\n".join(failures))


if __name__ == "__main__":
    sys.exit(main())
