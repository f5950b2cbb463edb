"""The semantic checks that follow the schema pass (docs/architecture.md §3): what pydantic
cannot see. A model's name, its factory references, weights and example-input sources, its
dynamic dims against its inputs, its stage options merged over the defaults; and a stage
selection (the config's `stages`, or `--stages`).

Problems are added to the caller's list of ConfigIssues, so that the loader reports them all
at once; a model with none comes back as a ResolvedModel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from pydantic import BaseModel, ValidationError

from pt2flow.flows.config.factories import factory_problem
from pt2flow.flows.config.inputs import DATA_FILE_SUFFIXES, INPUT_FILE_SUFFIXES, check_dims_named, check_dynamic
from pt2flow.flows.config.issues import ConfigIssue, YamlLines, did_you_mean, pydantic_issues
from pt2flow.flows.config.limits import Limits
from pt2flow.flows.config.models import NAME_PATTERN
from pt2flow.flows.config.models import DataConfig, ModelConfig, ResolvedModel
from pt2flow.flows import pipeline
from pt2flow.storage.urls import holds_credentials
from pt2flow.stages.options import ValidateOptions

WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")

Add = Callable[[tuple[Any, ...], str], None]  # (key path inside the model, message)


def check_stage_list(stages: Sequence[str]) -> list[str]:
    """Problems with a stage selection: unknown names, order, duplicates, missing prerequisites
    (flows/pipeline derives them from the stages' declared inputs)."""
    problems = pipeline.check_stage_list(stages)
    broken = pipeline.plugin_problems()
    if broken and any(p.startswith("unknown stage") for p in problems):
        problems += broken  # the stage may be one a plugin failed to declare
    return problems


def missing_extras(stages: Sequence[str]) -> list[str]:
    """A selected stage whose libraries are not installed: which extra to install."""
    problems = []
    known = set(pipeline.names())
    for stage, (extra, absent) in pipeline.missing_libraries([s for s in stages if s in known]).items():
        install = f"pip install 'pt2flow[{extra}]'" if extra else f"pip install {' '.join(absent)}"
        problems.append(f"the {stage} stage needs {', '.join(absent)}, which is not installed here: {install}")
    return problems


def check_model(
    index: int,
    model: ModelConfig,
    inputs: dict[str, Any] | None,
    defaults: Mapping[str, dict[str, Any]],
    search_path: str,
    lines: YamlLines,
    issues: list[ConfigIssue],
    check_options: bool = True,
    dropped: frozenset[str] = frozenset(),
) -> ResolvedModel | None:
    """`models[index]` checked: its problems are added to `issues` (None is returned then), else
    its resolved form. `inputs`: its parsed input trees (flows.config.inputs.parse_inputs; None
    where they are broken); `check_options=False` skips the stage options (broken defaults).
    `dropped`: keys the schema refused (reported already): the checks that read them are skipped
    rather than misled by their absence, and the model is not resolved."""
    base = ("models", index)
    before = len(issues)

    def add(path: tuple[Any, ...], message: str) -> None:
        issues.append(lines.issue(base + path, message))

    def add_schema(exc: ValidationError, stage: str) -> None:
        issues.extend(pydantic_issues(exc, base + ("stages", stage), lines))

    _check_identity(model, search_path, add)
    dynamic: dict[str, Any] = {}
    if not dropped & _INPUT_KEYS:
        _check_input_sources(model, search_path, add)
    if not dropped & {*_INPUT_KEYS, "dynamic_shapes", "dims"}:
        dynamic = _check_dynamic_shapes(model, inputs, add)
    options = _stage_options(model, defaults, check_options and "stages" not in dropped, add, add_schema)
    checker = pipeline.configured_by(ValidateOptions)
    validate_options = options.get(checker)
    if validate_options is not None and dynamic and validate_options.samples < 3:  # type: ignore[attr-defined]
        add(("stages", checker, "samples"), "must be >= 3 for a model with dynamic dims (example, min and max)")
    if model.generate is not None:
        _check_generate(model, add)
    if len(issues) != before or dropped:
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
        checkpoint=model.checkpoint,
        depends_on=tuple(model.depends_on),
        generate=model.generate,
        data=model.data,
    )


