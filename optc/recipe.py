"""Versioned YAML recipes: schema, loading (by built-in name or path), validation, dumping."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from optc.data import CalibrationConfig
from optc.errors import OptcError
from optc.evaluate.protocol import EvalProtocol
from optc.export.formats import FORMATS
from optc.methods import METHODS

RECIPE_VERSION = 1


def _validate_stage(item: Any) -> BaseModel:
    """One stage through its method's config, looked up when the recipe is validated (not when
    this module was imported), so a method registered later by a plugin or a test is known."""
    kind = getattr(item, "type", None)
    if isinstance(kind, str) and kind in METHODS and isinstance(item, METHODS[kind].config):
        return item  # already a validated config (a Recipe built in code)
    if not isinstance(item, dict):
        raise PydanticCustomError("stage_type", "a stage is a mapping with a 'type' (one of: {known})",
                                  {"known": ", ".join(METHODS)})
    kind = item.get("type")
    if kind is None:
        raise PydanticCustomError("stage_type_missing", "stage needs a 'type' (one of: {known})",
                                  {"known": ", ".join(METHODS)})
    method = METHODS.get(kind) if isinstance(kind, str) else None
    if method is None:
        raise PydanticCustomError("stage_type_unknown", "unknown stage type {kind} (known: {known})",
                                  {"kind": repr(kind), "known": ", ".join(METHODS)})
    # Its errors come back located under this stage (stages.0.scheme.bits).
    return method.config.model_validate(item)


# A stage's config, of whichever registered method its ``type`` names; dumped as that config.
StageConfig = Annotated[Any, BeforeValidator(_validate_stage)]


class EvaluationConfig(EvalProtocol):
    """A recipe's ``evaluation:`` block: the evaluation protocol (the same defaults as ``optc
    eval``) and whether the uncompressed model is measured too."""

    baseline: bool = Field(True, description="also evaluate the uncompressed model")


class ExportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str = Field("dense", description="export format: a registered format name (optc.export.formats)")
    max_shard_size: str = "2GB"
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto", description="dtype of the tensors that are not quantized (and of dense weights); auto: "
        "the source model's dtype, bfloat16 for a GGUF source (dequantized to float32 on load)",
    )
    embedding_bits: Literal[16, 8] = Field(
        16, description="8: store the input embedding in 8 bits where the format and its runtime hold "
        "it (GGUF Q8_0); other formats refuse it before any calibration",
    )
    sparsity_metadata: bool = Field(
        True, description="pruned models: add compressed-tensors' sparsity_config to config.json"
    )

    @field_validator("format")
    @classmethod
    def _registered_format(cls, v: str) -> str:
        # Checked against the registry when validating, so a format registered after import counts.
        if v not in FORMATS:
            raise ValueError(f"unknown export format {v!r} (expected one of {', '.join(FORMATS)})")
        return v


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1]
    name: str = "custom"
    description: str = ""
    model: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    stages: list[StageConfig] = Field(default_factory=list)
    evaluation: EvaluationConfig | None = Field(default_factory=EvaluationConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    gates: list[str] = Field(
        default_factory=list,
        description="CI gates checked after the run, e.g. 'ppl_increase<=5%' (exit code 3 on failure)",
    )

    @field_validator("gates")
    @classmethod
    def _valid_gates(cls, v: list[str]) -> list[str]:
        from optc.evaluate.gates import parse_gate

        for text in v:
            try:
                parse_gate(text)
            except OptcError as exc:
                raise ValueError(str(exc)) from None
        return v

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json", exclude_none=False)
        return yaml.safe_dump(data, sort_keys=False)


def builtin_recipes() -> dict[str, Path]:
    root = resources.files("optc.recipes")
    return {p.name: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def resolve_recipe(name_or_path: str) -> Path:
    """A path that exists wins; otherwise a built-in recipe by name (``.yaml`` optional)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise OptcError(f"recipe {name_or_path!r} is a directory, not a YAML file")
    builtins = builtin_recipes()
    key = name_or_path if name_or_path.endswith(".yaml") else f"{name_or_path}.yaml"
    if key in builtins:
        return builtins[key]
    raise OptcError(
        f"unknown recipe {name_or_path!r}: not a file and not a built-in recipe "
        f"(built-in: {', '.join(sorted(builtins))})"
    )


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def format_validation_error(exc: ValidationError, source: str) -> str:
    problems = []
    for err in exc.errors():
        where = _loc(err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field (not part of the recipe schema)"
        elif err["type"] in ("stage_type", "stage_type_missing", "stage_type_unknown"):
            pass  # the message says it all (the input is the whole stage)
        elif "input" in err and not isinstance(err["input"], dict | list):
            msg = f"{msg} (got {err['input']!r})"
        problems.append(f"{where}: {msg}")
    return f"recipe {source}: " + "; ".join(problems)


def parse_recipe(data: Any, source: str = "<recipe>") -> Recipe:
    if not isinstance(data, dict):
        raise OptcError(f"recipe {source}: expected a mapping at the top level, got {type(data).__name__}")
    if "version" not in data:
        raise OptcError(f"recipe {source}: version: missing (this optc reads version: {RECIPE_VERSION})")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise OptcError(format_validation_error(exc, source)) from None
    except ValueError as exc:  # raised by validators outside pydantic's error wrapping
        raise OptcError(f"recipe {source}: {exc}") from None


# A recipe is a few hundred bytes of YAML; anything past this is refused before it is parsed
# (YAML aliases can make a small file expand, a large one costs memory and minutes).
MAX_RECIPE_BYTES = 2**20


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader (plain data only, no tags that build objects), refusing a
    mapping that repeats a key: YAML lets the last one win, so a second ``stages:`` would
    silently replace the first."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:  # the node's own keys; ``<<`` merges may be overridden
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        if key in seen:
            first = seen[key].start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {first.line + 1}): a key may appear "
                "once per mapping", key_node.start_mark)
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_recipe_text(path: Path) -> str:
    """A recipe file's text, refused unread past :data:`MAX_RECIPE_BYTES`."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:
        raise OptcError(f"recipe {path}: cannot read ({exc})") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise OptcError(f"recipe {path}: larger than {MAX_RECIPE_BYTES // 2**20} MiB; a recipe is a short YAML "
                        "file (is this the right file?)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OptcError(f"recipe {path}: cannot read ({exc})") from None


def safe_load_unique(text: str) -> Any:
    """``yaml.safe_load`` with duplicate keys refused."""
    loader = _UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_recipe_data(path: Path) -> Any:
    text = read_recipe_text(path)
    try:
        return safe_load_unique(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise OptcError(f"recipe {path}: malformed YAML at{where}: {problem}") from None


def load_recipe(name_or_path: str, overrides: dict[str, Any] | None = None) -> Recipe:
    """Load and validate a recipe; ``overrides`` are dotted keys (``calibration.samples``)."""
    path = resolve_recipe(name_or_path)
    data = read_recipe_data(path)
    if overrides and isinstance(data, dict):
        data = apply_overrides(data, overrides)
    return parse_recipe(data, str(path.name if path.parent == _builtin_root() else path))


def _builtin_root() -> Path:
    return Path(str(resources.files("optc.recipes")))


def apply_overrides(data: dict, overrides: dict[str, Any]) -> dict:
    """Set dotted keys in a plain recipe mapping; ``None`` values are skipped."""
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy of plain data
    for key, value in overrides.items():
        if value is None:
            continue
        node = data
        parts = key.split(".")
        try:
            for part in parts[:-1]:
                if isinstance(node, list):
                    node = node[int(part)]
                else:
                    if not isinstance(node.get(part), dict | list):
                        node[part] = {}
                    node = node[part]
            if isinstance(node, list):
                node[int(parts[-1])] = value
            else:
                node[parts[-1]] = value
        except (IndexError, ValueError):
            raise OptcError(f"cannot set {key} = {value!r}: the recipe has no such entry") from None
    return data
