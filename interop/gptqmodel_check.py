"""`make test-interop`, step 3 (gptqmodel venv): transformers loads optc's GPTQ and AWQ checkpoints
through optimum + gptqmodel (its CPU ``TorchAtenLinear`` kernel) and computes the same logits.
A GPTQ checkpoint with per-module settings (``dynamic`` in its config: ``gptq-mix``) loads with
GPTQModel's own loader, since transformers' optimum path ignores ``dynamic``.

Set ``GPTQMODEL_CPU_WORKERS=2`` on a 2-core machine (gptqmodel refuses to start otherwise).
float32 by default: its int4 CPU matmul takes ~24 s per 512-token window in float32 and ~4 s in
bfloat16 here, but about 5 minutes in float16 (no float16 fast path on this CPU).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def load(directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    qc = json.loads((directory / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("dynamic"):
        from gptqmodel import BACKEND, GPTQModel

        return GPTQModel.load(str(directory), device="cpu", backend=BACKEND.TORCH, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(directory, device_map="cpu", dtype=dtype).eval()


def score(directory: Path, windows: list[list[int]], first: torch.Tensor, reference: torch.Tensor,
          dtype: torch.dtype) -> tuple[float, float]:
    model = load(directory, dtype)
    nll, count = 0.0, 0
    with torch.no_grad():
        diff = float((model(first).logits.float() - reference).abs().max())
        for w in windows:
            ids = torch.tensor(w)[None]
            logp = torch.log_softmax(model(ids).logits.float()[0, :-1], dim=-1)
            nll -= float(logp.gather(1, ids[0, 1:, None]).sum())
            count += ids.shape[1] - 1
    return math.exp(nll / count), diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--formats", nargs="+", default=["gptq", "gptq-mix", "awq"])
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = ap.parse_args()
    ref = json.loads((args.out / "reference.json").read_text())
    reference = torch.load(args.out / "reference_logits.pt")
    first = torch.tensor(ref["windows"][0][:64])[None]
    results, ok = {}, True
    for fmt in args.formats:
        want = ref["formats"][fmt]["optc_reader"]
        try:
            got, diff = score(args.out / fmt, ref["windows"], first, reference, getattr(torch, args.dtype))
        except Exception as exc:  # noqa: BLE001 - a runtime that cannot load the file is a result
            results[fmt] = {"optc_reader": want, "transformers_gptqmodel": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
            ok = False
            continue
        rel = got / want - 1
        ok &= abs(rel) <= args.tolerance
        results[fmt] = {"optc_reader": want, "transformers_gptqmodel": got, "relative": rel, "max_logit_diff": diff}
        print(f"{fmt}: transformers+gptqmodel {got:.4f} vs optc {want:.4f} ({100 * rel:+.2f}%), max |dlogit| {diff:.4f}", flush=True)
    (args.out / f"gptqmodel_results_{args.dtype}.json").write_text(json.dumps(results, indent=2) + "\n")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
