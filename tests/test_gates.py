"""CI gates: parsing, thresholds at the boundary, and exit codes from the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from optc.cli.main import app
from optc.errors import OptcError
from optc.evaluate.gates import GATE_EXIT_CODE, check_gates, parse_gate, require_measurable

runner = CliRunner()


def _report(**metrics) -> dict:
    return {"metrics": metrics}


def test_parse_gate_forms() -> None:
    g = parse_gate("ppl_increase<=5%")
    assert (g.metric, g.op, g.threshold) == ("ppl_increase", "<=", 5.0)
    assert parse_gate(" kl_mean < 0.05 ").threshold == 0.05
    assert parse_gate("top1_agreement>=90%").threshold == pytest.approx(0.9)  # % of a fraction
    assert parse_gate("top1_agreement>=0.9").threshold == 0.9
    assert parse_gate("decode_speedup>1.2").op == ">"
    assert parse_gate("kl_max<=1e-1").threshold == pytest.approx(0.1)


@pytest.mark.parametrize("text,match", [
    ("ppl_increase=5%", "cannot parse"),
    ("ppl_increase<=", "cannot parse"),
    ("<=5", "cannot parse"),
    ("ppl_increase<=five", "cannot parse"),
    ("perplexity_up<=5%", "unknown metric 'perplexity_up'"),
    ("kl_mean<=5%", "not a percentage"),
])
def test_bad_gate_expressions(text: str, match: str) -> None:
    with pytest.raises(OptcError, match=match):
        parse_gate(text)


@pytest.mark.parametrize("value,passed", [(4.99, True), (5.0, True), (5.01, False)])
def test_threshold_boundary_le(value: float, passed: bool) -> None:
    report = _report(perplexity_change={"ppl_increase_pct": value, "ppl_increase_pct_ci95": [None, None]})
    (r,) = check_gates([parse_gate("ppl_increase<=5%")], report)
    assert r.passed is passed and r.value == value
    if not passed:
        assert "FAILED" in r.message and "0.01 percentage points" in r.message


@pytest.mark.parametrize("op,value,passed", [("<", 0.05, False), ("<", 0.0499, True), (">=", 0.05, True), (">", 0.05, False)])
def test_strict_and_reverse_operators(op: str, value: float, passed: bool) -> None:
    report = _report(divergence={"kl_mean": value})
    assert check_gates([parse_gate(f"kl_mean{op}0.05")], report)[0].passed is passed


def test_failed_gate_says_by_how_much() -> None:
    report = _report(divergence={"top1_agreement": 0.85})
    (r,) = check_gates([parse_gate("top1_agreement>=90%")], report)
    assert not r.passed and "0.0500" in r.message and "5.6% of the limit" in r.message


def test_unmeasured_metric_fails_the_gate() -> None:
    (r,) = check_gates([parse_gate("decode_speedup>=1.2")], _report())
    assert not r.passed and r.value is None and "not measured" in r.message


def test_gates_needing_a_baseline_are_refused_up_front() -> None:
    with pytest.raises(OptcError, match="needs a baseline"):
        require_measurable([parse_gate("ppl_increase<=5%")], {"eval", "size"})
    with pytest.raises(OptcError, match="--latency"):
        require_measurable([parse_gate("decode_speedup>=1.2")], {"eval"})
    require_measurable([parse_gate("ppl<=100")], {"eval"})


# --- through the CLI -------------------------------------------------------------------


@pytest.fixture(scope="module")
def compressed(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gates") / "rtn"
    result = runner.invoke(app, ["run", "w4a16-rtn", "--model", str(tiny_checkpoint), "--output", str(out), "--no-eval", "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def _eval(compressed: Path, tiny_checkpoint: Path, out: Path, *gates: str):
    args = ["eval", str(compressed), "--baseline", str(tiny_checkpoint), "--seqlen", "64", "--windows", "3", "--output", str(out), "--json"]
    for g in gates:
        args += ["--gate", g]
    return runner.invoke(app, args)


def test_gates_pass_and_fail_with_exit_codes(compressed: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:
    ok = _eval(compressed, tiny_checkpoint, tmp_path / "ok", "kl_mean<=10", "top1_agreement>=0.5")
    assert ok.exit_code == 0, ok.output
    report = json.loads((tmp_path / "ok" / "report.json").read_text())
    increase = report["metrics"]["perplexity_change"]["ppl_increase_pct"]
    assert [g["passed"] for g in report["gates"]] == [True, True]

    # A threshold just below the measured change fails; the report is still written.
    tight = f"ppl_increase<={increase - 0.001:.6f}%"
    bad = _eval(compressed, tiny_checkpoint, tmp_path / "bad", "kl_mean<=10", tight)
    assert bad.exit_code == GATE_EXIT_CODE == 3, bad.output
    written = json.loads((tmp_path / "bad" / "report.json").read_text())
    assert [g["passed"] for g in written["gates"]] == [True, False]
    assert f"gate {tight}: FAILED" in bad.output
    assert "FAIL" in (tmp_path / "bad" / "report.md").read_text()
    loose = f"ppl_increase<={increase + 0.001:.6f}%"
    assert _eval(compressed, tiny_checkpoint, tmp_path / "loose", loose).exit_code == 0


def test_unparsable_gate_is_a_one_line_error(compressed: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:
    result = _eval(compressed, tiny_checkpoint, tmp_path / "x", "ppl_increase=>5%")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert [ln for ln in result.output.splitlines() if ln.startswith("error:")] == [
        ln for ln in result.output.splitlines() if "cannot parse gate 'ppl_increase=>5%'" in ln
    ]
    assert not (tmp_path / "x").exists()


def test_kl_gate_without_baseline_refused(compressed: Path) -> None:
    result = runner.invoke(app, ["eval", str(compressed), "--seqlen", "64", "--windows", "2", "--gate", "kl_mean<=0.1"])
    assert result.exit_code == 1 and "needs a baseline model" in result.output


def test_recipe_gates_fail_a_run(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recipe = {
        "version": 1, "name": "gated", "stages": [{"type": "rtn", "scheme": {"bits": 2, "group_size": 32}}],
        "evaluation": {"dataset": "builtin", "seqlen": 64, "windows": 3, "baseline": True},
        "gates": ["ppl_increase<=-50%", "bits_per_weight<=64"],
    }
    path = tmp_path / "gated.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(path), "--model", str(tiny_checkpoint), "--output", str(out), "--quiet"])
    assert result.exit_code == GATE_EXIT_CODE, result.output
    report = json.loads((out / "report.json").read_text())
    assert [g["gate"] for g in report["gates"]] == recipe["gates"]
    assert [g["passed"] for g in report["gates"]] == [False, True]
    assert "gate ppl_increase<=-50%: FAILED" in result.output
    # --gate adds to the recipe's gates; a malformed recipe gate is a validation error.
    recipe["gates"] = ["ppl_increase<=5"]
    path.write_text(yaml.safe_dump(recipe))
    result = runner.invoke(app, ["run", str(path), "--model", str(tiny_checkpoint), "--no-eval", "--no-save"])
    assert result.exit_code == 1 and "needs a baseline" in result.output
    recipe["gates"] = ["ppl_increase<5 %%"]
    path.write_text(yaml.safe_dump(recipe))
    result = runner.invoke(app, ["recipes", "validate", str(path)])
    assert result.exit_code == 1 and "cannot parse gate" in result.output
