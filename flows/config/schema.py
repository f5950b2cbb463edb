"""Pipeline config, schema version 1 (docs/architecture.md §3).

`load_config(path)` reads YAML with yaml.safe_load semantics, validates it with pydantic and a
second semantic pass, and raises ConfigError listing every problem at once, each with the
file, line, the path of the offending key and what was expected. Nothing is imported or run:
factories are resolved with importlib's finder and an AST scan of the module's source.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pt2flow.flows.config.inputs import (  # noqa: F401  (InputConfig stays importable from flows.config.schema)
    INPUT_FILE_SUFFIXES,
    InputConfig,
    check_dims_named,
    check_dynamic,
    parse_inputs,
)
from pt2flow.flows.config.limits import Limits, LimitsConfig, resolve_limits  # noqa: F401  (Limits: part of ResolvedModel)
from pt2flow.stages.vocabulary import DTYPE_NAMES, FACTORY_PATTERN, STAGES  # noqa: F401  (DTYPE_NAMES re-exported)
from pt2flow.stages.importing import search_path_first
from pt2flow.stages.options import OPTIONS, UNION_TAGS
from pt2flow.storage.urls import redact_url

CONFIG_VERSION = 1
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
# A config is walked recursively (pydantic, ${ENV} expansion, canonical JSON of kwargs): bound it.
MAX_CONFIG_DEPTH = 100
MAX_CONFIG_NODES = 1_000_000
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class ConfigIssue:
    path: str  # e.g. models[2].inputs.x.dtype
    message: str
    line: int | None = None


class ConfigError(Exception):
    """A config is unusable. Holds every issue found, not just the first."""

    def __init__(self, source: str, issues: Sequence[ConfigIssue]) -> None:
        self.source = source
        self.issues = list(issues)
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"{self.source}: {len(self.issues)} problem{'s' if len(self.issues) != 1 else ''} in the config:"]
        for issue in self.issues:
            where = f"{self.source}:{issue.line}" if issue.line else self.source
            lines.append(f"  {where}: {issue.path or '(top level)'}: {issue.message}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# schema

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DimConfig(_Strict):
    min: int = Field(ge=1)
    max: int = Field(ge=1, le=2**31 - 1)


class StageDefaults(_Strict):
    trace: dict[str, Any] = Field(default_factory=dict)
    functionalize: dict[str, Any] = Field(default_factory=dict)
    decompose: dict[str, Any] = Field(default_factory=dict)
    serialize: dict[str, Any] = Field(default_factory=dict)
    aot_compile: dict[str, Any] = Field(default_factory=dict)
    validate_: dict[str, Any] = Field(default_factory=dict, alias="validate")
    limits: LimitsConfig = Field(default_factory=LimitsConfig)


class ModelConfig(_Strict):
    name: str
    factory: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    weights: str | None = None
    # forward() argument name -> input tree, checked by flows.config.inputs.parse_inputs, which
    # reports problems at their YAML path together with the schema's
    inputs: Any = None
    inputs_factory: str | None = None
    inputs_file: str | None = None
    # argument -> dims tree mirroring the input (flows.config.inputs.check_dynamic)
    dynamic_shapes: dict[str, Any] = Field(default_factory=dict)
    dims: dict[str, DimConfig] = Field(default_factory=dict)
    stages: dict[str, dict[str, Any]] = Field(default_factory=dict)
    limits: LimitsConfig | None = None


class PipelineConfig(_Strict):
    version: Literal[1]
    store: str = "./pt2-store"
    storage_options: dict[str, Any] = Field(default_factory=dict)
    stages: list[str] = Field(default_factory=lambda: list(STAGES))
    defaults: StageDefaults = Field(default_factory=StageDefaults)
    models: list[ModelConfig] = Field(min_length=1)


# ---------------------------------------------------------------------------------------------
# resolved form handed to the flows


@dataclass(frozen=True)
class ResolvedModel:
    """One model with its stage options merged over the defaults and validated."""

    name: str
    factory: str
    kwargs: Mapping[str, Any]
    weights: str | None
    inputs: Mapping[str, Any]  # argument -> input tree (InputConfig at tensors; see parse_inputs)
    dynamic_shapes: Mapping[str, Any]  # argument -> dims tree ({dim index: dim name} at tensors)
    dims: Mapping[str, tuple[int, int]]
    options: Mapping[str, BaseModel]  # stage -> its options model
    search_path: str  # the config's folder, first on sys.path when the factory is imported
    inputs_factory: str | None = None  # "module:callable" returning (args, kwargs) for forward()
    inputs_file: str | None = None  # safetensors or torch.save file of example inputs
    limits: Limits = field(default_factory=Limits)

    @property
    def training(self) -> bool:
        return self.options["functionalize"].mode == "training"  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Pipeline:
    path: str
    store: str
    storage_options: Mapping[str, Any] = field(repr=False)  # may hold credentials
    stages: tuple[str, ...] = ()
    models: tuple[ResolvedModel, ...] = ()
    raw: Mapping[str, Any] = field(repr=False, default_factory=dict)

    def model(self, name: str) -> ResolvedModel:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# YAML with line numbers


class _Lines:
    """Maps a config path (('models', 2, 'inputs')) to the YAML line it came from."""

    def __init__(self, text: str) -> None:
        try:
            self.root = yaml.compose(text, Loader=yaml.SafeLoader)
        except (yaml.YAMLError, RecursionError):
            self.root = None

    def line(self, path: Iterable[Any]) -> int | None:
        node = self.root
        best = node.start_mark.line + 1 if node is not None else None
        for part in path:
            if isinstance(node, yaml.MappingNode):
                nxt = None
                for key_node, value_node in node.value:
                    if str(key_node.value) == str(part):
                        best = key_node.start_mark.line + 1
                        nxt = value_node
                        break
                node = nxt
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
                node = node.value[part]
                best = node.start_mark.line + 1
            else:
                break
            if node is None:
                break
        return best


def format_path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _pydantic_issues(exc: ValidationError, prefix: tuple[Any, ...], lines: _Lines) -> list[ConfigIssue]:
    issues = []
    for err in exc.errors():
        loc = tuple("validate" if p == "validate_" else p for p in err["loc"] if p not in UNION_TAGS)
        loc = prefix + loc
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "missing":
            message = "required key is missing"
        elif "input" in err and err["type"] not in ("missing",):
            shown = repr(err["input"])
            if len(shown) > 80:
                shown = shown[:77] + "..."
            message = f"{message} (got {shown})"
        issues.append(ConfigIssue(format_path(loc), message, lines.line(loc)))
    return issues



# ---------------------------------------------------------------------------------------------
# semantic checks


def _expand_env(value: Any, path: tuple[Any, ...], issues: list[ConfigIssue], lines: _Lines) -> Any:
    if isinstance(value, str):
        def repl(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in os.environ:
                issues.append(ConfigIssue(format_path(path), f"environment variable ${{{name}}} is not set", lines.line(path)))
                return ""
            return os.environ[name]

        return _ENV_REF.sub(repl, value)
    if isinstance(value, dict):
        return {k: _expand_env(v, path + (k,), issues, lines) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, path + (i,), issues, lines) for i, v in enumerate(value)]
    return value


def _defines(tree: ast.Module, name: str) -> bool:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return True
    return False


def _find_spec_without_importing(module_name: str) -> importlib.machinery.ModuleSpec | None:
    """importlib.util.find_spec, minus its side effect: for "a.b" it imports (runs) package a."""
    parent_name, _, _ = module_name.rpartition(".")
    if not parent_name or module_name in sys.modules:
        return importlib.util.find_spec(module_name)
    parent = _find_spec_without_importing(parent_name)
    if parent is None or parent.submodule_search_locations is None:
        return None
    return importlib.machinery.PathFinder.find_spec(module_name, list(parent.submodule_search_locations))


def resolve_factory_statically(factory: str, search_path: str) -> str | None:
    """Why `module:callable` cannot resolve, or None. Finds the module without executing it
    and looks for the name at the top level of its source."""
    module_name, _, attr = factory.partition(":")
    with search_path_first(search_path):
        try:
            spec = _find_spec_without_importing(module_name)
        except (ImportError, ValueError) as exc:
            return f"module {module_name!r} cannot be found: {exc}"
        if spec is None:
            return f"module {module_name!r} not found (looked in {search_path} and on sys.path)"
        origin = spec.origin
        if not origin or not origin.endswith(".py") or not os.path.exists(origin):
            return None  # a compiled or namespace module: checked when imported
        try:
            tree = ast.parse(Path(origin).read_text(encoding="utf-8"), filename=origin)
        except SyntaxError as exc:
            return f"module {module_name!r} ({origin}) has a syntax error at line {exc.lineno}: {exc.msg}"
        if not _defines(tree, attr.split(".")[0]):
            return f"{attr.split('.')[0]!r} is not defined at the top level of {origin}"
        return None


def check_stage_list(stages: Sequence[str]) -> list[str]:
    """Problems with a stage selection: unknown names, order, duplicates, missing prerequisites."""
    problems = []
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        problems.append(f"unknown stage(s) {unknown}; stages are {list(STAGES)}")
        return problems
    if len(set(stages)) != len(stages):
        problems.append("a stage is listed twice")
    if list(stages) != [s for s in STAGES if s in stages]:
        problems.append(f"stages must keep the pipeline order {list(STAGES)}")
    if "trace" not in stages:
        problems.append("trace is required: every other stage starts from its program")
    if "validate" in stages and not ({"serialize", "aot_compile"} & set(stages)):
        problems.append("validate needs serialize or aot_compile (it compares their artifacts with eager)")
    return problems


def _factory_problem(value: str, search_path: str) -> str | None:
    """Why a `module:callable` reference is unusable (its form, or what the static resolution
    found), or None."""
    if not FACTORY_PATTERN.fullmatch(value):
        return f"{value!r} is not of the form 'package.module:callable'"
    return resolve_factory_statically(value, search_path)


def _check_model(
    index: int,
    model: ModelConfig,
    inputs: dict[str, Any] | None,
    defaults: Mapping[str, dict[str, Any]],
    search_path: str,
    lines: _Lines,
    issues: list[ConfigIssue],
    check_options: bool = True,
) -> ResolvedModel | None:
    base = ("models", index)
    before = len(issues)

    def add(path: tuple[Any, ...], message: str) -> None:
        issues.append(ConfigIssue(format_path(base + path), message, lines.line(base + path)))

    if not NAME_PATTERN.fullmatch(model.name) or model.name in (".", "..") or ".." in model.name:
        add(("name",), f"{model.name!r} is not a valid model name: use 1-128 of [A-Za-z0-9._-], no '..'")
    for key in ("factory", "inputs_factory"):
        value = getattr(model, key)
        problem = _factory_problem(value, search_path) if value is not None else None
        if problem:
            add((key,), problem)
    if model.weights is not None:
        plain = model.weights.split("?", 1)[0].lower()
        if not plain.endswith(WEIGHT_SUFFIXES):
            add(("weights",), f"weights must be a state_dict file ending in one of {list(WEIGHT_SUFFIXES)}")
        if "://" in model.weights and redact_url(model.weights) != model.weights:
            add(("weights",), "the weights URL holds credentials, which would be stored in the index and Prefect's parameters; use storage_options or the environment")
    sources = [k for k in ("inputs", "inputs_factory", "inputs_file") if getattr(model, k) is not None]
    if len(sources) > 1:
        add((sources[1],), f"give the example inputs one way: {' or '.join(sources)}, not both")
    if model.inputs_file is not None:
        plain = model.inputs_file.split("?", 1)[0].lower()
        if not plain.endswith(INPUT_FILE_SUFFIXES):
            add(("inputs_file",), f"inputs_file must be a .safetensors file or a torch.save file ending in one of {list(INPUT_FILE_SUFFIXES[1:])}")
        elif "://" in model.inputs_file and redact_url(model.inputs_file) != model.inputs_file:
            add(("inputs_file",), "the inputs_file URL holds credentials; use storage_options or the environment")
        elif "://" not in model.inputs_file and not (Path(search_path) / model.inputs_file).is_file():
            add(("inputs_file",), f"file not found: {Path(search_path) / model.inputs_file}")

    dynamic: dict[str, Any] = {}
    if model.inputs is not None:
        if isinstance(model.inputs, dict) and not model.inputs:
            add(("inputs",), "at least one input is required")
        inputs = inputs or {}
        for arg, per_arg in model.dynamic_shapes.items():
            if arg in inputs and inputs[arg] is None and model.inputs.get(arg) is not None:
                continue  # the input itself is broken, reported already
            if arg not in inputs:
                add(("dynamic_shapes", arg), f"no input named {arg!r} (inputs: {sorted(inputs)})")
                continue
            checked = check_dynamic(inputs[arg], per_arg, ("dynamic_shapes", arg), ("inputs", arg), model.dims, add)
            if checked is not None:
                dynamic[arg] = checked
    elif sources:
        for arg, per_arg in model.dynamic_shapes.items():
            checked = check_dims_named(per_arg, ("dynamic_shapes", arg), model.dims, add)
            if checked is not None:
                dynamic[arg] = checked
    else:
        add(("inputs",), "required key is missing")
    for dim_name, spec in model.dims.items():
        if spec.min > spec.max:
            add(("dims", dim_name), f"min {spec.min} is greater than max {spec.max}")

    options: dict[str, BaseModel] = {}
    for stage, overrides in model.stages.items():
        if stage not in STAGES:
            add(("stages", stage), f"unknown stage {stage!r}; per-model overrides are for {list(STAGES)}")
    for stage in STAGES if check_options else ():
        merged = {**defaults.get(stage, {}), **model.stages.get(stage, {})}
        try:
            options[stage] = OPTIONS[stage](**merged)
        except ValidationError as exc:
            issues.extend(_pydantic_issues(exc, base + ("stages", stage), lines))
    validate_options = options.get("validate")
    if validate_options is not None and dynamic and validate_options.samples < 3:  # type: ignore[attr-defined]
        add(("stages", "validate", "samples"), "must be >= 3 for a model with dynamic dims (example, min and max)")
    if len(issues) != before:
        return None
    return ResolvedModel(
        name=model.name,
        factory=model.factory,
        kwargs=dict(model.kwargs),
        weights=model.weights,
        inputs=dict(inputs or {}),
        dynamic_shapes=dynamic,
        dims={k: (v.min, v.max) for k, v in model.dims.items()},
        options=options,
        search_path=search_path,
        inputs_factory=model.inputs_factory,
        inputs_file=model.inputs_file,
    )


def _parse_all_inputs(data: Mapping[str, Any], lines: _Lines, issues: list[ConfigIssue]) -> dict[int, dict[str, Any] | None]:
    """parse_inputs for every model, before the schema pass, so that input problems are
    reported together with schema problems."""
    def add(path: tuple[Any, ...], message: str) -> None:
        issues.append(ConfigIssue(format_path(path), message, lines.line(path)))

    def add_schema(exc: ValidationError, path: tuple[Any, ...]) -> None:
        issues.extend(_pydantic_issues(exc, path, lines))

    models = data.get("models")
    parsed: dict[int, dict[str, Any] | None] = {}
    for i, model in enumerate(models if isinstance(models, list) else []):
        if isinstance(model, dict):
            parsed[i] = parse_inputs(model.get("inputs"), ("models", i, "inputs"), add, add_schema)
    return parsed


def _duplicate_names(data: Mapping[str, Any], lines: _Lines) -> list[ConfigIssue]:
    """One issue per repeated `models[*].name`, read from the raw YAML data."""
    found: list[ConfigIssue] = []
    seen: dict[str, int] = {}
    models = data.get("models")
    for i, model in enumerate(models if isinstance(models, list) else []):
        name = model.get("name") if isinstance(model, dict) else None
        if not isinstance(name, str):
            continue
        if name in seen:
            path = ("models", i, "name")
            found.append(ConfigIssue(format_path(path), f"duplicate model name {name!r} (also models[{seen[name]}])", lines.line(path)))
        else:
            seen[name] = i
    return found


class _TooLarge(Exception):
    pass


def _shape_problem(data: Any) -> str | None:
    """Why the loaded YAML is unsafe to walk, or None: an alias that contains itself, nesting
    deeper than MAX_CONFIG_DEPTH, or more than MAX_CONFIG_NODES values once aliases are expanded
    (a "billion laughs" document is a few lines that expand to 10**9 values)."""
    seen: dict[int, tuple[int, int]] = {}  # id -> (expanded size, height), for nodes shared by aliases
    active: set[int] = set()

    def walk(node: Any, depth: int) -> tuple[int, int]:
        if not isinstance(node, (dict, list)):
            return 1, 0
        key = id(node)
        if key in active:
            raise _TooLarge("a YAML alias contains itself (a recursive structure)")
        if key in seen:
            size, height = seen[key]
        else:
            if depth > MAX_CONFIG_DEPTH:
                raise _TooLarge(f"nested deeper than {MAX_CONFIG_DEPTH} levels")
            active.add(key)
            size, height = 1, 0
            for child in (*node.keys(), *node.values()) if isinstance(node, dict) else node:
                child_size, child_height = walk(child, depth + 1)
                size, height = size + child_size, max(height, child_height + 1)
                if size > MAX_CONFIG_NODES:
                    raise _TooLarge(f"more than {MAX_CONFIG_NODES} values once YAML aliases are expanded")
            active.discard(key)
            seen[key] = (size, height)
        if depth + height > MAX_CONFIG_DEPTH:
            raise _TooLarge(f"nested deeper than {MAX_CONFIG_DEPTH} levels")
        return size, height

    try:
        walk(data, 0)
    except _TooLarge as exc:
        return f"config rejected: {exc}"
    return None


def parse_config(text: str, source: str = "<config>", base_dir: str | None = None) -> Pipeline:
    """Validate config text; raises ConfigError with every issue."""
    lines = _Lines(text)
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(source, [ConfigIssue("", "YAML error: nested too deeply to parse", None)]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        message = f"YAML error: {problem}" + (f" ({context})" if context else "")
        raise ConfigError(source, [ConfigIssue("", message, line)]) from exc
    if not isinstance(data, dict):
        raise ConfigError(source, [ConfigIssue("", f"expected a mapping at the top level, got {type(data).__name__}", 1)])
    shape_problem = _shape_problem(data)
    if shape_problem:
        raise ConfigError(source, [ConfigIssue("", shape_problem, None)])
    issues: list[ConfigIssue] = []
    if "version" in data and (type(data["version"]) is not int or data["version"] != CONFIG_VERSION):
        issues.append(ConfigIssue("version", f"unsupported config version {data['version']!r}; this pt2flow reads version {CONFIG_VERSION}", lines.line(("version",))))
        raise ConfigError(source, issues)
    parsed_inputs = _parse_all_inputs(data, lines, issues)
    try:
        config = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        # schema errors stop the deeper checks, but duplicate names are still worth reporting now
        raise ConfigError(source, _pydantic_issues(exc, (), lines) + issues + _duplicate_names(data, lines)) from None

    folder = os.path.abspath(base_dir or ".")
    storage_options = _expand_env(config.storage_options, ("storage_options",), issues, lines)
    for problem in check_stage_list(config.stages):
        issues.append(ConfigIssue("stages", problem, lines.line(("stages",))))

    defaults = config.defaults.model_dump(by_alias=True)
    default_limits = defaults.pop("limits")
    before_defaults = len(issues)
    for stage, values in defaults.items():
        try:
            OPTIONS[stage](**values)
        except ValidationError as exc:
            issues.extend(_pydantic_issues(exc, ("defaults", stage), lines))
    defaults_valid = len(issues) == before_defaults

    issues.extend(_duplicate_names(data, lines))
    resolved = []
    for i, model in enumerate(config.models):
        # with broken defaults, per-model option errors would only repeat the defaults' errors
        r = _check_model(i, model, parsed_inputs.get(i), defaults, folder, lines, issues, check_options=defaults_valid)
        if r is not None:
            resolved.append(replace(r, limits=resolve_limits(default_limits, model.limits)))
    if issues:
        raise ConfigError(source, issues)
    return Pipeline(
        path=source,
        store=config.store,
        storage_options=storage_options,
        stages=tuple(config.stages),
        models=tuple(resolved),
        raw=data,
    )


def load_config(path: str | os.PathLike[str]) -> Pipeline:
    """Read and validate a config file (factories and relative weights paths resolve against its folder)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), [ConfigIssue("", f"cannot read the config file: {exc.strerror or exc}")]) from exc
    pipeline = parse_config(text, source=str(path), base_dir=str(p.resolve().parent))
    return pipeline


def resolve_store_url(store: str) -> str:
    """A relative local store path is taken relative to the current directory (like any CLI path)."""
    if "://" in store:
        return store
    return os.path.abspath(store)


def apply_overrides(pipeline: Pipeline, *, only: Sequence[str] = (), stages: Sequence[str] | None = None) -> Pipeline:
    """`--only NAME` and `--stages a,b` applied; unknown names raise ConfigError."""
    issues = []
    models = pipeline.models
    if only:
        known = {m.name for m in models}
        missing = [n for n in only if n not in known]
        if missing:
            issues.append(ConfigIssue("--only", f"no model named {missing} in the config (models: {sorted(known)})"))
        models = tuple(m for m in models if m.name in set(only))
    chosen = pipeline.stages
    if stages is not None:
        for problem in check_stage_list(stages):
            issues.append(ConfigIssue("--stages", problem))
        chosen = tuple(stages)
    if issues:
        raise ConfigError(pipeline.path, issues)
    return Pipeline(pipeline.path, pipeline.store, pipeline.storage_options, chosen, models, pipeline.raw)
