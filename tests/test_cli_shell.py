"""The command line as a shell sees it: completion, --help from the registries, flags, --device."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optc.cli.main import app
from optc.export.formats import FORMATS
from optc.methods import methods_of_kind

COMMANDS_WITH_DEVICE = ("run", "quantize", "prune", "recover", "eval")


def _help(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return result.output


def _complete(words: str) -> list[str]:
    cword = len(words.split()) - (0 if words.endswith(" ") else 1)
    env = {"_OPTC_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
    result = CliRunner().invoke(app, [], env=env, prog_name="optc")
    assert result.exit_code == 0, result.output
    return result.output.split()


def test_completion_script_and_values(monkeypatch) -> None:
    assert "--install-completion" in _help()
    # Typer picks the shell from the parent process; the test must not depend on which shell ran it.
    monkeypatch.setattr("typer.completion._get_shell_name", lambda: "bash")
    script = CliRunner().invoke(app, ["--show-completion"], prog_name="optc")
    assert script.exit_code == 0 and "_OPTC_COMPLETE=complete_bash" in script.output, (script.output, script.exception)
    assert _complete("optc quantize --method ") == methods_of_kind("quantize")
    assert _complete("optc quantize --format ") == list(FORMATS)
    assert _complete("optc run w4a16-") and all(n.startswith("w4a16-") for n in _complete("optc run w4a16-"))
    assert _complete("optc quantize --dtype bf") == ["bfloat16"]


def test_method_help_lists_the_registry() -> None:
    text = re.sub(r"\s+", " ", _help("quantize"))
    assert all(m in text for m in methods_of_kind("quantize"))
    text = re.sub(r"\s+", " ", _help("prune"))
    assert all(m in text for m in ("magnitude", "wanda", "sparsegpt"))


@pytest.mark.parametrize("command", ["run", "quantize", "prune", "recover", "eval", "report", "export"])
def test_booleans_read_as_flags(command: str) -> None:
    for line in _help(command).splitlines():
        if "<bool>" in line:
            assert "--help" in line, line  # typer's own --help option is the only one left typed


@pytest.mark.parametrize("command", COMMANDS_WITH_DEVICE)
def test_every_command_that_runs_a_model_takes_device(command: str) -> None:
    assert "--device" in _help(command)


def test_eval_device(tiny_checkpoint: Path) -> None:
    import torch

    args = ["eval", str(tiny_checkpoint), "--windows", "1", "--seqlen", "32", "--no-cache", "-q", "--json"]
    result = CliRunner().invoke(app, [*args, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, [*args, "--device", "cuda", "--latency"])
    assert result.exit_code == 1
    if not torch.cuda.is_available():
        assert "no CUDA device" in result.output
    else:
        assert "runs on the CPU only" in result.output
