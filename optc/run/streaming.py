"""The streaming source and sink of the run (models larger than memory), and the resume state
every run keeps.

Streaming (``calibration.streaming``) runs the same sequence as an in-memory run
(:func:`optc.run.pipeline.run_recipe`) with another source and sink: the model is built on the
meta device (:func:`open_streamed`), the stage runs layer by layer with each decoder layer read
from the input's safetensors shards only while it is calibrated and written to disk as soon as
it is done (:class:`optc.run.state.LayerStore`), both models are evaluated layer-major
(:func:`streamed_eval`, :mod:`optc.evaluate.streaming`), and the export format's writer reads
the finished layers back one tensor at a time (:func:`streamed_source`). Any format that writes
from an :class:`~optc.export.source.ExportSource` streams; the checkpoint is byte for byte the
one the in-memory run writes.

Supported: one stage of a method that streams (``Method.streams``); other recipes run in memory.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import optc
from optc.calibrate import distributed
from optc.run.state import LayerStore, state_dir_for
from optc.compress.quant import QuantParams
from optc.export.source import ModelSource
from optc.model.lazy import CheckpointSource, local_model_dir, meta_model, read_slice
from optc.model.load import LoadedModel
from optc.errors import Interrupted, OptcError
from optc.evaluate.perplexity import evaluation_token_cache
from optc.evaluate.report import record_non_finite, stage_layer_info
from optc.evaluate.streaming import streamed_perplexity
from optc.model.safetensors_io import Lazy
from optc.memory import limit_fragmentation
from optc.model.load import DEFAULT_MODEL, DTYPES, stored_dtype
from optc.progress import NullProgress, Progress
from optc.recipe import EvaluationConfig, Recipe
from optc.methods import METHODS

if TYPE_CHECKING:
    from optc.evaluate.suite import EvalOptions

log = logging.getLogger(__name__)

# "auto" streams when the weights would take more than this share of the available memory.
_AUTO_SHARE = 0.5


def streaming_problem(recipe: Recipe) -> str | None:
    """Why ``recipe`` cannot run streaming, or None."""
    types = [s.type for s in recipe.stages]
    streams = [name for name, m in METHODS.items() if m.streams]
    if len(types) != 1 or types[0] not in streams:
        return (f"streaming runs exactly one {', '.join(streams)} stage; this recipe has "
                f"{' -> '.join(types) or 'no stages'} (run it without streaming)")
    return None


def _weights_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    source = checkpoint_reader(model_dir)
    size = torch.empty((), dtype=dtype).element_size()
    return sum(size * _numel(source.spec(k)[1]) for k in source.files)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def wants_streaming(recipe: Recipe) -> bool:
    """Whether to stream: as the recipe says, or (``auto``) when the model would not fit."""
    mode = recipe.calibration.streaming
    if mode is False:
        return False
    problem = streaming_problem(recipe)
    if mode is True:
        if problem:
            raise OptcError(f"calibration.streaming: {problem}")
        return True
    try:
        model_dir = local_model_dir(recipe.model)
        need = _weights_bytes(model_dir, DTYPES[recipe.dtype])
    except OptcError:
        return False  # not a local safetensors model: only the in-memory path can load it
    import psutil

    available = psutil.virtual_memory().available
    if need <= _AUTO_SHARE * available:
        return False
    if problem:
        log.warning("the model's weights (%.1f GiB) exceed half of the available memory (%.1f GiB), "
                    "but %s", need / 2**30, available / 2**30, problem)
        return False
    log.info("streaming: the weights (%.1f GiB) exceed half of the available memory (%.1f GiB)",
             need / 2**30, available / 2**30)
    return True


def run_fingerprint(recipe: Recipe, model_path: Path | None, device: str, streaming: bool) -> dict:
    """What a run's saved layers depend on: a saved state is resumed only by an equal fingerprint."""
    files = {}
    if model_path is not None and model_path.exists():
        paths = sorted(model_path.glob("*.safetensors")) if model_path.is_dir() else [model_path]
        files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in paths}
    calibration = recipe.calibration.model_dump(mode="json")
    calibration.pop("streaming")  # "auto" and true resolve to the same run; `streaming` below
    return {
        "optc": optc.__version__, "torch": torch.__version__, "model": recipe.model or DEFAULT_MODEL,
        "model_files": files, "dtype": recipe.dtype, "calibration": calibration,
        "stages": [s.model_dump(mode="json") for s in recipe.stages], "device": device,
        "streaming": streaming,
    }


