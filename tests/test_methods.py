"""The method registry: what each built-in method is, registering one later, the torch-free
recipe schema, the planned/declared schemes, and command-line flags addressing stages by kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import ConfigDict
from typer.testing import CliRunner

from optc.cli.main import app
from optc.errors import OptcError
from optc.methods import METHODS, Method, declared_schemes, methods_of_kind, planned_schemes, register, unregister
from optc.methods.base import LinearsConfig
from optc.recipe import load_recipe, parse_recipe
from optc.testing import tiny_model

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ["rtn", "gptq", "awq", "signround", "magnitude", "wanda", "sparsegpt", "structured", "smoothquant", "w8a8",
           "kv_cache", "recover"]


def _error_line(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 1, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def _torch_free(code: str) -> None:
    """Run ``code`` in a fresh interpreter, then check it imported neither torch nor transformers."""
    check = code + "\nimport sys\nprint([m for m in ('torch', 'transformers') if m in sys.modules])\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


# --- the registry ---------------------------------------------------------------------------


def test_builtin_methods_say_what_they_are() -> None:
    assert list(METHODS)[: len(BUILTIN)] == BUILTIN  # the order errors and --help list them in
    for name in BUILTIN:
        m = METHODS[name]
        assert m.name == name and m.config.model_config["extra"] == "forbid"
        assert m.config.model_fields["type"].annotation == Literal[name]
        assert callable(m.run)
    assert methods_of_kind("quantize") == ["rtn", "gptq", "awq", "signround", "w8a8"]
    assert methods_of_kind("prune") == ["magnitude", "wanda", "sparsegpt", "structured"]
    assert methods_of_kind("transform") == ["smoothquant"] and methods_of_kind("recover") == ["recover"]
    assert methods_of_kind("cache") == ["kv_cache"]
    assert [n for n in BUILTIN if METHODS[n].streams] == ["rtn", "gptq", "awq", "signround"]
    assert [n for n in BUILTIN if METHODS[n].saves_layers] == ["gptq", "awq"]
    assert "hessian" in METHODS["gptq"].accumulators and METHODS["rtn"].accumulators == ()
    for name in methods_of_kind("quantize"):  # the uniform scheme interface of quantizing configs
        cfg = METHODS[name].config.model_validate({"type": name})
        assert cfg.planned_schemes()[0] == ("scheme", cfg.scheme, False)
        assert cfg.scheme_for("model.layers.0.mlp.down_proj") == cfg.scheme


def test_registration_is_checked() -> None:
    class NoForbid(LinearsConfig):
        model_config = ConfigDict(extra="ignore")
        type: Literal["loose"]

    with pytest.raises(ValueError, match="extra='forbid'"):
        register(Method("loose", NoForbid, lambda ws, cfg: {}, "transform"))
    with pytest.raises(ValueError, match="kind"):
        register(Method("odd", METHODS["rtn"].config, lambda ws, cfg: {}, "compile"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already registered"):
        register(Method("rtn", METHODS["rtn"].config, lambda ws, cfg: {}, "quantize"))
    assert "loose" not in METHODS and "odd" not in METHODS


class NoopStage(LinearsConfig):
    """A throwaway method registered by the test, after optc.recipe was imported."""

    type: Literal["noop"]
    strength: float = 1.0


def test_method_registered_later_is_a_recipe_stage(tiny_checkpoint: Path) -> None:
    from optc.run.pipeline import run_recipe

    data = {"version": 1, "model": str(tiny_checkpoint), "evaluation": None, "calibration": {"samples": 2, "seqlen": 32},
            "stages": [{"type": "noop", "strength": 2.0}]}
    with pytest.raises(OptcError, match="unknown stage type 'noop'"):
        parse_recipe(data)
    seen = []
    register(Method("noop", NoopStage, lambda ws, cfg: seen.append(cfg.strength) or {"notes": ["did nothing"]}, "transform"))
    try:
        recipe = parse_recipe(data)
        assert isinstance(recipe.stages[0], NoopStage) and "noop" in recipe.to_yaml()
        with pytest.raises(OptcError, match=r"stages\.0\.strengh: unknown field"):
            parse_recipe({**data, "stages": [{"type": "noop", "strengh": 2}]})
        report = run_recipe(recipe, None)
        assert seen == [2.0] and report["stages"][0]["summary"] == "did nothing"
    finally:
        unregister("noop")
    assert "noop" not in METHODS


# --- torch-free schema ------------------------------------------------------------------------


def test_recipe_schema_imports_no_torch() -> None:
    mods = ", ".join(f"optc.methods.{n}" for n in BUILTIN)
    _torch_free(f"import optc.recipe, {mods}\noptc.recipe.load_recipe('int8')\n"
                "[optc.recipe.load_recipe(n) for n in optc.recipe.builtin_recipes()]")


def test_recipes_validate_imports_no_torch(tmp_path: Path) -> None:
    path = tmp_path / "some.yaml"
    path.write_text("version: 1\nstages:\n  - type: sparsegpt\n    pattern: '2:4'\n  - type: gptq\n    scheme: {bits: 3}\n")
    _torch_free("from typer.testing import CliRunner\nfrom optc.cli.main import app\n"
                f"r = CliRunner().invoke(app, ['recipes', 'validate', {str(path)!r}])\n"
                "assert r.exit_code == 0 and 'ok' in r.output, r.output")


# --- planned and declared schemes -------------------------------------------------------------


def test_declared_and_planned_schemes() -> None:
    recipe = parse_recipe({"version": 1, "stages": [
        {"type": "magnitude", "pattern": "2:4"},
        {"type": "gptq", "groups": "permuted", "scheme": {"bits": 3},
         "overrides": [{"pattern": "down_proj", "scheme": {"bits": 8}}, {"pattern": "q_proj", "scheme": None}]},
        {"type": "rtn", "targets": ["o_proj"], "scheme": {"bits": 4, "group_size": None}},
    ]})
    declared = [(where, s.label(), permuted) for where, s, permuted in declared_schemes(recipe.stages)]
    assert declared == [
        ("stage 1 (gptq) scheme", "int3-sym-g64", True),
        ("stage 1 (gptq) override 'down_proj'", "int8-sym-g64", True),
        ("stage 2 (rtn) scheme", "int4-sym-channel", False),
    ]
    model = tiny_model("llama")
    planned = {n: s.label() for n, s in planned_schemes(model, recipe.stages).items()}
    assert planned["model.layers.0.mlp.down_proj"] == "int8-sym-g64"
    assert planned["model.layers.0.self_attn.o_proj"] == "int4-sym-channel"  # the last stage wins
    assert "model.layers.0.self_attn.q_proj" not in planned  # left in float
    assert planned["model.layers.1.mlp.up_proj"] == "int3-sym-g64"


# --- command-line flags address stages by kind ------------------------------------------------


def test_quantize_flags_go_to_the_first_quantize_stage(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "sparse-w3"
    result = runner.invoke(app, ["quantize", "--recipe", "sparse-2of4-w4a16", "--bits", "3", "--model", str(tiny_checkpoint),
                                 "--output", str(out), "--samples", "2", "--seqlen", "32", "--no-eval"])
    assert result.exit_code == 0, (result.output, result.exception)
    written = yaml.safe_load((out / "recipe.yaml").read_text())
    original = yaml.safe_load(load_recipe("sparse-2of4-w4a16").to_yaml())
    assert written["stages"][1]["type"] == "gptq" and written["stages"][1]["scheme"]["bits"] == 3
    assert written["stages"][0] == original["stages"][0]  # the sparsegpt stage untouched
    report = json.loads((out / "report.json").read_text())
    schemes = {m["scheme"] for m in report["stages"][1]["stats"]["modules"].values()}
    assert schemes == {"int3-sym-g64"}
    assert report["stages"][0]["type"] == "sparsegpt" and report["stages"][0]["stats"]["pattern"] == "2:4"


def test_flags_without_a_stage_of_their_kind_are_refused(tiny_checkpoint: Path) -> None:
    common = ["--model", str(tiny_checkpoint), "--no-eval"]
    line = _error_line(["quantize", "--recipe", "prune-heads", "--bits", "3", *common])
    assert "--bits" in line and "no such entry" in line and "no quantize stage" in line
    line = _error_line(["prune", "--recipe", "w4a16-rtn", "--pattern", "2:4", *common])
    assert "--pattern" in line and "no prune stage" in line
    line = _error_line(["prune", "--recipe", "prune-heads", "--sparsity", "0.5", *common])
    assert "no prune stage taking pattern/sparsity" in line
    line = _error_line(["prune", "--recipe", "prune-2of4-wanda", "--structured", "heads=0.25", *common])
    assert "--structured" in line and "heads/kv_heads/mlp" in line
    assert "unknown quantization method 'magnitude'" in _error_line(["quantize", "--method", "magnitude", *common])
    assert "expected magnitude, wanda or sparsegpt" in _error_line(["prune", "--method", "structured", *common])


def test_help_lists_the_registry() -> None:
    import typer

    def helps(command: str) -> dict[str, str]:
        cmd = typer.main.get_command(app).commands[command]
        return {p.opts[0]: p.help or "" for p in cmd.params if p.opts}

    q = helps("quantize")
    assert "rtn, gptq, awq, signround, w8a8" in q["--method"]
    assert all("first quantize stage" in q[f] for f in ("--method", "--bits", "--group-size"))
    p = helps("prune")
    assert "magnitude, wanda, sparsegpt" in p["--method"]
    assert all("first prune stage" in p[f] for f in ("--method", "--pattern", "--sparsity"))
