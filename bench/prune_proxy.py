"""Which SparseGPT regularizers hold out of domain: per-Linear reconstruction errors on unseen text.

For a few decoder layers of the float default model this collects each Linear's weight and three
input Hessians: WikiText-2 validation split into even and odd calibration samples, and the King
James Bible (``bench/ood_text.py``; 64 x 512 tokens after the 40 evaluation windows). Every variant
prunes 2:4 from the even-sample Hessian only; its error ``tr((W - W_hat) H (W - W_hat)^T)`` is then
measured on the fit Hessian, the held-out odd samples and the Bible, as the geometric mean over
Linears of the ratio to plain SparseGPT's error. No error propagation between layers: a guide for
which full runs to make, not a substitute for them.

    python bench/prune_proxy.py [--layers 3,12,22,28] [--hessians FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ood_text import fetch as fetch_ood  # noqa: E402

from optc.compress.sparsegpt import masked_least_squares, shrink_hessian, sparsegpt_prune  # noqa: E402
from optc.data import CalibrationConfig  # noqa: E402
from optc.model.load import load_model  # noqa: E402

DATA = Path(os.environ.get("OPTC_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
EVAL_TOKENS = 40 * 2048  # the evaluation windows, never used here


def collect(layers: list[int]) -> dict[str, dict[str, torch.Tensor]]:
    loaded = load_model("smollm2-135m", dtype="float32")
    model, tok = loaded.model.eval(), loaded.tokenizer
    wiki = CalibrationConfig(dataset=str(DATA / "wikitext-2-valid.txt"), samples=128, seqlen=512).token_ids(tok)
    bible = tok(fetch_ood().read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    sets = {"even": wiki[0::2], "odd": wiki[1::2], "bible": bible[EVAL_TOKENS:EVAL_TOKENS + 64 * 512].view(64, 512)}
    out: dict[str, dict[str, torch.Tensor]] = {}
    current = {"set": ""}
    hooks = []
    for li in layers:
        for n, m in model.model.layers[li].named_modules():
            if isinstance(m, torch.nn.Linear):
                name = f"{li}.{n}"
                out[name] = {"W": m.weight.detach().clone()}

                def hook(_m, args, name=name):
                    x = args[0].reshape(-1, args[0].shape[-1]).double()
                    h = out[name].get(current["set"])
                    out[name][current["set"]] = x.T @ x if h is None else h + x.T @ x

                hooks.append(m.register_forward_pre_hook(hook))
    last = max(layers)
    with torch.inference_mode():
        for key, ids in sets.items():
            current["set"] = key
            for i in range(0, ids.shape[0], 4):
                x = ids[i:i + 4]
                h = model.model.embed_tokens(x)
                pos = torch.arange(x.shape[1])[None]
                pe = model.model.rotary_emb(h, pos)
                for layer in model.model.layers[:last + 1]:  # causal attention without a mask
                    h = layer(h, position_embeddings=pe, attention_mask=None, position_ids=pos)
                    h = h[0] if isinstance(h, tuple) else h
    for h in hooks:
        h.remove()
    for d in out.values():
        for key, ids in sets.items():
            d[key] = (d[key] * 2 / ids.numel()).float()
    return out


def variants() -> dict:
    def plain(W, H):
        return sparsegpt_prune(W, H, nm=(2, 4)).weight

    def refit(lam=0.01, a=0.0):
        def f(W, H):
            Hs = shrink_hessian(H, a) if a else H
            r = sparsegpt_prune(W, Hs, nm=(2, 4))
            return masked_least_squares(W, Hs, r.mask, start=r.weight, dampening=lam, tol=1e-3)
        return f

    def shrunk(a):
        return lambda W, H: sparsegpt_prune(W, shrink_hessian(H, a), nm=(2, 4)).weight

    def blend(b):
        def f(W, H):
            r = sparsegpt_prune(W, H, nm=(2, 4))
            return (1 - b) * r.weight + b * masked_least_squares(W, H, r.mask, start=r.weight, tol=1e-3)
        return f

    return {
        "plain SparseGPT": plain,
        "refit, dampening 0.01": refit(0.01), "refit, dampening 0.1": refit(0.1), "refit, dampening 1": refit(1.0),
        "blend 0.5 sweep / refit": blend(0.5),
        "sweep dampening 0.1": lambda W, H: sparsegpt_prune(W, H, nm=(2, 4), dampening=0.1).weight,
        "shrinkage 0.2, no refit": shrunk(0.2),
        "shrinkage 0.2 + refit": refit(0.01, 0.2), "shrinkage 0.35 + refit": refit(0.01, 0.35),
        "shrinkage 0.5 + refit": refit(0.01, 0.5), "shrinkage 0.7 + refit": refit(0.01, 0.7),
    }


def error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    D = (W - W_hat).double()
    return float(((D @ H.double()) * D).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="3,12,22,28")
    ap.add_argument("--hessians", type=Path, help="cache of the collected Hessians (written if missing)")
    args = ap.parse_args()
    if args.hessians is not None and args.hessians.is_file():
        data = torch.load(args.hessians)
    else:
        data = collect([int(x) for x in args.layers.split(",")])
        if args.hessians is not None:
            torch.save(data, args.hessians)
    logs: dict[str, dict[str, list[float]]] = {}
    for d in data.values():
        results = {name: f(d["W"], d["even"]) for name, f in variants().items()}
        base = results["plain SparseGPT"]
        for name, W_hat in results.items():
            for key in ("even", "odd", "bible"):
                ratio = error(d["W"], W_hat, d[key]) / error(d["W"], base, d[key])
                logs.setdefault(name, {}).setdefault(key, []).append(math.log(ratio))
    print("| variant (2:4, fit on even samples) | fit | held-out WikiText | King James Bible |")
    print("|---|---|---|---|")
    for name, by in logs.items():
        cells = " | ".join(f"{math.exp(sum(v) / len(v)):.3f}" for v in (by["even"], by["odd"], by["bible"]))
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
