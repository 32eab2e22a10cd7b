"""The ``dense`` format: a plain float checkpoint (``save_pretrained``) any transformers version
loads, weights as they are in memory (fake-quantized or pruned weights included)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optc.export.files import describe_safetensors, directory_bytes, quantization_config
from optc.export.registry import Format

if TYPE_CHECKING:
    import torch

    from optc.compress.quant import QuantScheme
    from optc.export.source import ExportSource

log = logging.getLogger(__name__)

NAME = "dense"


def write_dense(model: torch.nn.Module, tokenizer: Any, directory: Path, max_shard_size: str | int = "2GB") -> None:
    """A plain float checkpoint any transformers version loads (weights as they are now)."""
    model.save_pretrained(directory, max_shard_size=max_shard_size, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def _write(src: ExportSource, directory: Path, *, max_shard_bytes: int | None = None, requantize: bool = False) -> dict:
    if src.input_quant:
        log.warning("dense format keeps the fake-quantized weights but not the activation scales")
    if src.kv_quant:
        log.warning("dense format keeps the fake-quantized weights but not the KV-cache scales")
    model = getattr(src, "model", None)
    if model is not None and getattr(src, "stored", None) is None:
        write_dense(model, src.tokenizer, directory, "2GB" if max_shard_bytes is None else max_shard_bytes)
    else:  # the weights are on disk (a streamed run): written one tensor at a time
        from optc.export.packing import write_weights

        write_weights({k: src.entry(k) for k in src.keys()}, directory, max_shard_bytes or 2 * 1024**3)
        src.config.save_pretrained(directory)
        if src.generation_config is not None:
            src.generation_config.save_pretrained(directory)
        if src.tokenizer is not None:
            src.tokenizer.save_pretrained(directory)
    return {"format": NAME, "bytes": directory_bytes(directory)}


def _detect(path: Path) -> bool:
    return (Path(path) / "config.json").is_file() and quantization_config(path) is None


def _fits(scheme: QuantScheme | None, permuted: bool) -> str | None:
    return None  # float weights hold any grid's values (fake-quantized)


DENSE = Format(
    name=NAME,
    description="plain float safetensors (save_pretrained), loaded by any transformers version",
    fits=_fits,
    write=_write,
    read=None,  # transformers' from_pretrained (optc.model.load)
    detect=_detect,
    describe=lambda path: describe_safetensors(path, {"format": NAME}),
    bits_per_weight=lambda scheme, in_features: None,  # stored as in memory
    sparsity_metadata=True,
    usage="""Plain transformers (any version):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{path}")
tokenizer = AutoTokenizer.from_pretrained("{path}")
```

vLLM:

```python
from vllm import LLM

llm = LLM(model="{path}")
print(llm.generate("The capital of France is")[0].outputs[0].text)
```
""",
)
