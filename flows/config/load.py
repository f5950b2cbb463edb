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
from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import Mapping, Sequence

from pydantic import ValidationError

from pt2flow.flows.config.checks import (
    check_model,
    check_stage_list,
    data_problems,
    missing_extras,
    partial_model,
    require_problems,
)
from pt2flow.flows.config.inputs import parse_inputs
from pt2flow.flows.config.issues import ConfigError, ConfigIssue, YamlLines, pydantic_issues
from pt2flow.flows.config.limits import resolve_limits
from pt2flow.flows.config.models import (
    CONFIG_VERSION,
    ModelConfig,
    Pipeline,
    PipelineConfig,
    ResolvedModel,
    config_model,
)
from pt2flow.flows.config.reading import (  # noqa: F401  (MAX_*, read_store_settings: re-exported)
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_NODES,
    expand_env,
    read_config_file,
    read_store_settings,
    resolve_store_url,
    safe_yaml,
)
from pt2flow.flows.pipeline import configured_by
from pt2flow.flows.pipeline import get as get_stage
from pt2flow.stages.options import UNION_TAGS, ValidateOptions


def load_config(path: str | os.PathLike[str]) -> Pipeline:
    """Read and validate a config file (its store, factories, weights and inputs files resolve
    against its folder)."""
    text, folder = read_config_file(path)
    return parse_config(text, source=str(path), base_dir=folder)


def parse_config(text: str, source: str = "<config>", base_dir: str | None = None) -> Pipeline:
    """Validate config text; raises ConfigError with every issue."""
    checked = check_config_text(text, source, base_dir)
    if checked.pipeline is None:
        raise ConfigError(source, checked.issues)
    return checked.pipeline


@dataclass(frozen=True)
class ConfigCheck:
    """A config checked in one pass: every problem (`issues`), the Pipeline when there is none,
    and `models`: each model (by its position in `models:`) that the schema let through, for the
    checks `pt2flow validate` adds (files, code). A model with problems is there too, resolved
    as far as they allow (no stage options; dims and dynamic shapes only when those are sound)."""

    issues: list[ConfigIssue]
    pipeline: Pipeline | None
    models: dict[int, ResolvedModel] = field(default_factory=dict)


def check_config(path: str | os.PathLike[str]) -> ConfigCheck:
    """check_config_text of a file; a YAML syntax error (or an unreadable file) still raises
    ConfigError at once: nothing else can be read before it is fixed."""
    text, folder = read_config_file(path)
    return check_config_text(text, source=str(path), base_dir=folder)


def check_config_text(text: str, source: str = "<config>", base_dir: str | None = None) -> ConfigCheck:
    """Every problem of a config at once: YAML syntax first (ConfigError: nothing else can be
    read), then the schema and the semantic checks together. Where the schema refuses part of
    the document, that part is left out (a key of a model, a top-level key) and the rest is
    still checked, so a second pass never finds what the first could have."""
    lines = YamlLines(text)
    data = safe_yaml(text, source)
    if "version" in data and (type(data["version"]) is not int or data["version"] != CONFIG_VERSION):
        issue = lines.issue(
            ("version",), f"unsupported config version {data['version']!r}; this pt2flow reads version {CONFIG_VERSION}"
        )
        raise ConfigError(source, [issue])
    issues: list[ConfigIssue] = []
    parsed_inputs = _parse_all_inputs(data, lines, issues)
    folder = os.path.abspath(base_dir or ".")
    try:
        config = config_model().model_validate(data)
        salvaged = _Salvage({}, frozenset(), list(range(len(config.models))))
    except ValidationError as exc:
        # the schema's problems first; then the deeper checks of what the schema let through
        issues[:0] = pydantic_issues(exc, (), lines)
        issues.extend(_duplicate_names(data, lines))
        salvaged_config = _salvage(data, exc)
        if salvaged_config is None:
            return ConfigCheck(issues, None)
        config, salvaged = salvaged_config
        _semantic_checks(config, salvaged, parsed_inputs, folder, lines, issues, data, duplicates=False)
        return ConfigCheck(issues, None, _models_of(config, salvaged, parsed_inputs, folder, issues))
    resolved, storage_options = _semantic_checks(
        config, salvaged, parsed_inputs, folder, lines, issues, data, duplicates=True
    )
    if issues:
        return ConfigCheck(issues, None, _models_of(config, salvaged, parsed_inputs, folder, issues))
    pipeline = Pipeline(
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
    return ConfigCheck([], pipeline, dict(enumerate(resolved)))


@dataclass(frozen=True)
class _Salvage:
    """What the schema refused and was left out: per model position (in the original list) the
    keys dropped from it, the top-level keys dropped (a refused section of `defaults` is dropped
    alone), and the original position of each model kept (config.models[k] is
    models[positions[k]])."""

    dropped: dict[int, frozenset[str]]
    top: frozenset[str]
    positions: list[int]


def _salvage(data: Mapping[str, Any], exc: ValidationError) -> tuple[PipelineConfig, _Salvage] | None:
    """The document without the parts the schema refused, validated: every other check can then
    run on the rest. None when nothing worth checking is left (no usable `models`)."""
    top: set[str] = set()
    sections: set[str] = set()  # of `defaults`: limits, or a stage's
    per_model: dict[int, set[str]] = {}
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if p not in UNION_TAGS)
        if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
            per_model.setdefault(loc[1], set()).add(str(loc[2]) if len(loc) > 2 else "*")
        elif len(loc) >= 2 and loc[0] == "defaults":
            sections.add(str(loc[1]))
        elif loc:
            top.add(str(loc[0]))
    models = data.get("models")
    if "models" in top or not isinstance(models, list):
        return None
    kept, positions = [], []
    for i, model in enumerate(models):
        bad = per_model.get(i, set())
        if "*" in bad or not isinstance(model, dict):
            continue
        stripped = {k: v for k, v in model.items() if str(k) not in bad}
        if "name" in bad:  # reported; a stand-in lets its other keys be checked (the model is never resolved)
            stripped["name"] = f"models-{i}"
        try:
            ModelConfig.model_validate(stripped)
        except ValidationError:  # a required key (name, factory) was refused: nothing to check it by
            continue
        kept.append(stripped)
        positions.append(i)
    if not kept:
        return None
    rest = {k: v for k, v in data.items() if str(k) not in top}
    rest["version"] = CONFIG_VERSION
    if sections and isinstance(data.get("defaults"), dict):
        rest["defaults"] = {k: v for k, v in data["defaults"].items() if str(k) not in sections}
    rest["models"] = kept
    try:
        config = config_model().model_validate(rest)
    except ValidationError:
        return None
    dropped = {i: frozenset(per_model.get(i, ())) for i in positions}
    return config, _Salvage(dropped, frozenset(top), positions)


