"""`make bench-scale`: GPTQ W4 on a random 1.1B Llama streamed from disk; peak RSS and wall time.

The model has TinyLlama-1.1B's shape (hidden 2048, 22 layers, intermediate 5632, 32 heads,
4 key/value heads, vocabulary 32000, untied embeddings: 1.10B parameters, 4.4 GB in float32
safetensors). It is written shard by shard by ``optc.testing.write_random_model``, one tensor
at a time, so making it never needs the memory it is meant to exceed. Its tokenizer is the
default model's byte-level BPE cut to the first 32000 ids (every merge whose parts and result
survive), so the built-in corpus calibrates it.

Then one ``optc quantize --streaming`` process runs GPTQ W4 (the w4a16-gptq recipe, 16
calibration samples x 512 tokens) and evaluates both models layer-major; the peak RSS and
wall time are those of that whole process. Everything is written under a temporary directory
that is deleted afterwards (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OPTC = [sys.executable, "-m", "optc"]
VOCAB = 32000
NEEDED_BYTES = 7 * 10**9  # model 4.4 GB, checkpoint 0.8 GB, resume state and slack


def tinyllama_config(layers: int = 22):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )


def small_vocab_tokenizer(directory: Path, vocab: int):
    """The default model's tokenizer restricted to token ids below ``vocab``."""
    from transformers import AutoTokenizer

    from optc.model.load import builtin_model_dir

    source = builtin_model_dir()
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    path = directory / "tokenizer.json"
    spec = json.loads(path.read_text())
    kept = {t: i for t, i in spec["model"]["vocab"].items() if i < vocab}

    def survives(merge) -> bool:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        return a in kept and b in kept and a + b in kept

    spec["model"]["vocab"] = kept
    spec["model"]["merges"] = [m for m in spec["model"]["merges"] if survives(m)]
    spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t["id"] < vocab]
    path.write_text(json.dumps(spec, ensure_ascii=False))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert len(tokenizer) <= vocab, len(tokenizer)
    return tokenizer


def run_child(cmd: list[str], log: Path) -> tuple[float, float, float, int]:
    """Wall seconds, CPU seconds, peak RSS (GiB) and exit code of ``cmd``, its output to ``log``."""
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        with log.open("w") as fh:
            os.dup2(fh.fileno(), 1)
            os.dup2(fh.fileno(), 2)
        os.execvp(cmd[0], cmd)
    _, status, usage = os.wait4(pid, 0)
    cpu = usage.ru_utime + usage.ru_stime
    return time.perf_counter() - t0, cpu, usage.ru_maxrss * 1024 / 2**30, os.waitstatus_to_exitcode(status)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where to write (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the model and checkpoint")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=2, help="calibration samples per forward")
    ap.add_argument("--windows", type=int, default=4, help="evaluation windows (0: no evaluation)")
    ap.add_argument("--layers", type=int, default=22, help="decoder layers (fewer for a quick check)")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="optc-bench-scale-", dir=args.workdir))
    free = shutil.disk_usage(root).free
    if free < NEEDED_BYTES:
        shutil.rmtree(root)
        raise SystemExit(f"bench-scale needs {NEEDED_BYTES / 1e9:.0f} GB free under {root.parent}, "
                         f"has {free / 1e9:.1f} GB (use --workdir)")
    try:
        from optc.testing import write_random_model

        model_dir = root / "model"
        t0 = time.perf_counter()
        tokenizer = small_vocab_tokenizer(model_dir, VOCAB)
        write_random_model(model_dir, tinyllama_config(args.layers), tokenizer, max_shard_bytes=2 * 10**9)
        files = sorted(model_dir.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        print(f"model: random TinyLlama-shaped Llama, {size / 1e9:.2f} GB float32 in {len(files)} shards, "
              f"written in {time.perf_counter() - t0:.0f} s", flush=True)

        # The built-in w4a16-gptq recipe, with fewer samples per forward: a forward's working
        # memory (an MLP's activations) grows with the tokens it reads at once.
        spec = yaml.safe_load((ROOT / "recipes" / "w4a16-gptq.yaml").read_text())
        spec.setdefault("calibration", {})["batch_size"] = args.batch_size
        recipe = root / "w4a16-gptq-scale.yaml"
        recipe.write_text(yaml.safe_dump(spec, sort_keys=False))
        cmd = [*OPTC, "quantize", "--recipe", str(recipe), "--model", str(model_dir), "--streaming",
               "--samples", str(args.samples), "--seqlen", str(args.seqlen), "--output", str(root / "out"),
               "--quiet"]
        cmd += ["--windows", str(args.windows)] if args.windows else ["--no-eval"]
        print("running:", " ".join(cmd[2:]), flush=True)
        seconds, cpu, peak, code = run_child(cmd, root / "optc.log")
        if code:
            print((root / "optc.log").read_text()[-4000:])
            raise SystemExit(f"optc quantize failed with exit code {code}")
        report = json.loads((root / "out" / "report.json").read_text())
        m = report["metrics"]
        print(f"peak RSS {peak:.2f} GiB ({peak * 2**30 / size:.0%} of the model's size), wall time {seconds:.0f} s, "
              f"CPU time {cpu:.0f} s")
        print("timings:", ", ".join(f"{k} {v:.0f} s" for k, v in report["timings"].items()))
        print(f"parameters {m['parameters']:,}; checkpoint {report['checkpoint']['bytes'] / 1e9:.2f} GB "
              f"({m['size']['linear_bits_per_weight']} bits per decoder-Linear weight)")
        if args.windows:
            print(f"perplexity (random weights, {args.windows} x 512 built-in windows): baseline "
                  f"{m['perplexity_baseline']['perplexity']:.1f}, GPTQ W4 {m['perplexity_compressed']['perplexity']:.1f}")
        print(json.dumps({"peak_rss_gib": round(peak, 3), "wall_s": round(seconds, 1), "cpu_s": round(cpu, 1), "model_bytes": size,
                          "parameters": m["parameters"]}))
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
