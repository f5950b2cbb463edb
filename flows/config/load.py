"""Reading a config (docs/architecture.md §3): `load_config(path)` and `parse_config(text)`.

YAML is read with yaml.safe_load semantics and refused before anything walks it when it is too
deep or too large once aliases are expanded; then come the schema (flows.config.models, with
pydantic), the semantic checks (flows.config.checks) and ${ENV} expansion in storage_options.
ConfigError lists every problem at once, each with the file, line, the path of the offending
key and what was expected. Nothing is imported or run: factories are resolved statically
(flows.config.factories). Also here: what the CLI changes afterwards (`apply_overrides`,
`resolve_store_url`).
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml
from pydantic import ValidationError

from pt2flow.flows.config.checks import check_model, check_stage_list, missing_extras
from pt2flow.flows.config.inputs import parse_inputs
from pt2flow.flows.config.issues import ConfigError, ConfigIssue, YamlLines, pydantic_issues
from pt2flow.flows.config.limits import resolve_limits
from pt2flow.flows.config.models import CONFIG_VERSION, Pipeline, config_model
from pt2flow.flows.pipeline import get as get_stage

# A config is walked recursively (pydantic, ${ENV} expansion, canonical JSON of kwargs): bound it.
MAX_CONFIG_DEPTH = 100
MAX_CONFIG_NODES = 1_000_000
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def load_config(path: str | os.PathLike[str]) -> Pipeline:
    """Read and validate a config file (factories and relative weights paths resolve against its folder)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), [ConfigIssue("", f"cannot read the config file: {exc.strerror or exc}")]) from exc
    pipeline = parse_config(text, source=str(path), base_dir=str(p.resolve().parent))
    return pipeline


def parse_config(text: str, source: str = "<config>", base_dir: str | None = None) -> Pipeline:
    """Validate config text; raises ConfigError with every issue."""
    lines = YamlLines(text)
    data = _safe_yaml(text, source)
    if "version" in data and (type(data["version"]) is not int or data["version"] != CONFIG_VERSION):
        issue = lines.issue(("version",), f"unsupported config version {data['version']!r}; this pt2flow reads version {CONFIG_VERSION}")
        raise ConfigError(source, [issue])
    issues: list[ConfigIssue] = []
    parsed_inputs = _parse_all_inputs(data, lines, issues)
    try:
        config = config_model().model_validate(data)
    except ValidationError as exc:
        # schema errors stop the deeper checks, but duplicate names are still worth reporting now
        raise ConfigError(source, pydantic_issues(exc, (), lines) + issues + _duplicate_names(data, lines)) from None

    folder = os.path.abspath(base_dir or ".")
    storage_options = _expand_env(config.storage_options, ("storage_options",), issues, lines)
    for problem in check_stage_list(config.stages):
        issues.append(lines.issue(("stages",), problem))
    for problem in missing_extras(config.stages):
        issues.append(lines.issue(("stages",), problem))
    defaults = config.defaults.model_dump(by_alias=True)
    default_limits = defaults.pop("limits")
    defaults_valid = _check_defaults(defaults, lines, issues)

    issues.extend(_duplicate_names(data, lines))
    resolved = []
    for i, model in enumerate(config.models):
        # with broken defaults, per-model option errors would only repeat the defaults' errors
        r = check_model(i, model, parsed_inputs.get(i), defaults, folder, lines, issues, check_options=defaults_valid)
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
        retention=config.retention,
        dask=config.dask,
    )


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
        for problem in [*check_stage_list(stages), *missing_extras(stages)]:
            issues.append(ConfigIssue("--stages", problem))
        chosen = tuple(stages)
    if issues:
        raise ConfigError(pipeline.path, issues)
    return Pipeline(pipeline.path, pipeline.store, pipeline.storage_options, chosen, models, pipeline.raw, retention=pipeline.retention, dask=pipeline.dask)


# ---------------------------------------------------------------------------------------------
# the YAML, before the schema sees it


def _safe_yaml(text: str, source: str) -> dict[str, Any]:
    """The YAML document as a mapping that is safe to walk; raises ConfigError otherwise."""
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
    return data


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


def _parse_all_inputs(data: Mapping[str, Any], lines: YamlLines, issues: list[ConfigIssue]) -> dict[int, dict[str, Any] | None]:
    """parse_inputs for every model, before the schema pass, so that input problems are
    reported together with schema problems."""
    def add(path: tuple[Any, ...], message: str) -> None:
        issues.append(lines.issue(path, message))

    def add_schema(exc: ValidationError, path: tuple[Any, ...]) -> None:
        issues.extend(pydantic_issues(exc, path, lines))

    models = data.get("models")
    parsed: dict[int, dict[str, Any] | None] = {}
    for i, model in enumerate(models if isinstance(models, list) else []):
        if isinstance(model, dict):
            parsed[i] = parse_inputs(model.get("inputs"), ("models", i, "inputs"), add, add_schema)
    return parsed


def _duplicate_names(data: Mapping[str, Any], lines: YamlLines) -> list[ConfigIssue]:
    """One issue per repeated `models[*].name`, read from the raw YAML data."""
    found: list[ConfigIssue] = []
    seen: dict[str, int] = {}
    models = data.get("models")
    for i, model in enumerate(models if isinstance(models, list) else []):
        name = model.get("name") if isinstance(model, dict) else None
        if not isinstance(name, str):
            continue
        if name in seen:
            found.append(lines.issue(("models", i, "name"), f"duplicate model name {name!r} (also models[{seen[name]}])"))
        else:
            seen[name] = i
    return found


# ---------------------------------------------------------------------------------------------
# after the schema: defaults and ${ENV}


def _check_defaults(defaults: Mapping[str, dict[str, Any]], lines: YamlLines, issues: list[ConfigIssue]) -> bool:
    """Each stage's default options validated on their own; whether they all are valid."""
    before = len(issues)
    for stage, values in defaults.items():
        try:
            get_stage(stage).options(**values)
        except ValidationError as exc:
            issues.extend(pydantic_issues(exc, ("defaults", stage), lines))
    return len(issues) == before


def _expand_env(value: Any, path: tuple[Any, ...], issues: list[ConfigIssue], lines: YamlLines) -> Any:
    if isinstance(value, str):
        def repl(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in os.environ:
                issues.append(lines.issue(path, f"environment variable ${{{name}}} is not set"))
                return ""
            return os.environ[name]

        return _ENV_REF.sub(repl, value)
    if isinstance(value, dict):
        return {k: _expand_env(v, path + (k,), issues, lines) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, path + (i,), issues, lines) for i, v in enumerate(value)]
    return value
