"""Property-based fuzzing of the recipe loader and the command line (hypothesis).

Whatever the input, optc answers with a valid recipe / a run that gets as far as loading the
model, or a one-line error (exit code 1) or a usage error (exit code 2): never a traceback.
The command-line tests run every real check that comes before loading a model, then stop at
the load (a patched ``load_model``), so each example takes milliseconds.
"""

from __future__ import annotations

import math
from pathlib import Path

import click
import pytest
import typer
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import optc.model.load
import optc.run.pipeline
from optc.cli.main import app
from optc.errors import OptcError
from optc.export.formats import FORMATS
from optc.recipe import Recipe, apply_overrides, load_recipe, parse_recipe
from optc.methods import METHODS

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# --- the recipe loader -------------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["2:4", ".*", "[", "lm_head", "int8", "64", "0.5", "builtin", "null"]),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def _fields(model: type) -> list[str]:
    return list(model.model_fields)


STAGE_FIELDS = sorted({f for m in METHODS.values() for f in _fields(m.config)} | {"scheme.bits", "bogus"})


@st.composite
def stage_dicts(draw) -> dict:
    stage: dict = {"type": draw(st.sampled_from([*METHODS, "nope", 3, None]))}
    for name in draw(st.lists(st.sampled_from(STAGE_FIELDS), max_size=4)):
        if name == "scheme.bits":
            stage["scheme"] = {"bits": draw(values), "group_size": draw(values)}
        elif name != "type":
            stage[name] = draw(values)
    return stage


@st.composite
def recipe_dicts(draw) -> dict:
    data: dict = {}
    if draw(st.integers(0, 9)):  # mostly present, sometimes missing
        data["version"] = draw(st.sampled_from([1, 1, 1, 2, "1", None]))
    for section in draw(st.lists(st.sampled_from(_fields(Recipe) + ["junk"]), max_size=5)):
        if section == "stages":
            data["stages"] = draw(st.lists(stage_dicts(), max_size=3))
        elif section == "export":
            data["export"] = {"format": draw(st.sampled_from([*FORMATS, "onnx"])), **draw(
                st.dictionaries(st.sampled_from(["max_shard_size", "sparsity_metadata", "x"]), values, max_size=2))}
        elif section in ("calibration", "evaluation"):
            keys = st.sampled_from(["dataset", "samples", "seqlen", "seed", "windows", "stride", "batch_size",
                                    "sampling", "autocast", "baseline", "bogus"])
            data[section] = draw(st.one_of(st.none(), st.dictionaries(keys, values, max_size=4)))
        elif section == "gates":
            data["gates"] = draw(st.lists(st.one_of(
                st.sampled_from(["ppl_increase<=5%", "kl_mean<0.1", "top1_agreement>=90%", "ppl<=", "x>1"]),
                st.text(max_size=10)), max_size=3))
        else:
            data[section] = draw(values)
    return data


def _parsed_or_refused(data) -> Recipe | None:
    try:
        return parse_recipe(data, "fuzz")
    except OptcError as exc:
        assert "\n" not in str(exc), str(exc)
        return None


@FUZZ
@given(recipe_dicts())
def test_recipe_mappings_parse_or_give_one_line(data: dict) -> None:
    recipe = _parsed_or_refused(data)
    if recipe is not None:  # a valid recipe survives its own YAML round trip
        assert parse_recipe(yaml.safe_load(recipe.to_yaml())) == recipe


