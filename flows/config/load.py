"""Reading a config (docs/architecture.md §3): `load_config(path)` and `parse_config(text)`.

YAML is read with yaml.safe_load semantics and refused before anything walks it when it is too
deep or too large once aliases are expanded; then come the schema (flows.config.models, with
pydantic), the semantic checks (flows.config.checks) and ${ENV} expansion in storage_options.
ConfigError lists every problem at once, each with the file, line, the path of the offending
key and what was expected. Nothing is imported or run: factories are resolved statically
(flows.config.factories). Every path a config names (store, factories' folder, weights, inputs
files) is taken relative to the config file's folder, never the current one: one config, one
store, wherever it is run from. Also here: what the CLI changes afterwards (`apply_overrides`).
The text before the schema (safe YAML, ${ENV}, the store alone) is flows/config/reading.py's.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Mapping, Sequence

from pydantic import ValidationError

from pt2flow.flows.config.checks import check_model, check_stage_list, missing_extras
from pt2flow.flows.config.inputs import parse_inputs
from pt2flow.flows.config.issues import ConfigError, ConfigIssue, YamlLines, pydantic_issues
from pt2flow.flows.config.limits import resolve_limits
from pt2flow.flows.config.models import CONFIG_VERSION, Pipeline, config_model
from pt2flow.flows.config.reading import (  # noqa: F401  (MAX_*, read_store_settings: re-exported)
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_NODES,
    expand_env,
    read_config_file,
    read_store_settings,
    resolve_store_url,
    safe_yaml,
)
from pt2flow.flows.pipeline import get as get_stage


def load_config(path: str | os.PathLike[str]) -> Pipeline:
    """Read and validate a config file (its store, factories, weights and inputs files resolve
    against its folder)."""
    text, folder = read_config_file(path)
    return parse_config(text, source=str(path), base_dir=folder)


def parse_config(text: str, source: str = "<config>", base_dir: str | None = None) -> Pipeline:
    """Validate config text; raises ConfigError with every issue."""
    lines = YamlLines(text)
    data = safe_yaml(text, source)
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
    storage_options = expand_env(config.storage_options, ("storage_options",), issues, lines)
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
        store=config.store if base_dir is None else resolve_store_url(config.store, folder),
        storage_options=storage_options,
        stages=tuple(config.stages),
        models=tuple(resolved),
        raw=data,
        retention=config.retention,
        dask=config.dask,
        python=_python_path(config.python, folder),
    )


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
    return replace(pipeline, stages=chosen, models=models)


def _python_path(python: str | None, folder: str) -> str | None:
    """The config's `python:`: a path (it has a separator) resolves against the config's folder;
    a bare name (python3.11) is looked up on PATH when the run starts."""
    if python is None or os.sep not in python and "/" not in python:
        return python
    return os.path.normpath(os.path.join(folder, os.path.expanduser(python)))


# ---------------------------------------------------------------------------------------------
# the YAML, before the schema sees it


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
