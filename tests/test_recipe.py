from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from optc.cli.main import app
from optc.errors import OptcError
from optc.recipe import Recipe, apply_overrides, builtin_recipes, load_recipe, parse_recipe

runner = CliRunner()


def _error_line(result) -> str:
    """The one user-facing error line of a failed CLI call."""
    assert result.exit_code == 1, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)  # a handled error, not a crash
    assert "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def test_builtin_recipes_validate() -> None:
    names = sorted(builtin_recipes())
    assert {"w4a16-rtn.yaml", "prune-2of4-magnitude.yaml"} <= set(names)
    result = runner.invoke(app, ["recipes", "validate"])
    assert result.exit_code == 0, result.output
    for name in names:
        assert f"ok {name}" in result.output
        load_recipe(name)  # also loadable by name from Python


def test_recipes_lists_and_shows() -> None:
    for args in (["recipes"], ["recipes", "list"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        for name in builtin_recipes():
            assert name in result.output
    result = runner.invoke(app, ["recipes", "show", "w4a16-rtn"])
    assert result.exit_code == 0
    assert result.output == builtin_recipes()["w4a16-rtn.yaml"].read_text()  # verbatim, not re-wrapped


BAD = {
    "malformed": ("version: 1\nstages: [\n", "malformed YAML"),
    "unknown_field": ("version: 1\ncalibraton: {samples: 4}\n", "calibraton: unknown field"),
    "unknown_nested_field": (
        "version: 1\nstages:\n  - type: rtn\n    sheme: {bits: 4}\n", "stages.0.sheme: unknown field"
    ),
    "wrong_type": ("version: 1\nstages:\n  - type: rtn\n    scheme: {bits: four}\n", "stages.0.scheme.bits"),
    "unknown_stage": ("version: 1\nstages:\n  - type: quantum\n", "unknown stage type 'quantum'"),
    "stage_without_type": ("version: 1\nstages:\n  - bits: 4\n", "stage needs a 'type'"),
    "missing_version": ("name: x\nstages: []\n", "version: missing"),
    "wrong_version": ("version: 2\n", "version"),
    "not_a_mapping": ("- 1\n- 2\n", "expected a mapping"),
    "bits_high": ("version: 1\nstages:\n  - type: rtn\n    scheme: {bits: 9}\n", "bits must be between 2 and 8"),
    "bits_low": ("version: 1\nstages:\n  - type: rtn\n    scheme: {bits: 1}\n", "bits must be between 2 and 8"),
    "group_zero": ("version: 1\nstages:\n  - type: rtn\n    scheme: {group_size: 0}\n", "group_size must be positive"),
    "group_negative": ("version: 1\nstages:\n  - type: rtn\n    scheme: {group_size: -8}\n", "group_size must be positive"),
    "pattern_n_gt_m": ("version: 1\nstages:\n  - type: magnitude\n    pattern: '3:2'\n", "pattern '3:2' needs 0 < N < M"),
    "pattern_zero": ("version: 1\nstages:\n  - type: magnitude\n    pattern: '0:4'\n", "pattern '0:4' needs 0 < N < M"),
    "pattern_garbage": ("version: 1\nstages:\n  - type: magnitude\n    pattern: 'half'\n", "not of the form N:M"),
    "bad_regex": ("version: 1\nstages:\n  - type: rtn\n    targets: ['(q_proj']\n", "'(q_proj' is not a valid regex"),
    "bad_sparsity": ("version: 1\nstages:\n  - type: magnitude\n    sparsity: 1.5\n", "stages.0.sparsity"),
    "bad_export": ("version: 1\nexport: {format: onnx}\n", "export.format"),
    "bad_seqlen": ("version: 1\nevaluation: {seqlen: 0}\n", "evaluation.seqlen"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_recipe_is_one_line_error(case: str, tmp_path: Path) -> None:
    text, expected = BAD[case]
    path = tmp_path / f"{case}.yaml"
    path.write_text(text)
    line = _error_line(runner.invoke(app, ["recipes", "validate", str(path)]))
    assert expected in line
    with pytest.raises(OptcError, match="recipe"):
        load_recipe(str(path))


def test_unknown_recipe_name() -> None:
    line = _error_line(runner.invoke(app, ["recipes", "validate", "w4a16-rtm"]))
    assert "unknown recipe 'w4a16-rtm'" in line and "w4a16-rtn.yaml" in line
    assert "unknown recipe" in _error_line(runner.invoke(app, ["recipes", "show", "nope"]))
    assert "unknown recipe" in _error_line(runner.invoke(app, ["run", "nope", "--no-eval"]))


def test_recipe_directory_refused(tmp_path: Path) -> None:
    assert "is a directory" in _error_line(runner.invoke(app, ["recipes", "validate", str(tmp_path)]))


@pytest.mark.parametrize("name", sorted(builtin_recipes()))
def test_to_yaml_round_trip(name: str) -> None:
    recipe = load_recipe(name)
    again = parse_recipe(yaml.safe_load(recipe.to_yaml()))
    assert again == recipe


def test_round_trip_with_overrides_and_nulls() -> None:
    recipe = parse_recipe({
        "version": 1,
        "evaluation": None,
        "stages": [{
            "type": "rtn", "scheme": {"bits": 3, "group_size": None, "symmetric": False},
            "overrides": [{"pattern": "down_proj", "scheme": None}, {"pattern": "q_proj", "scheme": {"bits": 8}}],
        }, {"type": "magnitude", "pattern": "2:4"}],
    })
    again = parse_recipe(yaml.safe_load(recipe.to_yaml()))
    assert again == recipe
    assert again.evaluation is None and again.stages[0].scheme.group_size is None
    assert again.stages[0].scheme_for("model.layers.0.mlp.down_proj") is None
    assert again.stages[0].scheme_for("model.layers.0.self_attn.q_proj").bits == 8


def test_group_size_minus_one_means_per_channel() -> None:
    recipe = parse_recipe({"version": 1, "stages": [{"type": "rtn", "scheme": {"group_size": -1}}]})
    assert recipe.stages[0].scheme.group_size is None


def test_overrides_win_over_recipe_values() -> None:
    data = yaml.safe_load(builtin_recipes()["w4a16-rtn.yaml"].read_text())
    overrides = {
        "model": "some/model",
        "calibration.samples": 7,
        "evaluation.windows": 2,
        "stages.0.scheme.bits": 3,
        "stages.0.scheme.group_size": 32,
        "export.format": None,  # None means "not given": the recipe value stays
    }
    recipe = parse_recipe(apply_overrides(data, overrides))
    assert recipe.model == "some/model"
    assert recipe.calibration.samples == 7
    assert recipe.evaluation.windows == 2
    assert recipe.stages[0].scheme.bits == 3 and recipe.stages[0].scheme.group_size == 32
    assert recipe.stages[0].scheme.symmetric is True  # untouched sibling kept
    assert recipe.export.format == data["export"]["format"]
    assert data["stages"][0]["scheme"]["bits"] == 4  # input mapping not mutated
    assert load_recipe("w4a16-rtn", {"stages.0.scheme.bits": 8}).stages[0].scheme.bits == 8


def test_overrides_are_validated(tmp_path: Path) -> None:
    with pytest.raises(OptcError, match="bits must be between 2 and 8"):
        load_recipe("w4a16-rtn", {"stages.0.scheme.bits": 12})
    with pytest.raises(OptcError, match="cannot set stages.0.scheme.bits"):
        apply_overrides({"version": 1, "stages": []}, {"stages.0.scheme.bits": 3})
    path = tmp_path / "no-stages.yaml"
    path.write_text("version: 1\nstages: []\n")
    line = _error_line(runner.invoke(app, ["quantize", "--recipe", str(path), "--bits", "3", "--no-eval"]))
    assert "the recipe has no such entry" in line


def test_recipe_model_is_strict() -> None:
    assert isinstance(parse_recipe({"version": 1}), Recipe)
    with pytest.raises(OptcError, match="version: missing"):
        parse_recipe({})
