from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from optc.data import (
    calibration_samples,
    check_disjoint,
    evaluation_tokens,
    first_tokens,
    load_text,
    tokenize,
)
from optc.errors import OptcError


def test_builtin_texts_disjoint_and_non_empty() -> None:
    calib, held_out = load_text("builtin", "calibration"), load_text("builtin", "evaluation")
    assert len(calib) > 100_000 and len(held_out) > 100_000
    calib_lines = {ln.strip() for ln in calib.splitlines()}
    shared = [ln.strip() for ln in held_out.splitlines() if len(ln.strip()) >= 20 and ln.strip() in calib_lines]
    assert shared == []
    paragraphs = [p for p in held_out.split("\n\n") if len(p.strip()) >= 80]
    assert paragraphs and not any(p in calib for p in paragraphs)


def _write_words(path: Path, n: int) -> Path:
    path.write_text(" ".join(f"word{i % 97} alpha{i % 13}." for i in range(n)))
    return path


def test_calibration_samples_first_and_random(tmp_path: Path, default_tokenizer) -> None:
    path = str(_write_words(tmp_path / "calib.txt", 2000))
    ids = tokenize(load_text(path, "calibration"), default_tokenizer)
    chunks = ids[: ids.numel() // 16 * 16].view(-1, 16)

    first = calibration_samples(default_tokenizer, path, 5, 16)
    assert first.shape == (5, 16) and first.dtype == torch.long
    assert torch.equal(first, chunks[:5])

    a = calibration_samples(default_tokenizer, path, 5, 16, seed=1, sampling="random")
    b = calibration_samples(default_tokenizer, path, 5, 16, seed=1, sampling="random")
    c = calibration_samples(default_tokenizer, path, 5, 16, seed=2, sampling="random")
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, first)
    # Random samples are distinct, in text order, and each one is a whole chunk of the text.
    rows = [next(i for i in range(len(chunks)) if torch.equal(chunks[i], r)) for r in a]
    assert rows == sorted(set(rows))


def test_calibration_samples_builtin(default_tokenizer) -> None:
    x = calibration_samples(default_tokenizer, "builtin", 4, 64)
    assert x.shape == (4, 64)
    assert torch.equal(x, calibration_samples(default_tokenizer, "builtin", 4, 64))


def test_calibration_samples_too_short_or_empty(tmp_path: Path, default_tokenizer) -> None:
    short = str(_write_words(tmp_path / "short.txt", 20))
    with pytest.raises(OptcError, match="fewer than the 50 samples"):
        calibration_samples(default_tokenizer, short, 50, 16)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n ")
    with pytest.raises(OptcError, match="is empty"):
        calibration_samples(default_tokenizer, str(empty), 1, 8)
    with pytest.raises(OptcError, match="must be positive"):
        calibration_samples(default_tokenizer, short, 0, 16)
    with pytest.raises(OptcError, match="not found"):
        load_text(str(tmp_path / "missing.txt"), "calibration")


def test_txt_and_jsonl(tmp_path: Path, default_tokenizer) -> None:
    txt = tmp_path / "a.txt"
    txt.write_text("plain text file\nsecond line\n")
    assert load_text(str(txt), "evaluation") == "plain text file\nsecond line\n"

    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(json.dumps({"text": "first record"}) + "\n\n" + json.dumps({"text": "second", "id": 2}) + "\n")
    assert load_text(str(jsonl), "calibration") == "first record\n\nsecond"
    assert evaluation_tokens(default_tokenizer, str(jsonl)).numel() > 0

    jsonl.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(OptcError, match=r"b\.jsonl:2: not valid JSON"):
        load_text(str(jsonl), "calibration")
    jsonl.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(OptcError, match=r"b\.jsonl:1: expected an object with a 'text' string"):
        load_text(str(jsonl), "calibration")


def test_check_disjoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("x")
    b.write_text("y")
    check_disjoint(str(a), str(b))
    check_disjoint("builtin", "builtin")  # named sources split by role
    with pytest.raises(OptcError, match="same file"):
        check_disjoint(str(a), str(a))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link.txt").symlink_to(a)
    with pytest.raises(OptcError, match="same file"):  # other spellings of the same file
        check_disjoint("./a.txt", "link.txt")


def test_first_tokens_match_tokenizing_the_whole_text(default_tokenizer) -> None:
    text = load_text("builtin", "calibration")
    whole = tokenize(text, default_tokenizer)
    for count in (1000, 5000, 20000):
        part = first_tokens(text, default_tokenizer, count)
        assert part.numel() >= count
        assert torch.equal(part, whole[: part.numel()])
    # Asking for more than there is gives the whole text.
    assert torch.equal(first_tokens(text, default_tokenizer, whole.numel() * 2), whole)
