"""Calibration text from ``datasets`` sources, chat data and weighted mixes; disjointness by content.

Every source is a small file written here (no network). The same rows stored as parquet, arrow,
CSV, JSONL, a folder or a ``save_to_disk`` directory give the same text, so the same token ids.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from optc.data import CalibrationConfig, DataSource, calibration_samples, check_disjoint, load_text, mix_shares, tokenize
from optc.errors import OptcError

datasets = pytest.importorskip("datasets")

ROWS = [f"Row {i}: the quick brown fox number {i} jumps over {i * 7} lazy dogs near the river." for i in range(60)]
CHATS = [
    [{"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]
    for i in range(40)
]


def _sources(tmp_path: Path) -> dict[str, Path]:
    ds = datasets.Dataset.from_dict({"text": ROWS, "id": list(range(len(ROWS)))})
    out = {"parquet": tmp_path / "d.parquet", "csv": tmp_path / "d.csv", "jsonl": tmp_path / "d.jsonl",
           "saved": tmp_path / "saved", "folder": tmp_path / "folder"}
    ds.to_parquet(str(out["parquet"]))
    ds.to_csv(str(out["csv"]), index=False)
    ds.to_json(str(out["jsonl"]), lines=True)
    ds.save_to_disk(str(out["saved"]))
    out["arrow"] = next(out["saved"].glob("*.arrow"))
    out["folder"].mkdir()
    ds.select(range(30)).to_parquet(str(out["folder"] / "part-0.parquet"))
    ds.select(range(30, 60)).to_parquet(str(out["folder"] / "part-1.parquet"))
    return out


def test_every_local_kind_gives_the_same_text_and_ids(tmp_path: Path, default_tokenizer) -> None:
    reference = "\n\n".join(ROWS)
    want = tokenize(reference, default_tokenizer)
    for kind, path in _sources(tmp_path).items():
        assert load_text(str(path), "calibration") == reference, kind
        a = calibration_samples(default_tokenizer, str(path), 4, 16, seed=3, sampling="random")
        b = calibration_samples(default_tokenizer, str(path), 4, 16, seed=3, sampling="random")
        assert torch.equal(a, b), kind  # same seed, same token ids
        chunks = want[: want.numel() // 16 * 16].view(-1, 16)
        assert all(any(torch.equal(row, c) for c in chunks) for row in a), kind
        assert torch.equal(calibration_samples(default_tokenizer, str(path), 4, 16), chunks[:4]), kind


def test_text_column_and_split(tmp_path: Path, default_tokenizer) -> None:
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"body": ROWS[:30]}),
        "test": datasets.Dataset.from_dict({"body": ROWS[30:]}),
        "extra": datasets.Dataset.from_dict({"body": ROWS[:5]}),
    })
    dd.save_to_disk(str(tmp_path / "dd"))
    src = str(tmp_path / "dd")
    assert load_text(DataSource(dataset=src, text_column="body"), "calibration") == "\n\n".join(ROWS[:30])
    assert load_text(DataSource(dataset=src, text_column="body"), "evaluation") == "\n\n".join(ROWS[30:])
    assert load_text(DataSource(dataset=src, text_column="body", split="extra"), "calibration") == "\n\n".join(ROWS[:5])
    with pytest.raises(OptcError, match="no column 'text'|no 'text' or 'messages' column"):
        load_text(src, "calibration")
    with pytest.raises(OptcError, match="no split 'nope'"):
        load_text(DataSource(dataset=src, text_column="body", split="nope"), "calibration")
    with pytest.raises(OptcError, match="no column 'missing'"):
        load_text(DataSource(dataset=src, text_column="missing"), "calibration")


def test_chat_data_rendered_with_the_models_template(tmp_path: Path, default_tokenizer) -> None:
    ds = datasets.Dataset.from_dict({"messages": CHATS})
    ds.to_parquet(str(tmp_path / "chat.parquet"))
    ds.to_json(str(tmp_path / "chat.jsonl"), lines=True)
    want = "".join(default_tokenizer.apply_chat_template(c, tokenize=False) for c in CHATS)
    assert "<|im_start|>assistant" in want  # SmolLM2-Instruct's template
    for name in ("chat.parquet", "chat.jsonl"):
        path = str(tmp_path / name)
        assert load_text(path, "calibration", default_tokenizer) == want
        ids = calibration_samples(default_tokenizer, CalibrationConfig(dataset=path), 3, 16, seed=1, sampling="random")
        again = CalibrationConfig(dataset=path, seed=1, samples=3, seqlen=16, sampling="random").token_ids(default_tokenizer)
        assert torch.equal(ids, again)
        im_start = default_tokenizer.convert_tokens_to_ids("<|im_start|>")
        # system (the template adds it), user and assistant turns, read back as special tokens
        assert (tokenize(want, default_tokenizer) == im_start).sum() == 3 * len(CHATS)
    plain = load_text(DataSource(dataset=str(tmp_path / "chat.parquet"), rendering="plain"), "calibration")
    assert "<|im_start|>" not in plain and "3 plus 3 is 6." in plain
    text_rows = _sources(tmp_path)["parquet"]
    with pytest.raises(OptcError, match="needs a column of conversations"):
        load_text(DataSource(dataset=str(text_rows), rendering="chat"), "calibration", default_tokenizer)


def test_chat_without_a_template_is_a_clear_error(tmp_path: Path, default_tokenizer) -> None:
    import copy

    ds = datasets.Dataset.from_dict({"messages": CHATS})
    ds.to_parquet(str(tmp_path / "chat.parquet"))
    bare = copy.deepcopy(default_tokenizer)
    bare.chat_template = None
    with pytest.raises(OptcError, match="has no chat template"):
        load_text(str(tmp_path / "chat.parquet"), "calibration", bare)
    with pytest.raises(OptcError, match="has no chat template"):
        load_text(DataSource(dataset="builtin", rendering="chat"), "calibration", bare)


def test_builtin_chat_part(default_tokenizer) -> None:
    src = CalibrationConfig(dataset="builtin", rendering="chat", samples=8, seqlen=64, sampling="random", seed=5)
    text = load_text(src, "calibration", default_tokenizer)
    assert text.count("<|im_start|>assistant") > 20
    held_out = load_text("builtin", "evaluation")
    lines = {ln.strip() for ln in held_out.splitlines() if len(ln.strip()) >= 20}
    assert not any(ln.strip() in lines for ln in text.splitlines())  # no evaluation text in it
    assert torch.equal(src.token_ids(default_tokenizer), src.token_ids(default_tokenizer))
    # plain (the default) is the text it always was
    assert load_text(CalibrationConfig(), "calibration", default_tokenizer) == load_text("builtin", "calibration")


def test_weighted_mix(tmp_path: Path, default_tokenizer) -> None:
    assert mix_shares([3, 1], 8) == [6, 2]
    assert mix_shares([1, 1, 1], 4) == [2, 1, 1]
    assert mix_shares([100, 1], 4) == [3, 1]
    paths = _sources(tmp_path)
    cfg = CalibrationConfig.model_validate({
        "mix": [{"dataset": str(paths["parquet"]), "weight": 3}, {"dataset": "builtin", "weight": 1}],
        "samples": 8, "seqlen": 16, "sampling": "random", "seed": 2,
    })
    ids = cfg.token_ids(default_tokenizer)
    assert ids.shape == (8, 16)
    assert torch.equal(ids, cfg.token_ids(default_tokenizer))
    assert torch.equal(ids[:6], calibration_samples(default_tokenizer, str(paths["parquet"]), 6, 16, 2, "random"))
    assert torch.equal(ids[6:], calibration_samples(default_tokenizer, "builtin", 2, 16, 3, "random"))
    assert cfg.datasets() == [str(paths["parquet"]), "builtin"]
    with pytest.raises(ValidationError, match="either mix or dataset"):
        CalibrationConfig.model_validate({"dataset": "builtin", "mix": [{"dataset": "builtin"}]})
    with pytest.raises(ValidationError):
        CalibrationConfig.model_validate({"mix": [{"dataset": "builtin", "wieght": 2}]})


def test_copies_and_hard_links_of_the_evaluation_text_are_refused(tmp_path: Path) -> None:
    held_out = tmp_path / "eval.txt"
    held_out.write_text("the evaluation text\n" * 50)
    other = tmp_path / "calib.txt"
    other.write_text("different calibration text\n" * 50)
    check_disjoint(str(other), str(held_out))
    copy = tmp_path / "elsewhere" / "renamed.txt"
    copy.parent.mkdir()
    shutil.copyfile(held_out, copy)
    os.link(held_out, tmp_path / "hardlink.txt")
    for name in (copy, tmp_path / "hardlink.txt", copy.parent):  # a folder holding a copy too
        with pytest.raises(OptcError, match="calibration and evaluation use the same"):
            check_disjoint(str(name), str(held_out))
    with pytest.raises(OptcError, match="same"):  # one source of a mix is enough
        check_disjoint([str(other), str(copy)], str(held_out))
    # save_to_disk directories compare their data files, not their (shared-schema) metadata
    datasets.Dataset.from_dict({"text": ROWS[:10]}).save_to_disk(str(tmp_path / "a"))
    datasets.Dataset.from_dict({"text": ROWS[10:20]}).save_to_disk(str(tmp_path / "b"))
    check_disjoint(str(tmp_path / "a"), str(tmp_path / "b"))
    shutil.copytree(tmp_path / "a", tmp_path / "a-copy")
    with pytest.raises(OptcError, match="same data"):
        check_disjoint(str(tmp_path / "a-copy"), str(tmp_path / "a"))


def test_evaluation_reads_datasets_sources(tmp_path: Path, default_tokenizer, tiny_checkpoint: Path) -> None:
    from typer.testing import CliRunner

    from optc.cli.main import app
    from optc.evaluate.perplexity import evaluation_token_cache
    from optc.evaluate.protocol import EvalProtocol

    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"body": ROWS[:30]}),
        "test": datasets.Dataset.from_dict({"body": ROWS[30:]}),
    }).save_to_disk(str(tmp_path / "dd"))
    protocol = EvalProtocol(dataset=str(tmp_path / "dd"), text_column="body")
    ids = evaluation_token_cache(default_tokenizer, protocol.source(), use_cache=False)
    assert torch.equal(ids, tokenize("\n\n".join(ROWS[30:]), default_tokenizer))  # the test split by default
    result = CliRunner().invoke(app, ["eval", str(tiny_checkpoint), "--dataset", str(tmp_path / "dd"), "--split", "train",
                                      "--text-column", "body", "--seqlen", "16", "--windows", "2", "--no-cache", "--json", "-q"])
    assert result.exit_code == 0, result.output