def _semantic_checks(
    config: PipelineConfig,
    salvaged: _Salvage,
    parsed_inputs: Mapping[int, Any],
    folder: str,
    lines: YamlLines,
    issues: list[ConfigIssue],
    data: Mapping[str, Any],
    *,
    duplicates: bool,
) -> tuple[list[ResolvedModel], dict[str, Any]]:
    """The checks after the schema: ${ENV} in storage_options, stages, defaults, names, each
    model. The models that pass, and the storage options expanded."""
    storage_options = expand_env(config.storage_options, ("storage_options",), issues, lines)
    if "stages" not in salvaged.top:
        for problem in [*check_stage_list(config.stages), *missing_extras(config.stages)]:
            issues.append(lines.issue(("stages",), problem))
    defaults = config.defaults.model_dump(by_alias=True)
    default_limits = defaults.pop("limits")
    default_require = defaults.pop("require")
    defaults.pop("data")
    if (accuracy := defaults.pop("accuracy")) is not None:  # DESIGN §3's name for validate.accuracy
        checker = configured_by(ValidateOptions)
        section = defaults.setdefault(checker, {})
        if section.get("accuracy") is not None:
            issues.append(
                lines.issue(
                    ("defaults", "accuracy"),
                    f"the budget is given twice: here and at defaults.{checker}.accuracy (keep one)",
                )
            )
        else:
            section["accuracy"] = accuracy
    default_data = config.defaults.data
    if default_data is not None:
        for at, problem in data_problems(default_data, folder):
            issues.append(lines.issue(("defaults", "data", *at), problem))
    for problem, at in require_problems(default_require, None if "stages" in salvaged.top else config.stages):
        issues.append(lines.issue(("defaults", "require", *at), problem))
    defaults_valid = "defaults" not in salvaged.top and _check_defaults(defaults, lines, issues)
    if duplicates:
        issues.extend(_duplicate_names(data, lines))
    resolved = []
    stage_list = None if "stages" in salvaged.top else config.stages
    for model, i in zip(config.models, salvaged.positions):
        for problem, at in require_problems(model.require, stage_list):
            issues.append(lines.issue(("models", i, "require", *at), problem))
        # with broken defaults, per-model option errors would only repeat the defaults' errors
        r = check_model(
            i,
            model,
            parsed_inputs.get(i),
            defaults,
            folder,
            lines,
            issues,
            check_options=defaults_valid,
            dropped=salvaged.dropped.get(i, frozenset()),
        )
        if r is not None:
            require = model.require if model.require is not None else default_require
            resolved.append(
                replace(
                    r,
                    limits=resolve_limits(default_limits, model.limits),
                    require=tuple(require) if require is not None else None,
                    # the defaults' data, where the model names none (a generative model has prompts)
                    data=model.data if model.data is not None or model.generate is not None else default_data,
                )
            )
    return resolved, storage_options


def _models_of(
    config: PipelineConfig,
    salvaged: _Salvage,
    parsed_inputs: Mapping[int, Any],
    folder: str,
    issues: Sequence[ConfigIssue],
) -> dict[int, ResolvedModel]:
    """Each model the schema let through, by its position, resolved as far as its problems allow
    (for validate's file and code checks; never run)."""
    default_limits = config.defaults.model_dump(by_alias=True)["limits"] if "defaults" not in salvaged.top else {}
    out = {}
    for model, i in zip(config.models, salvaged.positions):
        out[i] = partial_model(model, parsed_inputs.get(i), folder, resolve_limits(default_limits, model.limits))
    return out


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


def _parse_all_inputs(
    data: Mapping[str, Any], lines: YamlLines, issues: list[ConfigIssue]
) -> dict[int, dict[str, Any] | None]:
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
            found.append(
                lines.issue(("models", i, "name"), f"duplicate model name {name!r} (also models[{seen[name]}])")
            )
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
