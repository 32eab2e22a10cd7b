"""Text from ``datasets`` sources and chat data, for :mod:`optc.data`.

A source is a local file (``.parquet``, ``.arrow``, ``.csv``/``.tsv``, ``.json``/``.jsonl``), a
folder of such files, a directory written by ``Dataset.save_to_disk`` (read with
``load_from_disk``), or a Hugging Face hub id (where a network or a local cache exists). One
column is read: ``text`` unless named; a column of conversations (lists of ``{"role",
"content"}`` messages) is rendered with the model's own chat template.

Rows are read in their stored order and nothing here is random, so a source gives the same text,
hence the same token ids, every time; the seeded sampling happens on the token chunks.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from optc.errors import OptcError

log = logging.getLogger(__name__)

Role = Literal["calibration", "evaluation"]
Rendering = Literal["auto", "plain", "chat"]

# File suffix -> the datasets builder that reads it.
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json"}
# What save_to_disk writes beside the data: the same for two datasets of the same schema, so
# never compared when checking that calibration and evaluation read different data.
_METADATA = {"dataset_info.json", "state.json", "dataset_dict.json"}
# The split a role reads when none is named: the first of these that the source has.
_ROLE_SPLITS = {"calibration": ("train",), "evaluation": ("test", "validation")}


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset(Dict).save_to_disk``."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).suffix


def _pick_split(splits: Iterable[str], split: str | None, role: Role, where: str) -> str:
    names = list(splits)
    if split is not None:
        if split not in names:
            raise OptcError(f"{where} has no split {split!r} (it has {', '.join(names)})")
        return split
    for name in _ROLE_SPLITS[role]:
        if name in names:
            return name
    if len(names) == 1:
        return names[0]
    raise OptcError(f"{where} has the splits {', '.join(names)}: name one with --split (recipe: split)")


def _data_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in BUILDERS)
    kinds = {BUILDERS[p.suffix] for p in files}
    if not files:
        raise OptcError(f"{folder} holds no data files ({', '.join(sorted(BUILDERS))})")
    if len(kinds) > 1:
        raise OptcError(f"{folder} mixes data file kinds ({', '.join(sorted(kinds))}); keep one kind per folder")
    return files


def load_rows(dataset: str, role: Role, split: str | None = None, config: str | None = None):
    """The ``datasets.Dataset`` a source names, in its stored row order."""
    try:
        import datasets
    except ImportError as exc:  # a dependency; only a broken install lacks it
        raise OptcError(f"reading {dataset!r} needs the datasets library: {exc}") from exc
    path = Path(dataset).expanduser()
    try:
        if is_saved_dataset(path):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[_pick_split(ds.keys(), split, role, str(path))]
            return ds
        if path.is_file() or path.is_dir():
            files = [path] if path.is_file() else _data_files(path)
            builder = BUILDERS.get(files[0].suffix)
            if builder is None:
                raise OptcError(f"{path}: unknown data file type (expected {', '.join(sorted(BUILDERS))})")
            kwargs: dict[str, Any] = {"delimiter": "\t"} if files[0].suffix == ".tsv" else {}
            # One file set is the train split of load_dataset; --split does not apply to it.
            return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **kwargs)
        if not looks_like_hub_id(dataset):
            raise OptcError(f"dataset not found: {dataset!r} is neither a file, a folder nor a hub id")
        builder = datasets.load_dataset_builder(dataset, config)
        chosen = _pick_split((builder.info.splits or {}).keys() or ["train"], split, role, dataset)
        return datasets.load_dataset(dataset, config, split=chosen)
    except OptcError:
        raise
    except (OSError, ConnectionError, ValueError, KeyError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise OptcError(f"dataset {dataset!r} could not be loaded: {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc


def is_conversation(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def render_chat(conversations: list[list[dict]], tokenizer: Any, where: str) -> list[str]:
    """Each conversation as the model's chat template writes it (special tokens as text, which
    the tokenizer reads back as the same special tokens)."""
    if tokenizer is None:
        raise OptcError(f"{where}: chat data is rendered with the model's chat template; no tokenizer was given")
    if not getattr(tokenizer, "chat_template", None):
        raise OptcError(f"{where} holds conversations, but the model's tokenizer has no chat template: "
                        "use rendering: plain (the messages' text joined) or a model that has one")
    return [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]


def plain_conversation(messages: list[dict]) -> str:
    return "\n\n".join(str(m["content"]) for m in messages)


def column_texts(values: list[Any], rendering: Rendering, tokenizer: Any, where: str) -> tuple[list[str], bool]:
    """The texts of one column, and whether they are rendered conversations: strings as they
    are, conversations rendered by ``rendering`` (``auto``: with the chat template)."""
    chat = [is_conversation(v) for v in values]
    if any(chat) and not all(chat):
        raise OptcError(f"{where}: some rows are conversations and some are not")
    if all(chat) and values:
        if rendering == "plain":
            return [plain_conversation(v) for v in values], False
        return render_chat(values, tokenizer, where), True
    if rendering == "chat":
        raise OptcError(f"{where}: rendering: chat needs a column of conversations (lists of role/content messages)")
    bad = next((i for i, v in enumerate(values) if not isinstance(v, str)), None)
    if bad is not None:
        raise OptcError(f"{where}: row {bad} is {type(values[bad]).__name__}, not text or a conversation")
    return values, False


def source_texts(dataset: str, role: Role, *, split: str | None, config: str | None, column: str | None,
                 rendering: Rendering, tokenizer: Any) -> tuple[list[str], bool]:
    ds = load_rows(dataset, role, split, config)
    names = list(ds.column_names)
    if column is None:
        column = next((c for c in ("text", "messages") if c in names), None)
        if column is None:
            raise OptcError(f"{dataset}: no 'text' or 'messages' column (it has {', '.join(names)}): name one with --text-column")
    elif column not in names:
        raise OptcError(f"{dataset}: no column {column!r} (it has {', '.join(names)})")
    return column_texts(list(ds[column]), rendering, tokenizer, f"{dataset} column {column!r}")


def local_data_files(dataset: str) -> list[Path]:
    """The data files a local source reads (empty for named and hub sources)."""
    path = Path(dataset).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.name not in _METADATA)
    return []


def shared_data(calibration: str, evaluation: str) -> tuple[Path, Path] | None:
    """A (calibration file, evaluation file) pair with the same content, or None.

    Content, not names: a copy or a hard link of a file is the same text. Only files of equal
    size are hashed, so two large datasets that differ cost no reading."""
    held_out = local_data_files(evaluation)
    sizes = {f.stat().st_size for f in held_out}
    candidates = [f for f in local_data_files(calibration) if f.stat().st_size in sizes]
    if not candidates:
        return None
    common = {f.stat().st_size for f in candidates}
    digests = _fingerprints([f for f in held_out if f.stat().st_size in common])
    for digest, f in _fingerprints(candidates).items():
        if digest in digests:
            return f, digests[digest]
    return None


def _fingerprints(files: list[Path]) -> dict[str, Path]:
    """sha256 of each file -> the file."""
    out = {}
    for f in files:
        digest = hashlib.sha256()
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        out[digest.hexdigest()] = f
    return out


def utf8_text(path: Path) -> str:
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
            "pass UTF-8 text"
        ) from None
    # Universal newlines, as reading the file in text mode gives (the token ids depend on them).
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_jsonl(path: Path, column: str | None) -> list[Any]:
    """One field of each line of a ``.jsonl`` file (``text``, else ``messages``), with the line
    number of the first bad line."""
    values: list[Any] = []
    for lineno, line in enumerate(io.StringIO(utf8_text(path)), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise OptcError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        key = column or ("messages" if isinstance(record, dict) and "text" not in record and "messages" in record else "text")
        if not isinstance(record, dict) or key not in record:
            raise OptcError(f"{path}:{lineno}: expected an object with a '{key}' string")
        if not isinstance(record[key], str) and not is_conversation(record[key]):
            raise OptcError(f"{path}:{lineno}: expected an object with a '{key}' string")
        values.append(record[key])
    return values