@FUZZ
@given(values)
def test_any_yaml_value_parses_or_gives_one_line(data) -> None:
    _parsed_or_refused(data)


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                 recipe_dicts().map(lambda d: yaml.safe_dump(d).encode())))
def test_recipe_files_of_any_bytes(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(raw)
    try:
        load_recipe(str(path), {"calibration.samples": 4})
    except OptcError as exc:
        assert "\n" not in str(exc), str(exc)


@FUZZ
@given(recipe_dicts(), st.dictionaries(
    st.sampled_from(["model", "calibration.samples", "stages.0.type", "stages.0.scheme.bits", "stages.3.x",
                     "export.format", "evaluation.windows", "a.b.c", "stages.x"]), values, max_size=3))
def test_overrides_apply_or_give_one_line(data: dict, overrides: dict) -> None:
    try:
        _parsed_or_refused(apply_overrides(data, overrides))
    except OptcError as exc:
        assert "\n" not in str(exc), str(exc)


# --- the command line ---------------------------------------------------------------------------


class _ModelLoad(Exception):
    """Raised by the patched loader: the command got through every check before any work."""


def _stop_at_load(*_args, **_kwargs):
    raise _ModelLoad


def _options(path: list[str]) -> list[click.Option]:
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return [p for p in cmd.params if isinstance(p, click.Option)]


COMMANDS = [["quantize"], ["prune"], ["run"], ["eval"], ["export"], ["inspect"], ["report"],
            ["recipes", "show"], ["recipes", "validate"]]
TEXT_VALUES = ["w4a16-gptq", "w4a16-rtn.yaml", "int8-kl", "builtin", "2:4", "3:2", "heads=0.25,mlp=0.3",
               "heads=x", "ppl_increase<=5%", "kl_mean>", "cpu", "cuda", "auto", "gptq", "awq", "rtn",
               "sparsegpt", "dense", "gguf-q4_0", "onnx", "int4", "-1", "0", "1e9", "nan", "", "é", "--"]


@st.composite
def command_lines(draw, paths: dict[str, Path]) -> list[str]:
    path = draw(st.sampled_from(COMMANDS))
    args = list(path)
    places = [str(p) for p in paths.values()]
    options = _options(path)
    for opt in draw(st.lists(st.sampled_from(options), max_size=5)) if options else []:
        flag = draw(st.sampled_from(opt.opts))
        if opt.is_flag:
            args.append(flag)
            continue
        kind = opt.type
        if isinstance(kind, click.types.IntParamType):
            value = str(draw(st.integers(-3, 5000)))
        elif isinstance(kind, click.types.FloatParamType):
            value = repr(draw(st.floats(-2, 2, allow_nan=True)))
        else:
            value = draw(st.sampled_from(TEXT_VALUES + places) | st.text(max_size=6))
        args += [flag, draw(st.sampled_from([value, value, value, "x"]))]
    if draw(st.booleans()):
        args.insert(draw(st.integers(0, len(args))), draw(st.sampled_from(places + TEXT_VALUES + ["--bogus"])))
    return args


@pytest.fixture
def places(tmp_path: Path, monkeypatch) -> dict[str, Path]:
    monkeypatch.setattr(optc.run.pipeline, "load_model", _stop_at_load)
    monkeypatch.setattr(optc.model.load, "load_model", _stop_at_load)
    (tmp_path / "dir").mkdir()
    (tmp_path / "file.txt").write_text("some text " * 10)
    (tmp_path / "bad.yaml").write_text("version: 1\nstages: [{type: gptq, bits: 4}]\n")
    return {"new": tmp_path / "out" / "new", "dir": tmp_path / "dir", "file": tmp_path / "file.txt",
            "recipe": tmp_path / "bad.yaml", "missing": tmp_path / "missing.gguf"}


def _check(args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    where = f"optc {' '.join(args)!r}: exit {result.exit_code}\n{result.output}"
    assert "Traceback" not in result.output, where
    if isinstance(result.exception, _ModelLoad):
        return  # every check passed: the run would start now
    assert result.exception is None or isinstance(result.exception, SystemExit), (where, result.exception)
    assert result.exit_code in (0, 1, 2), where
    if result.exit_code == 1:
        errors = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert len(errors) == 1 and errors[0].startswith("error:"), where
    if result.exit_code == 2:
        assert "Usage:" in result.output, where


def test_command_line_fuzz(places: dict[str, Path]) -> None:
    # hypothesis' given() cannot take the fixture's paths as a strategy argument directly.
    @FUZZ
    @given(st.data())
    def run(data) -> None:
        _check(data.draw(command_lines(places)))

    run()


@pytest.mark.parametrize("args", [
    ["quantize", "--bits", "99"], ["prune", "--structured", "heads=2"], ["quantize", "--samples", "0"],
    ["quantize", "--seqlen", "-1"], ["quantize", "--method", "nope"], ["eval", "--seqlen", "0"],
    ["quantize", "--format", "onnx"], ["prune", "--sparsity", "nan"], ["quantize", "--gate", "ppl"],
])
def test_known_bad_values_give_one_line(places: dict[str, Path], args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and not isinstance(result.exception, _ModelLoad), (args, result.output)
    _check(args)


def test_floats_in_recipes_are_finite_or_refused() -> None:
    data = {"version": 1, "stages": [{"type": "magnitude", "sparsity": math.nan}]}
    with pytest.raises(OptcError):
        parse_recipe(data)
