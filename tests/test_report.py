"""report.json schema, report.md, charts, and ``optc report`` over every command's reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from typer.testing import CliRunner

from optc.cli.main import app
from optc.errors import OptcError
from optc.evaluate.report import REPORT_SCHEMA, load_report, report_json_schema, validate_report

runner = CliRunner()


def _ok(args: list[str]):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.fixture(scope="module")
def runs(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One output of every command that writes a report."""
    root = tmp_path_factory.mktemp("reports")
    m = ["--model", str(tiny_checkpoint), "--windows", "2", "--quiet"]
    out = {name: root / name for name in ("run", "quantize", "prune", "eval")}
    _ok(["run", "w4a16-rtn", *m, "--output", str(out["run"])])
    _ok(["quantize", "--bits", "8", *m, "--output", str(out["quantize"])])
    _ok(["prune", "--sparsity", "0.5", *m, "--output", str(out["prune"])])
    _ok(["eval", str(out["run"]), "--baseline", str(tiny_checkpoint), "--seqlen", "64", "--windows", "3",
         "--latency", "--repeats", "1", "--new-tokens", "2", "--prompt-tokens", "8", "--quiet",
         "--output", str(out["eval"])])
    return out


def test_every_report_validates(runs: dict[str, Path]) -> None:
    for name, path in runs.items():
        report = load_report(path)
        assert report["schema_version"] == REPORT_SCHEMA
        assert report["command"] == ("eval" if name == "eval" else "run")
        assert report["timings"] and all(v >= 0 for v in report["timings"].values())
        assert report["metrics"]["size"]["parameters"] > 0


def test_run_report_has_layers_change_and_timings(runs: dict[str, Path]) -> None:
    report = load_report(runs["run"])
    layers = {r["name"]: r for r in report["layers"]}
    assert len(layers) == 14  # 7 Linears x 2 layers
    row = layers["model.layers.0.self_attn.q_proj"]
    assert row["scheme"] == "int4-sym-g64" and 0 < row["rel_error"] < 1
    change = report["metrics"]["perplexity_change"]
    assert change["windows"] == 2 and change["ppl_increase_pct_ci95"][0] is not None
    assert {"load", "baseline_eval", "eval", "stage 0: rtn"} <= set(report["timings"])
    size = report["metrics"]["size"]
    assert 4 < size["linear_bits_per_weight"] < 5  # int4 codes + a scale per 64 weights
    prune = load_report(runs["prune"])
    assert all(abs(r["sparsity"] - 0.5) < 0.01 for r in prune["layers"])
    assert prune["metrics"]["size"]["sparsity"] == pytest.approx(0.5, abs=0.01)


def test_eval_report_against_baseline(runs: dict[str, Path]) -> None:
    report = load_report(runs["eval"])
    m = report["metrics"]
    assert 0 <= m["divergence"]["kl_mean"] <= m["divergence"]["kl_max"]
    assert 0 < m["divergence"]["top1_agreement"] <= 1
    # Per-layer error of an eval comes from comparing weights with the baseline's.
    assert all(r["rel_error"] is not None and r["scheme"] for r in report["layers"])
    lat = m["latency"]
    assert lat["model"]["kernel"] and lat["baseline"]["kernel"].startswith("float fallback")
    assert lat["decode_speedup"] > 0 and lat["model"]["decode"]["samples"] == 2
    md = (runs["eval"] / "report.md").read_text()
    assert "KL divergence from the baseline" in md and "Latency (model)" in md


