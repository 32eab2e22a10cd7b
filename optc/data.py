"""Text sources for calibration and evaluation, and their tokenization.

A dataset is named by a string:

- ``builtin``: an offline corpus that ships with Python itself (the stdlib's pydoc topic
  texts), so a fresh machine with no data and no network can still calibrate and evaluate.
  Its calibration and evaluation parts are disjoint topics.
- ``wikitext2`` / ``c4``: Hugging Face datasets, only where a network (or a local HF cache)
  exists. Calibration uses the train split, evaluation the test (wikitext2) or validation (c4).
- a path to a ``.txt`` file (used whole) or a ``.jsonl`` file (the ``text`` field of each line).

Calibration never reads evaluation text: the named sources split by role, and a local file
used for both roles is refused by :func:`check_disjoint`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from optc.errors import OptcError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Role = Literal["calibration", "evaluation"]
NAMED = ("builtin", "wikitext2", "c4")
# Share of pydoc topics used for calibration; the rest is held out for evaluation.
_BUILTIN_CALIB_SHARE = 0.75


def _builtin_text(role: Role) -> str:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    cut = int(len(keys) * _BUILTIN_CALIB_SHARE)
    held_out = "\n\n".join(topics[k] for k in keys[cut:])
    if role == "evaluation":
        return held_out
    # Topics overlap (e.g. "compound" repeats "try", "while" and "with"): drop every
    # calibration paragraph that shares a non-trivial line with the held-out text.
    seen = {s for ln in held_out.splitlines() if len(s := ln.strip()) >= 20}
    paragraphs = (p for k in keys[:cut] for p in topics[k].split("\n\n"))
    return "\n\n".join(p for p in paragraphs if not any(ln.strip() in seen for ln in p.splitlines()))


def _hf_text(name: str, role: Role) -> str:
    from optc.network import require_hub

    require_hub(f"dataset {name!r}", "use 'builtin' or a local .txt/.jsonl file instead")
    try:
        from datasets import load_dataset

        if name == "wikitext2":
            split = "train" if role == "calibration" else "test"
            ds = load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
            return "\n\n".join(ds["text"])
        # c4 is huge: one shard of each split, as the GPTQ paper's calibration does.
        split, shard = (
            ("train", "en/c4-train.00000-of-01024.json.gz")
            if role == "calibration"
            else ("validation", "en/c4-validation.00000-of-00008.json.gz")
        )
        ds = load_dataset("allenai/c4", data_files={split: shard}, split=split)
        return "\n\n".join(ds["text"][:20000])
    except (OSError, ConnectionError, ValueError) as exc:
        raise OptcError(
            f"dataset {name!r} could not be loaded (it needs network access or a local "
            f"Hugging Face cache): {exc}. Use 'builtin' or a local .txt/.jsonl file instead."
        ) from exc


def _decoded(path: Path) -> str:
    """The file as UTF-8 text; anything else is one line naming the file and the first bad byte."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise OptcError(f"dataset file {path} cannot be read ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OptcError(
            f"dataset file {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
            "pass a UTF-8 .txt or .jsonl file"
        ) from None
    # Universal newlines, as reading the file in text mode gave (the token ids depend on them).
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _file_text(path: Path) -> str:
    if not path.is_file():
        raise OptcError(f"dataset file not found: {path}")
    if path.suffix == ".jsonl":
        texts = []
        for lineno, line in enumerate(io.StringIO(_decoded(path)), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise OptcError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise OptcError(f"{path}:{lineno}: expected an object with a 'text' string")
            texts.append(record["text"])
        return "\n\n".join(texts)
    return _decoded(path)


def load_text(dataset: str, role: Role) -> str:
    """The raw text of ``dataset`` for ``role``."""
    if dataset == "builtin":
        text = _builtin_text(role)
    elif dataset in NAMED:
        text = _hf_text(dataset, role)
    else:
        text = _file_text(Path(dataset).expanduser())
    if not text.strip():
        raise OptcError(f"dataset {dataset!r} is empty")
    return text


def dataset_path(dataset: str) -> Path | None:
    """The local file a dataset name points to (None for the named sources)."""
    return None if dataset in NAMED else Path(dataset).expanduser()


def check_dataset(dataset: str, role: Role, network: bool = True) -> None:
    """Read a local dataset file now (missing, not UTF-8 text, malformed JSONL or empty: one line),
    and with ``network``, refuse a named hub dataset that cannot be reached, before any model loads."""
    if dataset == "builtin":
        return
    if dataset in NAMED:
        if network:
            from optc.network import require_hub

            require_hub(f"dataset {dataset!r}", "use 'builtin' or a local .txt/.jsonl file instead")
        return
    load_text(dataset, role)


def check_disjoint(calibration: str, evaluation: str) -> None:
    """Refuse calibrating on the evaluation text (named sources already split by role)."""
    if calibration in NAMED or evaluation in NAMED:
        return
    a, b = Path(calibration).expanduser(), Path(evaluation).expanduser()
    if a.exists() and b.exists() and a.resolve() == b.resolve():
        raise OptcError(
            f"calibration and evaluation use the same file ({a}): calibrating on evaluation "
            "text makes the reported accuracy meaningless"
        )


def _tokenizer_key(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()
    return f"{type(tokenizer).__name__}-{len(vocab)}-{digest[:16]}"


def tokenize(text: str, tokenizer) -> torch.Tensor:
    """Token ids of the whole text as one 1-D tensor (no special tokens)."""
    import torch  # here, not at the top: the recipe schema (CalibrationConfig) stays torch-free

    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def first_tokens(text: str, tokenizer, count: int, margin: int = 256) -> torch.Tensor:
    """At least the first ``count`` tokens of ``text`` tokenized whole, tokenizing a prefix.

    Tokenizers split text into words before merging, so cutting the text at a line end
    changes only the tokens next to the cut; ``margin`` tokens before it are dropped. The
    protocol's 128 x 512 calibration tokens are a quarter of WikiText-2 validation, and
    tokenizing all of it keeps ~130 MB of tokenizer memory alive for the whole run.
    """
    size = max(4096, 8 * (count + margin))
    while size < len(text):
        cut = text.rfind("\n", 0, size)
        if cut > 0:
            ids = tokenize(text[: cut + 1], tokenizer)
            if ids.numel() >= count + margin:
                return ids[: ids.numel() - margin]
        size *= 2
    return tokenize(text, tokenizer)


def calibration_samples(
    tokenizer,
    dataset: str,
    samples: int,
    seqlen: int,
    seed: int = 0,
    sampling: Literal["first", "random"] = "first",
) -> torch.Tensor:
    """``[samples, seqlen]`` token ids: non-overlapping chunks of the tokenized text.

    ``first`` takes the first chunks in order (the fixed benchmark protocol); ``random``
    draws distinct chunks with a seeded generator. Both are deterministic.
    """
    if samples <= 0 or seqlen <= 0:
        raise OptcError(f"samples and seqlen must be positive (got {samples} and {seqlen})")
    chunks = calibration_chunks(
        tokenizer, dataset, seqlen, samples, first_only=samples if sampling == "first" else None
    )
    available = chunks.shape[0]
    if sampling == "first":
        return chunks[:samples].clone()
    import torch

    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(available, generator=g)[:samples]
    return chunks[order.sort().values].clone()


def calibration_chunks(
    tokenizer, dataset: str, seqlen: int, at_least: int | None = None, first_only: int | None = None
) -> torch.Tensor:
    """Every non-overlapping ``seqlen``-token chunk of the calibration text ([n, seqlen]),
    refusing a text with fewer than ``at_least`` chunks (1 when None). ``first_only``: only
    (at least) that many leading chunks are needed, so only a prefix is tokenized."""
    text = load_text(dataset, "calibration")
    if first_only is not None:
        ids = first_tokens(text, tokenizer, first_only * seqlen)
    else:
        ids = tokenize(text, tokenizer)
    available = ids.numel() // seqlen
    if available < (at_least or 1):
        raise OptcError(
            f"calibration dataset {dataset!r} has {ids.numel()} tokens: {available} chunks of "
            f"{seqlen}, fewer than the {at_least or 1} samples requested; lower --samples or --seqlen"
        )
    return ids[: available * seqlen].view(available, seqlen)


def evaluation_tokens(tokenizer, dataset: str) -> torch.Tensor:
    """The evaluation text tokenized whole (1-D)."""
    return tokenize(load_text(dataset, "evaluation"), tokenizer)


class CalibrationConfig(BaseModel):
    """Which text calibrates data-driven stages, and how much of it."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field("builtin", description="builtin, wikitext2, c4, or a .txt/.jsonl path")
    samples: int = Field(128, gt=0)
    seqlen: int = Field(512, gt=0)
    seed: int = 0
    sampling: Literal["first", "random"] = "first"
    batch_size: int | None = Field(None, gt=0, description="samples per forward; auto if null")
    autocast: Literal["off", "bfloat16"] = Field(
        "off", description="run calibration forwards in bfloat16 autocast (faster on AMX CPUs/GPUs)"
    )
    streaming: bool | Literal["auto"] = Field(
        "auto", description="read one decoder layer at a time from the safetensors shards and write "
        "it compressed (models larger than memory); auto: when the weights would fill over half "
        "of the available memory and the recipe can stream",
    )

    def autocast_dtype(self) -> torch.dtype | None:
        import torch

        return torch.bfloat16 if self.autocast == "bfloat16" else None

    def resolved_batch_size(self, device: str = "cpu") -> int:
        # On a CPU, ~512 tokens per forward keeps a layer's intermediates (512 x 1536 floats
        # is 3 MB) in cache: a SmolLM2 layer over 128 x 512 tokens runs in 2.4 s in batches
        # of 1 against 3.6 s in batches of 16, and uses less memory. Accelerators want
        # about 8k tokens per forward to fill the device.
        import torch

        tokens = 512 if torch.device(device).type == "cpu" else 8192
        return self.batch_size or max(1, min(self.samples, tokens // self.seqlen))

    def token_ids(self, tokenizer) -> torch.Tensor:
        return calibration_samples(
            tokenizer, self.dataset, self.samples, self.seqlen, self.seed, self.sampling
        )