def _check_generate(model: ModelConfig, add: Add) -> None:
    """`generate:`: prompts of at least one token; a static cache holds the longest prompt and
    every new token; the prompts are pt2flow's, so no example inputs or dynamic shapes."""
    from pt2flow.flows.config.models import CAPTURE_PROMPT_LEN

    generate = model.generate
    assert generate is not None
    for i, length in enumerate(generate.prompt_lens):
        if length < 1:
            add(("generate", "prompt_lens", i), f"a prompt has at least 1 token, not {length}")
    longest = max(max(generate.prompt_lens), CAPTURE_PROMPT_LEN)
    if generate.cache == "static" and generate.max_cache_len < longest + generate.max_new_tokens:
        add(
            ("generate", "max_cache_len"),
            f"{generate.max_cache_len} cannot hold the longest prompt ({longest}) and max_new_tokens ({generate.max_new_tokens})",
        )
    for key in ("inputs", "inputs_factory", "inputs_file", "dynamic_shapes", "dims"):
        if getattr(model, key):
            add((key,), f"a model with generate: takes its prompts from generate.prompt_lens, not {key}")
    if model.weights is None and model.checkpoint is None:
        pass  # a factory may build a random-config model: fine


_INPUT_KEYS = frozenset({"inputs", "inputs_factory", "inputs_file"})


def require_problems(require: Sequence[str] | None, stages: Sequence[str] | None) -> list[tuple[str, tuple[Any, ...]]]:
    """What is wrong with a `require:` list, each with its path below the key: a name that is no
    validated artifact kind, or (given the config's stage list) one whose stage does not run."""
    if require is None:
        return []
    kinds = pipeline.document_slots()  # the artifacts validate judges: kind -> stage
    problems: list[tuple[str, tuple[Any, ...]]] = []
    for i, kind in enumerate(require):
        if kind not in kinds:
            problems.append(
                (
                    f"unknown artifact kind {kind!r}: require names the artifacts that must validate, of {list(kinds)}",
                    (i,),
                )
            )
        elif stages is not None and kinds[kind] not in stages:
            problems.append((f"{kind} is required, but its stage {kinds[kind]} is not in `stages`", (i,)))
    return problems


def partial_model(model: ModelConfig, inputs: dict[str, Any] | None, search_path: str, limits: Limits) -> ResolvedModel:
    """A model resolved as far as needs no check to pass (no stage options, no dynamic shapes):
    what `pt2flow validate` checks files and code with when the config has problems too."""
    return ResolvedModel(
        name=model.name,
        factory=model.factory,
        kwargs=dict(model.kwargs),
        weights=model.weights,
        inputs=dict(inputs or {}),
        dynamic_shapes={},
        dims={},
        options={},
        search_path=search_path,
        inputs_factory=model.inputs_factory,
        inputs_file=model.inputs_file,
        limits=limits,
    )


def _plain_name(location: str) -> str:
    """A file name or URL without its query, lower-cased: what its suffix is read from."""
    return location.split("?", 1)[0].lower()


def _input_sources(model: ModelConfig) -> list[str]:
    """Which of the three ways to give example inputs the model uses."""
    return [k for k in ("inputs", "inputs_factory", "inputs_file") if getattr(model, k) is not None]


def _check_identity(model: ModelConfig, search_path: str, add: Add) -> None:
    """The name, the factory references and the weights."""
    if not NAME_PATTERN.fullmatch(model.name) or model.name in (".", "..") or ".." in model.name:
        add(("name",), f"{model.name!r} is not a valid model name: use 1-128 of [A-Za-z0-9._-], no '..'")
    for key in ("factory", "inputs_factory"):
        value = getattr(model, key)
        problem = factory_problem(value, search_path) if value is not None else None
        if problem:
            add((key,), problem)
    if model.data is not None:
        for at, problem in data_problems(model.data, search_path):
            add(("data", *at), problem)
    if model.weights is not None:
        if not _plain_name(model.weights).endswith(WEIGHT_SUFFIXES):
            add(("weights",), f"weights must be a state_dict file ending in one of {list(WEIGHT_SUFFIXES)}")
        if holds_credentials(model.weights):
            add(
                ("weights",),
                "the weights URL holds credentials, which would be stored in the index and Prefect's parameters; use storage_options or the environment",
            )
    if model.checkpoint is not None and "://" in model.checkpoint:
        add(
            ("checkpoint",),
            "checkpoint must be a local folder (a URL is not supported yet: copy the folder next to the config)",
        )
    for i, pattern in enumerate(model.depends_on):
        if "://" in pattern:
            add(("depends_on", i), "depends_on names local files, folders or globs, not URLs")


