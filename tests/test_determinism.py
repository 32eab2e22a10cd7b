"""Same inputs and seed: byte-identical checkpoints and identical report metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optc.cli.main import app
from optc.evaluate.report import render_markdown

# Fields that record when, where and how fast, not what was computed.
VOLATILE = {"created", "environment", "timings", "seconds"}


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


@pytest.mark.parametrize("method,fmt", [("gptq", "compressed-tensors"),
                                        pytest.param("awq", "gptq", marks=pytest.mark.slow)])
def test_two_runs_write_identical_checkpoints(tiny_checkpoint: Path, tmp_path: Path, method: str, fmt: str) -> None:
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        args = ["quantize", "--model", str(tiny_checkpoint), "--method", method, "--bits", "4", "--group-size", "32",
                "--samples", "8", "--seqlen", "64", "--seed", "7", "--windows", "2", "--format", fmt,
                "--output", str(out), "--quiet"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, (result.output, result.exception)
        runs.append(out)
    a, b = runs
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert any(f.suffix == ".safetensors" for f in files)
    for f in files:
        # The reports name their own output directory, which differs by construction.
        ta, tb = ((d / f).read_bytes().decode(errors="replace").replace(str(d), "<out>") for d in runs)
        if f.name == "report.json":
            ra, rb = json.loads(ta), json.loads(tb)
            assert _strip(ra) == _strip(rb)
            assert ra["metrics"]["perplexity_compressed"]["perplexity"] > 0  # metrics were compared
        elif f.name == "report.md":
            # report.md renders report.json (compared above, timings aside) and nothing else.
            for d, text in zip(runs, (ta, tb)):
                assert text == render_markdown(json.loads((d / "report.json").read_text())).replace(str(d), "<out>") + "\n"
        else:
            assert (a / f).read_bytes() == (b / f).read_bytes(), f"{f} differs between the two runs"
