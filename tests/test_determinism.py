"""Same inputs and seed: byte-identical checkpoints and identical report metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optc.cli.main import app

# Fields that record when, where and how fast, not what was computed.
VOLATILE = {"created", "environment", "timings", "seconds"}


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _without_timings(markdown: str) -> str:
    # report.md prints the same timings as prose ("12.3 s") and in a timings table.
    return re.sub(r"\d+(\.\d+)? ?s\b", "<t>", markdown)


@pytest.mark.parametrize("method,fmt", [("gptq", "compressed-tensors"), ("awq", "gptq")])
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
        if f.name == "report.json":
            ra, rb = (json.loads((d / f).read_text()) for d in runs)
            assert _strip(ra) == _strip(rb)
            assert ra["metrics"]["perplexity_compressed"]["perplexity"] > 0  # metrics were compared
        elif f.name == "report.md":
            assert _without_timings((a / f).read_text()) == _without_timings((b / f).read_text())
        else:
            assert (a / f).read_bytes() == (b / f).read_bytes(), f"{f} differs between the two runs"