def data_problems(data: DataConfig, search_path: str) -> list[tuple[tuple[str, ...], str]]:
    """Why `data:` (a model's or the defaults') is unusable, each at its key inside `data`: not
    exactly one of factory and file, a factory that does not resolve, a file of another kind, a
    URL with credentials, a local file that is not there (resolved from the config's folder)."""
    if (data.factory is None) == (data.file is None):
        return [
            (
                (),
                "give the data one way: factory (module:callable giving batches) or file "
                f"(a file of batches ending in one of {list(DATA_FILE_SUFFIXES)}), exactly one",
            )
        ]
    if data.factory is not None:
        problem = factory_problem(data.factory, search_path)
        return [(("factory",), problem)] if problem else []
    file = str(data.file)
    problem = _named_file_problem(
        file,
        DATA_FILE_SUFFIXES,
        f"data.file must end in one of {list(DATA_FILE_SUFFIXES)}: {file}",
        "data.file",
        search_path,
    )
    return [(("file",), problem)] if problem else []


def _named_file_problem(
    file: str, suffixes: tuple[str, ...], wrong_kind: str, key: str, search_path: str
) -> str | None:
    """Why a file a config names (inputs_file, data.file) is unusable: another kind of file
    (`wrong_kind`), a URL holding credentials, a local file that is not there (resolved from the
    config's folder); None when it is usable."""
    if not _plain_name(file).endswith(suffixes):
        return wrong_kind
    if holds_credentials(file):
        return f"the {key} URL holds credentials; use storage_options or the environment"
    if "://" not in file and not (Path(search_path) / file).is_file():
        return f"file not found: {Path(search_path) / file}"
    return None


def _check_input_sources(model: ModelConfig, search_path: str, add: Add) -> None:
    """One way of giving example inputs, and a usable inputs_file."""
    sources = _input_sources(model)
    if len(sources) > 1:
        add((sources[1],), f"give the example inputs one way: {' or '.join(sources)}, not both")
    if model.inputs_file is not None:
        wrong_kind = f"inputs_file must be a .safetensors file or a torch.save file ending in one of {list(INPUT_FILE_SUFFIXES[1:])}"
        if problem := _named_file_problem(
            model.inputs_file, INPUT_FILE_SUFFIXES, wrong_kind, "inputs_file", search_path
        ):
            add(("inputs_file",), problem)


def _check_dynamic_shapes(model: ModelConfig, inputs: dict[str, Any] | None, add: Add) -> dict[str, Any]:
    """The dims tree of each argument, checked against its input where the config gives the
    inputs (else only for its dim names), and the dims' ranges."""
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
    elif _input_sources(model):
        for arg, per_arg in model.dynamic_shapes.items():
            checked = check_dims_named(per_arg, ("dynamic_shapes", arg), model.dims, add)
            if checked is not None:
                dynamic[arg] = checked
    elif model.generate is None:  # a generative model's prompts come from generate.prompt_lens
        add(("inputs",), "required key is missing")
    for dim_name, spec in model.dims.items():
        if spec.min > spec.max:
            add(("dims", dim_name), f"min {spec.min} is greater than max {spec.max}")
    return dynamic


def _stage_options(
    model: ModelConfig,
    defaults: Mapping[str, dict[str, Any]],
    check_options: bool,
    add: Add,
    add_schema: Callable[[ValidationError, str], None],
) -> dict[str, BaseModel]:
    """Each stage's options model: the model's overrides merged over the defaults, validated."""
    options: dict[str, BaseModel] = {}
    known = pipeline.names()
    for stage in model.stages:
        if stage not in known:
            add(
                ("stages", stage),
                f"unknown stage {stage!r}; per-model overrides are for {list(known)}{did_you_mean(stage, known)}",
            )
    checker = pipeline.configured_by(ValidateOptions)
    if model.accuracy is not None and "accuracy" in model.stages.get(checker, {}):
        add(("accuracy",), f"the budget is given twice: here and at stages.{checker}.accuracy (keep one)")
    for spec in pipeline.stages() if check_options else ():
        merged = {**defaults.get(spec.name, {}), **model.stages.get(spec.name, {})}
        if spec.name == checker and model.accuracy is not None:  # DESIGN §3's name for validate.accuracy
            merged["accuracy"] = {metric: bound.model_dump() for metric, bound in model.accuracy.items()}
        try:
            options[spec.name] = spec.options(**merged)
        except ValidationError as exc:
            add_schema(exc, spec.name)
    return options
