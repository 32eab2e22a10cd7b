"""Text sources for calibration and evaluation, and their tokenization.

A dataset is named by a string:

- ``builtin``: an offline corpus that ships with Python itself (the stdlib's pydoc topic
  texts), so a fresh machine with no data and no network can still calibrate and evaluate.
  Its calibration and evaluation parts are disjoint topics.
- ``wikitext2`` / ``c4``: Hugging Face datasets, only where a network (or a local HF cache)
  exists. Calibration uses the train split, evaluation the test (wikitext2) or validation (c4).
- ``builtin`` with ``rendering: chat``: the calibration topics as short conversations (a user
  question, the topic's text as the answer), rendered with the model's chat template.
- a path to a ``.txt`` file (used whole) or a ``.jsonl`` file (the ``text`` field of each line,
  or a ``messages`` conversation);
- any ``datasets`` source (:mod:`optc.data_sources`): parquet / arrow / CSV / JSON files and
  folders, ``save_to_disk`` directories, hub ids with ``config`` and ``split``; one column.

A recipe's calibration may mix several sources with weights (``mix:``): each gives its share
of the samples, drawn from its own chunks with the same seed.

Calibration never reads evaluation text: the named sources split by role, and a local source
whose data files have the same content as the evaluation's (the same file, a copy, a hard link)
is refused by :func:`check_disjoint`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from optc.errors import OptcError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Role = Literal["calibration", "evaluation"]
NAMED = ("builtin", "wikitext2", "c4")
# Share of pydoc topics used for calibration; the rest is held out for evaluation.
_BUILTIN_CALIB_SHARE = 0.75


class DataSource(BaseModel):
    """One text source: which data, which split and column, and how rows become text."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field("builtin", description="builtin, wikitext2, c4, a .txt/.jsonl/.parquet/.arrow/.csv/.json "
                         "file or folder, a save_to_disk directory, or a hub dataset id")
    config: str | None = Field(None, description="hub dataset configuration name")
    split: str | None = Field(None, description="split to read (default: train for calibration, test or validation for evaluation)")
    text_column: str | None = Field(None, description="column to read (default: text, else messages)")
    rendering: Literal["auto", "plain", "chat"] = Field(
        "auto", description="conversations: chat renders them with the model's chat template (auto: when the "
        "column holds conversations; builtin: chat selects its chat-formatted part), plain joins their text",
    )


class WeightedSource(DataSource):
    """A source of a calibration mix, with its share of the samples."""

    weight: float = Field(1.0, gt=0, description="relative share of the calibration samples")


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


def _builtin_chat() -> list[list[dict]]:
    """The calibration topics as conversations: the question names the topic, the answer is its
    text (the held-out evaluation topics never appear), one paragraph group per answer so the
    conversations stay short, as chat data is."""
    text = _builtin_text("calibration")
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) >= 80]
    conversations = []
    for i in range(0, len(paragraphs), 3):
        answer = "\n\n".join(paragraphs[i:i + 3])
        subject = answer.split("\n", 1)[0].strip()[:60]
        conversations.append([
            {"role": "user", "content": f"Explain this part of the Python documentation: {subject}"},
            {"role": "assistant", "content": answer},
        ])
    return conversations


def _joined(texts: list[str], rendering: str) -> str:
    # A rendered chat template ends each conversation itself (end-of-turn token and newline).
    return ("" if rendering == "chat" else "\n\n").join(texts)


def _file_text(path: Path, src: DataSource, tokenizer) -> str:
    from optc.data_sources import column_texts, read_jsonl, utf8_text

    if not path.is_file():
        raise OptcError(f"dataset file not found: {path}")
    if path.suffix == ".jsonl":
        texts, chat = column_texts(read_jsonl(path, src.text_column), src.rendering, tokenizer, str(path))
        return _joined(texts, "chat" if chat else "plain")
    return utf8_text(path)


def source_text(src: DataSource, role: Role, tokenizer=None) -> str:
    """The raw text of one source for ``role`` (conversations rendered with ``tokenizer``'s chat
    template)."""
    from optc import data_sources

    dataset = src.dataset
    path = Path(dataset).expanduser()
    if dataset == "builtin" and src.rendering == "chat" and role == "calibration":
        text = _joined(data_sources.render_chat(_builtin_chat(), tokenizer, "builtin chat"), "chat")
    elif dataset == "builtin":
        text = _builtin_text(role)
    elif dataset in NAMED:
        text = _hf_text(dataset, role)
    elif (path.suffix == ".jsonl" or (path.is_file() and path.suffix not in data_sources.BUILDERS)
          or (not path.exists() and not data_sources.looks_like_hub_id(dataset))):
        # .txt (and any other file datasets has no builder for) is read whole, as before.
        text = _file_text(path, src, tokenizer)
    else:
        texts, chat = data_sources.source_texts(dataset, role, split=src.split, config=src.config,
                                                column=src.text_column, rendering=src.rendering, tokenizer=tokenizer)
        text = _joined(texts, "chat" if chat else "plain")
    if not text.strip():
        raise OptcError(f"dataset {dataset!r} is empty")
    return text


def load_text(dataset: str | DataSource, role: Role, tokenizer=None) -> str:
    """The raw text of ``dataset`` (a name, a path or a :class:`DataSource`) for ``role``."""
    src = dataset if isinstance(dataset, DataSource) else DataSource(dataset=dataset)
    return source_text(src, role, tokenizer)


def dataset_path(dataset: str) -> Path | None:
    """The local file or folder a dataset name points to (None for the named sources)."""
    return None if dataset in NAMED else Path(dataset).expanduser()