def test_charts_are_written_and_linked(runs: dict[str, Path]) -> None:
    pytest.importorskip("matplotlib")
    report = load_report(runs["run"])
    assert set(report["charts"]) == {"perplexity.png", "layer_error.png"}
    md = (runs["run"] / "report.md").read_text()
    for chart in report["charts"]:
        assert (runs["run"] / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({chart})" in md


def test_schema_rejects_bad_reports(runs: dict[str, Path]) -> None:
    good = json.loads((runs["eval"] / "report.json").read_text())
    bad = json.loads(json.dumps(good))
    bad["metrics"]["divergence"]["top1_agreement"] = 1.5
    with pytest.raises(OptcError, match="top1_agreement"):
        validate_report(bad)
    bad = json.loads(json.dumps(good))
    bad["metrics"]["perplexity_compressed"]["surprise"] = 1
    with pytest.raises(OptcError, match="surprise"):
        validate_report(bad)
    with pytest.raises(OptcError, match="newer than this optc"):
        validate_report({**good, "schema_version": REPORT_SCHEMA + 1})
    with pytest.raises(OptcError, match="no schema_version"):
        validate_report({"model": "x"})
    # Extra top-level sections from other tools are allowed.
    validate_report({**good, "something_new": {"a": 1}})


def test_version_1_reports_are_upgraded() -> None:
    v1 = {
        "schema_version": 1, "created": "2025-01-01T00:00:00+00:00", "model": "m", "recipe": None,
        "environment": {"optc": "0.1.0"}, "stages": [], "checkpoint": None,
        "metrics": {"perplexity_model": {"perplexity": 10.0, "nll": 2.3, "ci95": [9.0, 11.0], "windows": 2,
                                         "tokens": 10, "seqlen": 6, "stride": 6, "seconds": 0.1, "window_nll": [2.2, 2.4]},
                    "parameters": 5, "nonzero": 5},
    }
    assert validate_report(v1)["command"] == "eval"


def test_json_schema_export() -> None:
    schema = report_json_schema()
    assert "schema version 2" in schema["title"] and "metrics" in schema["properties"]
    out = _ok(["report", "--schema"]).stdout
    assert json.loads(out)["title"] == schema["title"]


def test_optc_report_compares_every_command(runs: dict[str, Path], tmp_path: Path) -> None:
    md_path = tmp_path / "cmp.md"
    args = ["report", *(str(p) for p in runs.values()), "--markdown", str(md_path)]
    text = _ok(args).output
    assert "optc runs" in text and "perplexity" in text and "KL mean" in text
    md = md_path.read_text().splitlines()
    assert md[0] == "| metric | run (w4a16-rtn) | quantize (w4a16-rtn) | prune (prune-2of4-magnitude) | eval |"
    assert md[1] == "|---|---|---|---|---|"
    rows = {line.split("|")[1].strip(): line for line in md[2:]}
    assert {"perplexity", "perplexity change", "bits / weight", "KL mean (nats)", "decode speedup"} <= set(rows)
    assert rows["stages"].count("rtn") == 2 and "magnitude" in rows["stages"]
    data = json.loads(_ok(["report", str(runs["eval"]), "--json"]).stdout)
    assert data["runs"] == ["eval"] and "top-1 agreement" in data["rows"]


def test_optc_report_bad_input(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text("{not json")
    for args, msg in ((["report", str(tmp_path / "missing")], "no report at"),
                      (["report", str(tmp_path / "x.json")], "not valid JSON"),
                      (["report"], "at least one report")):
        result = runner.invoke(app, args)
        assert result.exit_code == 1 and msg in result.output and "Traceback" not in result.output


def test_baseline_with_another_tokenizer_is_refused(runs: dict[str, Path], tiny_checkpoint: Path, tmp_path: Path) -> None:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["some other text for a different vocabulary"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    other = tmp_path / "other"
    other.mkdir()
    for f in tiny_checkpoint.iterdir():
        if f.suffix in (".json", ".safetensors") and not f.name.startswith("tokenizer"):
            (other / f.name).write_bytes(f.read_bytes())
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(other)
    result = runner.invoke(app, ["eval", str(runs["run"]), "--baseline", str(other), "--seqlen", "64", "--windows", "2"])
    assert result.exit_code == 1 and "different tokenizer" in result.output and "Traceback" not in result.output


def test_eval_bad_protocol_inputs(tiny_checkpoint: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("too short")
    cases = (
        (["--dataset", str(short), "--seqlen", "64"], "shorter than one window"),
        (["--seqlen", "4096"], "above the model's context length 1024"),
        (["--kernel", "int3"], "unknown kernel"),
        (["--tasks", "hellaswag"], "lm-eval"),
    )
    for extra, msg in cases:
        result = runner.invoke(app, ["eval", str(tiny_checkpoint), "--windows", "1", *extra])
        assert result.exit_code == 1 and msg in result.output, (extra, result.output)