def open_store(recipe: Recipe, output: Path | None, model_path: Path | None, device: str,
               resume: bool, qparams: dict, source: CheckpointSource | None = None) -> LayerStore | None:
    """The resume state of a run writing ``output`` (none without an output: nothing to resume into)."""
    streaming = source is not None
    if distributed.active() and not streaming:
        # Every rank would save its own layers into one directory; under torchrun a run
        # restarts from the beginning (--resume is refused).
        if resume:
            raise OptcError("--resume is not available for a distributed (torchrun) run")
        return None
    if output is None:
        if not streaming:
            return None
        directory = Path(tempfile.mkdtemp(prefix="optc-stream-"))
    else:
        directory = state_dir_for(output)
    fingerprint = run_fingerprint(recipe, model_path, device, streaming)
    return LayerStore(directory, fingerprint, qparams, resume=resume and output is not None, source=source)


@contextmanager
def keeping_progress(store: LayerStore | None, resumable: bool = True) -> Iterator[None]:
    """Ctrl-C keeps the saved layers and says where they are; a user error removes them (bad
    input writes nothing); any other failure (a crash, a full disk) keeps them for ``--resume``."""
    try:
        yield
    except KeyboardInterrupt:
        if store is not None and resumable and store.has_progress():
            raise Interrupted(store.directory, store.describe()) from None
        if store is not None:
            store.remove()
        raise
    except OptcError:
        if store is not None:
            store.remove()
        raise
    except Exception:
        if store is not None and not resumable:
            store.remove()
        elif store is not None and store.has_progress():
            log.error("the run failed; its finished layers are saved in %s (--resume continues)", store.directory)
        raise


def baseline_perplexity(store: LayerStore | None, cfg: EvaluationConfig, compute: Callable[[], dict]) -> dict:
    """The baseline's perplexity, or the one the interrupted run measured with the same protocol."""
    key = cfg.model_dump(mode="json")
    saved = store.extra("perplexity_baseline") if store is not None else None
    if saved is not None and saved.get("config") == key:
        log.info("baseline perplexity from the interrupted run")
        return saved["value"]
    value = compute()
    if store is not None:
        store.save_extra("perplexity_baseline", {"config": key, "value": value})
    return value


class _PackQuantized:
    """Reads a compressed-tensors pack-quantized Linear alone (see :class:`optc.model.lazy.Unpacker`)."""

    def leaves(self, module: str) -> list[str]:
        return [f"{module}.{leaf}" for leaf in
                ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")]

    def weight(self, module: str, raw: dict[str, torch.Tensor], qc: dict) -> torch.Tensor:
        from optc.export.compressed_tensors import dequantize_packed

        return dequantize_packed(module, raw, qc)[0]


def checkpoint_reader(model_dir: Path) -> CheckpointSource:
    """The checkpoint's tensors read on demand, quantized Linears dequantized by their format."""
    try:
        qc = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError):
        qc = None  # CheckpointSource says what is wrong with the directory
    packed = qc and qc.get("quant_method") == "compressed-tensors" and qc.get("format") == "pack-quantized"
    return CheckpointSource(model_dir, _PackQuantized() if packed else None)


