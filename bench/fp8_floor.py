"""What FP8 E4M3 rounding alone costs the default model, weights left in float32: the floor under
the `fp8` recipes' loss, on the fixed protocol (WikiText-2 test, windows of 2048 tokens).

Each condition fake-quantizes one kind of tensor as the runtime does and nothing else:
- ``inputs``: every decoder Linear's input, dynamic per token (the FP8 W8A8 dynamic scheme);
- ``keys`` / ``values`` / ``kv``: the attention cache after the rotary embedding, one static
  scale per decoder layer from the min-max of calibration windows of WikiText-2 validation (the
  `fp8-kv` recipe's observer).

    python bench/fp8_floor.py ../shared/data [--windows 40] [--conditions float inputs keys]
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from optc.compress.actquant import InputQuant, attach_input_quant, scale_from_threshold
from optc.compress.kvquant import KVCacheScheme, _wrap_cache, observe_kv, quantize_kv
from optc.compress.schemes import ActivationScheme
from optc.evaluate.perplexity import perplexity
from optc.model.anatomy import find_decoder_layers, select_linears
from optc.model.load import builtin_model_dir


def cache_scales(model, attns: list, ids: torch.Tensor, seqlen: int, windows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per attention layer, the FP8 scales of the keys and the values from their max |x| over the
    calibration windows."""
    amax = [[0.0, 0.0] for _ in attns]

    def observer(i: int):
        def fn(k: torch.Tensor, v: torch.Tensor) -> None:
            amax[i][0] = max(amax[i][0], float(k.abs().max()))
            amax[i][1] = max(amax[i][1], float(v.abs().max()))
        return fn

    with ExitStack() as hooks, torch.inference_mode():
        for i, a in enumerate(attns):
            hooks.enter_context(observe_kv(a, observer(i)))
        for w in range(windows):
            model(input_ids=ids[w * seqlen : (w + 1) * seqlen][None])
    return [(scale_from_threshold(k, float_grid=True), scale_from_threshold(v, float_grid=True)) for k, v in amax]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path, help="folder with wikitext-2-raw-test.txt and wikitext-2-valid.txt")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--calibration-windows", type=int, default=16, help="validation windows of 512 tokens")
    ap.add_argument("--conditions", nargs="+", default=["float", "inputs", "keys", "values", "kv"])
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(builtin_model_dir())

    def tokens(name: str) -> torch.Tensor:
        text = (args.data / name).read_text(encoding="utf-8")
        return tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]

    ids, cal = tokens("wikitext-2-raw-test.txt"), tokens("wikitext-2-valid.txt")
    float_ppl = None
    for cond in args.conditions:
        # A fresh model per condition: no quantizer of an earlier one left attached.
        model = AutoModelForCausalLM.from_pretrained(builtin_model_dir(), dtype=torch.float32).eval()
        if cond == "inputs":
            iq = InputQuant(ActivationScheme(type="float", strategy="token", dynamic=True))
            for module in select_linears(model, [".*"], ["lm_head"]).values():
                attach_input_quant(module, iq)
        elif cond in ("keys", "values", "kv"):
            attns = [layer.self_attn for layer in find_decoder_layers(model)[1]]
            scales = cache_scales(model, attns, cal, 512, args.calibration_windows)
            scheme = KVCacheScheme(type="float")
            for attn, (k_scale, v_scale) in zip(attns, scales):

                def transform(k, v, k_scale=k_scale, v_scale=v_scale):
                    if cond in ("keys", "kv"):
                        k = quantize_kv(k, k_scale, scheme)
                    if cond in ("values", "kv"):
                        v = quantize_kv(v, v_scale, scheme)
                    return k, v

                _wrap_cache(attn, transform)
        ppl = perplexity(model, ids, args.seqlen, args.windows).perplexity
        if cond == "float":
            float_ppl = ppl
        rel = f" ({100 * (ppl / float_ppl - 1):+.2f}%)" if float_ppl and cond != "float" else ""
        print(f"{cond:8s} {ppl:.4f}{rel}", flush=True)


if __name__ == "__main__":
    main()
