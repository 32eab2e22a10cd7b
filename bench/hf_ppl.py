"""Perplexity with plain transformers only (no optc code): the independent reader.

Loads a checkpoint with ``AutoModelForCausalLM.from_pretrained`` (compressed-tensors
checkpoints decompress through the installed ``compressed-tensors`` package) and computes the
fixed protocol: the text tokenized whole, the first N non-overlapping windows, exp(mean NLL).
"""

from __future__ import annotations

import argparse
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def _per_module(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """A plain transformers model whose quantized Linears are decoded one by one by
    compressed-tensors' decompressor with the scheme of the config group that names them."""
    import re
    from pathlib import Path

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    qconfig = QuantizationConfig.model_validate(config.quantization_config)
    del config.quantization_config
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(f))

    def scheme_of(module: str):
        for group in qconfig.config_groups.values():
            for t in group.targets:
                if t == module or (t.startswith("re:") and re.fullmatch(t[3:], module)):
                    return group
        raise KeyError(f"no config group names {module}")

    dense: dict[str, torch.Tensor] = {}
    quantized = {k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight_packed", ".weight_scale"))}
    for module in sorted(quantized):
        scheme = scheme_of(module)
        own = {k[len(module) + 1:]: v for k, v in tensors.items() if k.startswith(module + ".")}
        compressor = BaseCompressor.get_value_from_registry(scheme.format or qconfig.format)
        dense[module + ".weight"] = compressor.decompress(own, scheme)["weight"]
    for k, v in tensors.items():
        if k.rsplit(".", 1)[0] not in quantized:
            dense[k] = v
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in dense.items()}, strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise RuntimeError(f"weights not matched: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=40)
    # compressed-tensors 0.20 decompresses NVFP4/MXFP4 weights in bfloat16 only: those load in
    # the dtype their config declares ("auto").
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="float32")
    # transformers 5.25 with compressed-tensors 0.20 cannot load asymmetric pack-quantized
    # checkpoints the default way (the empty model's zero points are not given their packed
    # shape: llm-compressor#1618); its dequantize-on-load path reads them, one scheme per
    # checkpoint.
    ap.add_argument("--dequantize", action="store_true", help="CompressedTensorsConfig(dequantize=True)")
    # That path decompresses every module with one config group's scheme, so a checkpoint mixing
    # asymmetric schemes needs each module decoded with its own group's: compressed-tensors' own
    # decompressor per module, the dense weights then loaded into a plain transformers model.
    ap.add_argument("--per-module", action="store_true",
                    help="decompress each module with compressed-tensors and its own config group's scheme")
    args = ap.parse_args()
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    extra = {}
    if args.dequantize:
        from transformers import CompressedTensorsConfig

        extra["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    if args.per_module:
        model = _per_module(args.model, torch.float32 if dtype == "auto" else dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **extra).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    with open(args.text, encoding="utf-8") as fh:
        ids = tok(fh.read(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in range(args.windows):
            x = ids[w * args.seqlen : (w + 1) * args.seqlen][None]
            loss = model(input_ids=x, labels=x).loss  # mean over seqlen - 1 targets
            nll += float(loss) * (x.shape[1] - 1)
            count += x.shape[1] - 1
    print(f"{math.exp(nll / count):.6f}")


if __name__ == "__main__":
    main()