def _tokenizer(model_dir: Path, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise OptcError(f"cannot load the tokenizer of {model_dir}: {str(exc).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def streamed_eval(model: torch.nn.Module, source: CheckpointSource, tokens: torch.Tensor, cfg: EvaluationConfig,
                   progress: Progress, stats: dict | None = None) -> dict:
    return streamed_perplexity(model, source, tokens, cfg.seqlen, cfg.windows, cfg.stride, cfg.batch_size,
                               progress, stats=stats).to_dict()


def layer_rows(store: LayerStore, stages: list[dict]) -> tuple[list[dict], tuple[int, int, int, int]]:
    """Per-Linear report rows and (parameters, non-zeros, Linear weights, their zeros) of a
    streamed run, from the layer store's records (the weights are not in memory)."""
    schemes, errors = stage_layer_info(stages)
    rows, numel, nonzero, lin_numel, lin_zeros = [], 0, 0, 0, 0
    outer = store.outer_counts or (0, 0)
    numel, nonzero = outer
    for rec in store.layers:
        numel, nonzero = numel + rec["numel"], nonzero + rec["nonzero"]
        for name, lin in rec["linears"].items():
            err = errors.get(name)
            rows.append({"name": name, "shape": tuple(lin["shape"]), "scheme": schemes.get(name),
                         "rel_error": None if err is None else round(err, 6), "sparsity": lin["sparsity"]})
            lin_numel += _numel(tuple(lin["shape"]))
            lin_zeros += lin["zeros"]
    return rows, (numel, nonzero, lin_numel, lin_zeros)


def open_streamed(recipe: Recipe, trust_remote_code: bool) -> tuple[LoadedModel, CheckpointSource]:
    """The run's source when streaming: the model on the meta device and the input's tensors,
    read layer by layer as the stages reach them."""
    limit_fragmentation()
    model_dir = local_model_dir(recipe.model)
    reader = checkpoint_reader(model_dir)
    if reader.qc is not None:
        raise OptcError(f"streaming compresses a float checkpoint; {model_dir} is already quantized")
    model = meta_model(model_dir, DTYPES[recipe.dtype], trust_remote_code)
    from_gguf = (recipe.model or DEFAULT_MODEL) == DEFAULT_MODEL  # the built-in model's cache is a GGUF's
    loaded = LoadedModel(model, _tokenizer(model_dir, trust_remote_code), recipe.model or DEFAULT_MODEL, model_dir,
                         source_dtype=stored_dtype(model_dir), from_gguf=from_gguf)
    return loaded, reader


class StreamedTensors:
    """The streamed run's tensors on disk: finished decoder layers from the layer store's parts
    (as they were in memory, fake-quantized), every other tensor from the input checkpoint.

    What the format writer reads (:class:`optc.export.source.StoredTensors`) and what the
    layer-major evaluation of the compressed model reads (``tensors``)."""

    def __init__(self, reader: CheckpointSource, store: LayerStore) -> None:
        self.reader, self.directory = reader, store.directory
        self.parts = store.part_slices()

    def __contains__(self, key: str) -> bool:
        return key in self.parts or key in self.reader

    def tensors(self, keys) -> dict[str, torch.Tensor]:
        keys = list(keys)
        out = {k: read_slice(self.parts[k], k) for k in keys if k in self.parts}
        out.update(self.reader.tensors(k for k in keys if k not in self.parts))
        return {k: out[k] for k in keys}

    def tensor(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        return self.tensors([key])[key].to(dtype)

    def entry(self, key: str, dtype: torch.dtype):
        if key in self.parts:
            return self.parts[key]
        if key not in self.reader.files:
            raise OptcError(f"{self.reader.directory} lacks tensor {key}")
        if self.reader.spec(key)[0] == dtype:
            return self.reader.slice(key)  # copied as stored, never loaded
        return Lazy(lambda: self.tensor(key, dtype), dtype, self.reader.spec(key)[1])


class StoredGrids(Mapping):
    """The grids of a streamed run's finished layers, read back from the layer store one layer
    at a time (in solving order, as the in-memory run holds them)."""

    def __init__(self, store: LayerStore) -> None:
        self._store = store
        self._layer = {m: i for i, rec in enumerate(store.layers) for m in rec.get("qparams") or {}}
        self._cache: tuple[int, dict] = (-1, {})

    def __getitem__(self, name: str) -> QuantParams:
        i = self._layer[name]
        if self._cache[0] != i:
            self._cache = (i, self._store.layer_qparams(i))
        return self._cache[1][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layer)

    def __len__(self) -> int:
        return len(self._layer)


def streamed_source(loaded: LoadedModel, reader: CheckpointSource, store: LayerStore) -> ModelSource:
    """What the format writer reads after a streamed run: the meta model's structure with its
    tensors and grids on disk."""
    return ModelSource(loaded.model, loaded.tokenizer, StoredGrids(store), stored=StreamedTensors(reader, store))


def _schemes_of(source: CheckpointSource) -> dict[str, str]:
    """Module name -> scheme label, from a pack-quantized checkpoint's config groups."""
    from optc.compress.quant import QuantScheme

    out: dict[str, str] = {}
    for group in ((source.qc or {}).get("config_groups") or {}).values():
        w = group.get("weights") or {}
        label = QuantScheme(bits=w.get("num_bits", 4), symmetric=w.get("symmetric", True),
                            group_size=w.get("group_size") if w.get("strategy") == "group" else None).label()
        out.update({t: label for t in group.get("targets", []) if not t.startswith("re:")})
    return out


def evaluate_streaming(source_name: str | None, baseline: str | None, opts: EvalOptions, report: dict,
                       progress: Progress | None = None) -> dict:
    """``optc eval --streaming``: perplexity (and the paired change against ``baseline``) and
    size, reading one decoder layer at a time; KL, latency and tasks need the model in memory."""
    from optc.data import load_text
    from optc.evaluate.gates import check_gates, require_measurable
    from optc.evaluate.perplexity import paired_difference
    from optc.evaluate.size import size_metrics
    from optc.evaluate.suite import check_same_tokenizer, timed

    progress = progress or NullProgress()
    limit_fragmentation()
    if opts.latency is not None or opts.tasks:
        raise OptcError("--streaming measures perplexity and size; --latency and --tasks need the model in memory")
    require_measurable(opts.gates, {"eval", "size"} | ({"baseline"} if baseline is not None else set()))
    models = {"model": source_name} | ({"baseline": baseline} if baseline is not None else {})
    loaded = {}
    for role, name in models.items():
        model_dir = local_model_dir(name)
        loaded[role] = (model_dir, checkpoint_reader(model_dir), meta_model(model_dir, torch.float32),
                        _tokenizer(model_dir, False))
    timings, metrics = report.setdefault("timings", {}), report["metrics"]
    tokenizer = loaded["model"][3]
    with timed(timings, "tokenize"):
        tokens = evaluation_token_cache(tokenizer, opts.protocol.source(), opts.cache)
    if baseline is not None:
        check_same_tokenizer(tokenizer, loaded["baseline"][3], load_text(opts.protocol.source(), "evaluation", tokenizer)[:4000],
                             (source_name or DEFAULT_MODEL, baseline))
    results, stats = {}, {}
    with timed(timings, "perplexity"):
        for role, (_, src, model, _) in loaded.items():
            p = opts.protocol
            results[role] = streamed_perplexity(model, src, tokens, p.seqlen, p.windows, p.stride,
                                                p.batch_size, progress, stats=stats if role == "model" else None)
    if baseline is None:
        metrics["perplexity_model"] = results["model"].to_dict()
    else:
        metrics["perplexity_baseline"] = results["baseline"].to_dict()
        metrics["perplexity_compressed"] = results["model"].to_dict()
        metrics["perplexity_change"] = paired_difference(results["baseline"], results["model"])
    model_dir, src, model, _ = loaded["model"]
    linears = stats.get("linears", {})
    counts = (stats["numel"], stats["nonzero"], sum(_numel(tuple(v["shape"])) for v in linears.values()),
              sum(v["zeros"] for v in linears.values()))
    size = size_metrics(model, model_dir, counts=counts)
    metrics["size"] = size
    metrics["parameters"], metrics["nonzero"] = size["parameters"], size["nonzero"]
    metrics["bytes_on_disk"] = size["bytes_on_disk"]
    schemes = _schemes_of(src)
    report["layers"] = [{"name": n, "shape": tuple(v["shape"]), "scheme": schemes.get(n), "rel_error": None,
                         "sparsity": v["sparsity"]} for n, v in linears.items()]
    record_non_finite(report)
    report["gates"] = [g.to_dict() for g in check_gates(opts.gates, report)]
    return report
