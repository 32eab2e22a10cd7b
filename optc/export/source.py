"""What format writers read: a model's tensors by state-dict name, its grids and its config.

Writers take an :class:`ExportSource` instead of an ``nn.Module``, so the same writer serves a
model in memory (:class:`ModelSource`) and one read from disk a tensor at a time (the streaming
run). Everything a writer needs about modules is asked by name: which are Linears, which is the
output head, which store their weight transposed (GPT-2's Conv1D).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from optc.errors import OptcError
from optc.model.patterns import fused_groups, fused_module

if TYPE_CHECKING:
    import torch

    from optc.compress.actquant import InputQuant
    from optc.compress.kvquant import KVQuant
    from optc.compress.quant import QuantParams, QuantScheme
    from optc.model.safetensors_io import Entry

log = logging.getLogger(__name__)


class ExportSource(Protocol):
    config: Any  # HF PretrainedConfig
    tokenizer: Any | None
    generation_config: Any | None
    dtype: torch.dtype  # the model's dtype, recorded in config.json
    head: str | None  # the output embedding module (lm_head), if any
    qparams: Mapping[str, QuantParams]  # Linear module name -> grid
    input_quant: Mapping[str, InputQuant]  # Linear module name -> activation quant (W8A8), may be empty
    kv_quant: Mapping[str, KVQuant]  # attention module name -> KV-cache scales, may be empty
    masks: Mapping[str, torch.Tensor]  # pruning masks, may be empty

    def keys(self) -> list[str]:
        """State-dict keys in order, tied aliases dropped (the keys a checkpoint stores)."""

    def spec(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """dtype and shape of any state-dict key (tied ones too), without loading it."""

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor of any state-dict key; may be loaded from disk on demand."""

    def entry(self, key: str) -> Entry:
        """How to write ``key`` unchanged: the tensor in memory, else a byte range or a lazy load."""

    def linears(self) -> list[str]:
        """Names of the ``nn.Linear`` modules (subclasses too), in module order."""

    def module_type(self, name: str) -> str | None:
        """``"Linear"`` for an nn.Linear, else the module's class name; None when there is none."""

    def conv1d(self, module: str) -> bool:
        """Whether ``module`` is a GPT-2 Conv1D (weight stored ``[in, out]``)."""


class StoredTensors(Protocol):
    """Tensors kept on disk for a model whose parameters are on the meta device (streaming)."""

    def tensor(self, key: str, dtype: torch.dtype) -> torch.Tensor: ...
    def entry(self, key: str, dtype: torch.dtype) -> Entry: ...


class ModelSource:
    """An :class:`ExportSource` over a model (``.model`` is it, for ``save_pretrained``).

    With ``stored``, the model's meta tensors (a streamed model holds none of its weights) are
    read from there on demand, in the dtype the model declares."""

    def __init__(self, model: Any, tokenizer: Any | None = None, qparams: Mapping | None = None,
                 input_quant: Mapping | None = None, masks: Mapping | None = None,
                 stored: StoredTensors | None = None, kv_quant: Mapping | None = None) -> None:
        import torch

        self.model = model
        self.stored = stored
        self.tokenizer = tokenizer
        self.qparams = qparams if qparams is not None else {}
        self.input_quant = input_quant if input_quant is not None else {}
        self.kv_quant = kv_quant if kv_quant is not None else {}
        self.masks = masks if masks is not None else {}
        self.config = getattr(model, "config", None)
        self.generation_config = getattr(model, "generation_config", None)
        self.dtype = getattr(model, "dtype", None)
        self._modules = dict(model.named_modules())
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.head = next((n for n, m in self._modules.items() if m is head), None) if head is not None else None
        self._linear = {n for n, m in self._modules.items() if isinstance(m, torch.nn.Linear)}
        self._state: dict | None = None

    def _all(self) -> dict:
        if self._state is None:
            self._state = self.model.state_dict()
        return self._state

    def keys(self) -> list[str]:
        from optc.model.safetensors_io import tied_keys

        drop = tied_keys(self.model)
        return [k for k in self._all() if k not in drop]

    def _get(self, key: str):
        state = self._all()
        if key not in state:
            raise OptcError(f"the model has no tensor {key}")
        return state[key]

    def spec(self, key: str):
        t = self._get(key)
        return t.dtype, tuple(t.shape)

    def tensor(self, key: str):
        t = self._get(key)
        return self.stored.tensor(key, t.dtype) if t.is_meta and self.stored is not None else t

    def entry(self, key: str):
        t = self._get(key)
        return self.stored.entry(key, t.dtype) if t.is_meta and self.stored is not None else t

    def linears(self) -> list[str]:
        return [n for n in self._modules if n in self._linear]

    def module_type(self, name: str) -> str | None:
        if name in self._linear:
            return "Linear"
        module = self._modules.get(name)
        return None if module is None else type(module).__name__

    def conv1d(self, module: str) -> bool:
        return type(self._modules.get(module)).__name__ == "Conv1D"


def uniform_scheme(qparams: Mapping[str, QuantParams], fmt: str) -> QuantScheme:
    """The one scheme of every module (formats holding one per checkpoint), or a refusal naming
    the first module that differs."""
    if not qparams:
        raise OptcError(f"{fmt} export needs quantized weights; this model has none")
    items = iter(qparams.items())
    first_name, first = next(items)
    for name, p in items:
        if (p.scheme.bits, p.scheme.symmetric) != (first.scheme.bits, first.scheme.symmetric):
            raise OptcError(
                f"{fmt} holds one scheme per checkpoint, but {first_name} is {first.scheme.label()} "
                f"and {name} is {p.scheme.label()} (mixed precision: export compressed-tensors)"
            )
    return first.scheme