def check_dataset(dataset: str, role: Role, network: bool = True) -> None:
    """Before any model loads: a local .txt/.jsonl file must be readable UTF-8 text (one line
    naming the file and the first bad byte otherwise), and with ``network`` a named hub dataset
    must be reachable. Other sources are checked by their loader."""
    from optc.data_sources import utf8_text

    if dataset == "builtin":
        return
    if dataset in NAMED:
        if network:
            from optc.network import require_hub

            require_hub(f"dataset {dataset!r}", "use 'builtin' or a local .txt/.jsonl/parquet/CSV file or folder instead")
        return
    path = Path(dataset).expanduser()
    if path.is_file() and path.suffix in (".txt", ".jsonl"):
        utf8_text(path)


def check_disjoint(calibration: str | list[str], evaluation: str) -> None:
    """Refuse calibrating on the evaluation text (named sources already split by role). Local
    sources are compared by content: the same file under another name, a copy or a hard link
    of it is the same text."""
    from optc.data_sources import shared_data

    if evaluation in NAMED:
        return
    for name in [calibration] if isinstance(calibration, str) else calibration:
        if name in NAMED:
            continue
        pair = shared_data(name, evaluation)
        if pair is not None:
            f, held_out = pair
            what = f"the same file ({f})" if f.resolve() == held_out.resolve() else f"the same data ({f} has the content of {held_out})"
            raise OptcError(f"calibration and evaluation use {what}: calibrating on evaluation "
                            "text makes the reported accuracy meaningless")


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


def _sample(chunks: torch.Tensor, samples: int, seed: int, sampling: str) -> torch.Tensor:
    if sampling == "first":
        return chunks[:samples].clone()
    import torch

    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(chunks.shape[0], generator=g)[:samples]
    return chunks[order.sort().values].clone()


def calibration_samples(
    tokenizer,
    dataset: str | DataSource,
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
    return _sample(chunks, samples, seed, sampling)


def mix_shares(weights: list[float], samples: int) -> list[int]:
    """Samples per source, proportional to ``weights`` (largest remainders, ties to the first),
    every source at least one."""
    if samples < len(weights):
        raise OptcError(f"a mix of {len(weights)} sources needs at least {len(weights)} samples (got {samples})")
    total = sum(weights)
    exact = [samples * w / total for w in weights]
    shares = [max(1, int(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    i = 0
    while sum(shares) < samples:
        shares[order[i % len(order)]] += 1
        i += 1
    while sum(shares) > samples:  # the minimum of one overshot: take back from the largest
        shares[max(range(len(shares)), key=lambda j: (shares[j], -j))] -= 1
    return shares


def mixed_samples(tokenizer, sources: list[WeightedSource], samples: int, seqlen: int, seed: int = 0,
                  sampling: Literal["first", "random"] = "first") -> torch.Tensor:
    """``[samples, seqlen]``: each source's share of the samples, drawn from its own chunks as
    :func:`calibration_samples` draws them (the seed offset by the source's place in the mix,
    so two sources of the same text do not draw the same chunks), in mix order."""
    import torch

    parts = [calibration_samples(tokenizer, src, n, seqlen, seed + i, sampling)
             for i, (src, n) in enumerate(zip(sources, mix_shares([s.weight for s in sources], samples)))]
    return torch.cat(parts)


def calibration_chunks(
    tokenizer, dataset: str | DataSource, seqlen: int, at_least: int | None = None, first_only: int | None = None
) -> torch.Tensor:
    """Every non-overlapping ``seqlen``-token chunk of the calibration text ([n, seqlen]),
    refusing a text with fewer than ``at_least`` chunks (1 when None). ``first_only``: only
    (at least) that many leading chunks are needed, so only a prefix is tokenized."""
    if isinstance(dataset, CalibrationConfig) and dataset.mix:
        # Every chunk of every source, in mix order (recovery training takes its own count of
        # them); the weights apply to the sampled calibration set (mixed_samples).
        import torch

        return torch.cat([calibration_chunks(tokenizer, src, seqlen) for src in dataset.mix])
    text = load_text(dataset, "calibration", tokenizer)
    name = dataset.dataset if isinstance(dataset, DataSource) else dataset
    if first_only is not None:
        ids = first_tokens(text, tokenizer, first_only * seqlen)
    else:
        ids = tokenize(text, tokenizer)
    available = ids.numel() // seqlen
    if available < (at_least or 1):
        raise OptcError(
            f"calibration dataset {name!r} has {ids.numel()} tokens: {available} chunks of "
            f"{seqlen}, fewer than the {at_least or 1} samples requested; lower --samples or --seqlen"
        )
    return ids[: available * seqlen].view(available, seqlen)


def evaluation_tokens(tokenizer, dataset: str) -> torch.Tensor:
    """The evaluation text tokenized whole (1-D)."""
    return tokenize(load_text(dataset, "evaluation"), tokenizer)


class CalibrationConfig(DataSource):
    """Which text calibrates data-driven stages (one source, or a weighted ``mix``), and how much."""

    mix: list[WeightedSource] = Field(
        default_factory=list, description="several sources with weights (instead of dataset/config/split/...)")
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

    @model_validator(mode="after")
    def _one_way(self) -> CalibrationConfig:
        # Either one source or a mix: a dataset beside a mix would be silently ignored.
        alone = {"dataset", "config", "split", "text_column", "rendering"} & self.model_fields_set
        if self.mix and alone:
            raise ValueError(f"give either mix or {', '.join(sorted(alone))}, not both")
        return self

    def datasets(self) -> list[str]:
        """The dataset names calibration reads (for the disjointness check and reports)."""
        return [s.dataset for s in self.mix] if self.mix else [self.dataset]

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
        if self.mix:
            return mixed_samples(tokenizer, self.mix, self.samples, self.seqlen, self.seed, self.sampling)
        return calibration_samples(tokenizer, self, self.samples, self.seqlen, self.seed, self.sampling)