def warn_unfused(src: ExportSource, fmt: str) -> int:
    """Warn when the Linears vLLM loads as one module (a layer's q/k/v_proj, its gate/up_proj)
    are stored on different schemes (or some left float): vLLM refuses such a checkpoint, other
    runtimes load it. Returns how many such sets differ."""
    labels = {n: src.qparams[n].scheme.label() if n in src.qparams else "float"
              for n in src.linears() if n != src.head}
    mixed = [g for g in fused_groups(labels) if len(g) > 1 and len({labels[n] for n in g}) > 1]
    if mixed:
        parent = mixed[0][0].rpartition(".")[0]
        fused = fused_module(mixed[0][0])
        log.warning("%s: %d sets of Linears that vLLM fuses into one module mix schemes (e.g. %s: %s): vLLM "
                    "needs one scheme for each %s and will not load this checkpoint; transformers and GPTQModel "
                    "do (a budget's fused: true, --fused, keeps them together)", fmt, len(mixed), parent,
                    ", ".join(f"{n.rpartition('.')[2]} {labels[n]}" for n in mixed[0]), fused)
    return len(mixed)


def check_linear(src: ExportSource, name: str, fmt: str) -> None:
    """Refuse a module that is not an nn.Linear of ``src`` (GPTQ and AWQ store Linear weights only)."""
    kind = src.module_type(name)
    if kind != "Linear":
        raise OptcError(f"{fmt} stores nn.Linear weights only; {name!r} is {kind or 'missing'}")


def integer_grid(scheme: QuantScheme | None, fmt: str) -> str | None:
    """Why ``fmt``, which holds integer codes only, cannot hold ``scheme`` (a float grid), or None."""
    if scheme is not None and scheme.type == "float":
        return f"{fmt} holds integer grids, not {scheme.label()} (compressed-tensors holds float grids)"
    if scheme is not None and scheme.offset_grid:
        return f"{fmt} stores integer zero points, not {scheme.label()}'s k-quant offsets (a gguf-q*_k* mix holds them)"
    return None


def refuse_activations(src: ExportSource, fmt: str) -> None:
    """Weight-only formats: a model that also quantizes activations or its KV cache would lose
    them silently."""
    if src.input_quant:
        raise OptcError(f"export format {fmt} stores weight-only quantization; this recipe also "
                        "quantizes activations (use compressed-tensors)")
    if src.kv_quant:
        raise OptcError(f"export format {fmt} stores weight-only quantization; this recipe also "
                        "quantizes the KV cache (use compressed-tensors)")


def save_tokenizer(src: ExportSource, directory: Any) -> None:
    if src.tokenizer is not None:
        src.tokenizer.save_pretrained(directory)


class CastSource:
    """An :class:`ExportSource` whose floating tensors read as ``dtype`` (the stored dtype the
    recipe's ``export.dtype`` chose), except ``keep``: the quantized Linears' weights, which the
    writer turns into codes on their grids and so must see exactly as calibrated. ``config`` is
    a copy declaring ``dtype``, so config.json says what the files hold."""

    def __init__(self, inner: ExportSource, dtype: torch.dtype, keep: set[str] | frozenset = frozenset()) -> None:
        import copy

        self.inner = inner
        self.dtype = dtype
        self.keep = set(keep)
        self.config = copy.deepcopy(inner.config)
        if self.config is not None:
            self.config.dtype = dtype
        self.tokenizer = inner.tokenizer
        self.generation_config = inner.generation_config
        self.head = inner.head
        self.qparams = inner.qparams
        self.input_quant = inner.input_quant
        self.kv_quant = inner.kv_quant
        self.masks = inner.masks
        self.stored = getattr(inner, "stored", None)  # tensors on disk (a streamed model), if any

    def _casts(self, key: str, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point and dtype != self.dtype and key not in self.keep

    def keys(self) -> list[str]:
        return self.inner.keys()

    def spec(self, key: str):
        dtype, shape = self.inner.spec(key)
        return (self.dtype if self._casts(key, dtype) else dtype), shape

    def tensor(self, key: str):
        t = self.inner.tensor(key)
        return t.to(self.dtype) if self._casts(key, t.dtype) else t

    def entry(self, key: str):
        from optc.model.safetensors_io import Lazy

        dtype, shape = self.inner.spec(key)
        if not self._casts(key, dtype):
            return self.inner.entry(key)
        # Converted only when written: casting every tensor up front held a second copy of the
        # whole model (in the stored dtype) while the files were written.
        return Lazy(lambda: self.tensor(key), self.dtype, shape)

    def linears(self) -> list[str]:
        return self.inner.linears()

    def module_type(self, name: str) -> str | None:
        return self.inner.module_type(name)

    def conv1d(self, module: str) -> bool:
        return self.inner.conv1d(module)


def stored_dtype(choice: str, source_dtype: str | None, from_gguf: bool, loaded: torch.dtype) -> torch.dtype:
    """The dtype unquantized tensors are written in. ``auto``: the source's own dtype, except a
    GGUF source, whose float32 comes only from dequantizing it (its weights were 4- to 16-bit):
    bfloat16 then, which holds float32's range, so nothing overflows as float16 could."""
    import torch

    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if choice != "auto":
        return names[choice]
    if from_gguf:
        return torch.bfloat16
    return names.get(source_dtype or "", loaded)
