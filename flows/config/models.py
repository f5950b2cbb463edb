"""The config document (schema version 1, docs/architecture.md §3) in two forms.

- What a YAML file may say: the pydantic models PipelineConfig, ModelConfig, StageDefaults and
  DimConfig (unknown keys are errors). Checked further by flows.config.load and
  flows.config.checks.
- What the flows get once it is checked: Pipeline, with one ResolvedModel per model (stage
  options merged over the defaults and validated, limits resolved).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Literal
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, create_model

from pt2flow.flows import pipeline
from pt2flow.flows.config.limits import DaskConfig, Limits, LimitsConfig
from pt2flow.flows.config.retention import RetentionConfig
from pt2flow.flows.config.reading import DEFAULT_STORE
from pt2flow.stages.options import AccuracyMetric, Bound

# a model's name: the config checks it (flows/config/checks.py), the JSON Schema states it
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

CONFIG_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DimConfig(_Strict):
    min: int = Field(ge=1)
    max: int = Field(ge=1, le=2**31 - 1)


class DataConfig(_Strict):
    """`data:`: the model's own data, one of two ways (flows.config.checks data_problems).
    `factory` is a `module:callable` (resolved from the config's folder, like `factory`) called
    with no arguments and giving an iterable of batches, each as an inputs factory gives the
    example inputs: a dict of forward() arguments by name, or (args, kwargs). `file` is a file of
    batches (stages.source.load_data_batches: .npz or .safetensors arrays by argument name, batch
    index first; a torch.save list of batches), resolved from the config's folder or a URL. The
    first `calibration` batches calibrate the int8 stages; the `evaluation` batches after them,
    which nothing calibrated on, are what validate and check-compat measure the int8 artifacts'
    accuracy on (every candidate runs on them too). The file's sha256, or the factory's module
    source and the files it reads while it gives them, are part of the model's source identity
    (docs/architecture.md §2, "int8")."""

    factory: str | None = None
    file: str | None = None
    calibration: int = Field(default=8, ge=1, le=1024)
    evaluation: int = Field(default=0, ge=0, le=1024)


class StageDefaults(_Strict):
    """`defaults`: limits, and one section of options per registered stage (config_model adds
    them: the stages come from flows/pipeline, so a registered stage gets its section too)."""

    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    require: list[str] | None = None  # the artifact kinds that must validate (None: every one built)
    # every model's data where it names none of its own (a generative model's never: it has prompts)
    data: DataConfig | None = None
    # every model's accuracy budgets where it sets none: the same as validate.accuracy in defaults
    accuracy: dict[AccuracyMetric, Bound] | None = None


class GenerateConfig(_Strict):
    """`generate:`: the model is a generative one, exported as components (prefill, decode) and
    validated by greedy generation against eager `generate()` (docs/architecture.md, "Generative
    models"). The prompts are pt2flow's: fixed pseudo-random token ids of each length in
    `prompt_lens` (no `inputs` needed)."""

    prompt_lens: list[int] = Field(default_factory=lambda: [2, 16], min_length=1)
    max_new_tokens: int = Field(default=32, ge=1)
    cache: Literal["static", "dynamic"] = "static"
    max_cache_len: int = Field(default=128, ge=2)
    multi_token_decode: bool = False


# the components of a generative model, in call order (stages/generation.py COMPONENTS; torch-free
# here): a decoder-only model's, and an encoder-decoder's (its encoder first: every component name)
COMPONENTS = ("prefill", "decode")
ENCODER_DECODER_COMPONENTS = ("encoder", "prefill", "decode")


def components_of(source_details: Mapping[str, Any] | None) -> tuple[str, ...]:
    """A generative model's components in call order, as its source stage recorded them from the
    built model (`components`: stages.generation.component_names); none recorded (the model did
    not build): a decoder-only model's."""
    recorded = (source_details or {}).get("components")
    return tuple(recorded) if recorded else COMPONENTS


# the prompt length the components are captured at (stages/generation.py: the prompt axis is dynamic)
CAPTURE_PROMPT_LEN = 8


class ModelConfig(_Strict):
    name: str
    factory: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    weights: str | None = None
    # a folder (save_pretrained's: config.json, model.safetensors, ...) hashed as a tree and part
    # of the key; the factory is called with it (a class with from_pretrained: Class.from_pretrained(folder))
    checkpoint: str | None = None
    # files, folders or globs the model's construction reads that pt2flow cannot see: part of the key
    depends_on: list[str] = Field(default_factory=list)
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
    # the artifact kinds (`get --artifact` names) that must validate for the model to be ok; the
    # others failing make it `partial`. None: the defaults' (every artifact built)
    require: list[str] | None = None
    # a generative model: its components go through the stages, validation is by generation
    generate: GenerateConfig | None = None
    # the model's own calibration data (the int8 stages'); unset: batches drawn from its inputs spec
    data: DataConfig | None = None
    # the accuracy budgets of its artifacts not meant to be exact (DESIGN §3's `accuracy:`): the
    # same as stages.validate.accuracy, which it fills (flows/config/checks.py _stage_options)
    accuracy: dict[AccuracyMetric, Bound] | None = None


class PipelineConfig(_Strict):
    version: Literal[1]
    store: str = DEFAULT_STORE
    storage_options: dict[str, Any] = Field(default_factory=dict)
    stages: list[str] = Field(default_factory=lambda: list(pipeline.default_stages()))
    defaults: StageDefaults = Field(default_factory=StageDefaults)
    models: list[ModelConfig] = Field(min_length=1)
    retention: RetentionConfig | None = None  # what `pt2flow serve` keeps after each run
    dask: DaskConfig = Field(default_factory=DaskConfig)
    # the interpreter (or virtualenv folder) the workers run in; `run --python` overrides it
    python: str | None = None


def config_model() -> type[PipelineConfig]:
    """PipelineConfig with a `defaults` section per registered stage (made once per set of stages)."""
    return _config_model(pipeline.names())


@functools.lru_cache(maxsize=8)
def _config_model(stages: tuple[str, ...]) -> type[PipelineConfig]:
    # fields are named s_<stage> with the stage's name as alias: a stage may be called `validate`
    sections: dict[str, Any] = {
        f"s_{name}": (dict[str, Any], Field(default_factory=dict, alias=name)) for name in stages
    }
    defaults = create_model("StageDefaults", __base__=StageDefaults, **sections)
    return create_model("PipelineConfig", __base__=PipelineConfig, defaults=(defaults, Field(default_factory=defaults)))


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
    checkpoint: str | None = None  # as the config names it (resolved against search_path when used)
    depends_on: tuple[str, ...] = ()  # as the config names them
    require: tuple[str, ...] | None = None  # artifact kinds that must validate; None: every one built
    generate: GenerateConfig | None = None  # a generative model (its components go through the stages)
    data: DataConfig | None = None  # its own calibration data (the int8 stages')
    # set on a component-scoped model (`M/decode`): which component of the parent `parent` it is
    component: str | None = None
    parent: str | None = None

    def of_component(self, component: str) -> ResolvedModel:
        """The component-scoped model `M/component`: keyed, cached and recorded under that name
        ('/' is no character of a configured name, so it cannot collide)."""
        from dataclasses import replace

        return replace(self, name=f"{self.name}/{component}", component=component, parent=self.name)

    def tolerates_failure(self, stage: str) -> bool:
        """Whether the model goes on when `stage` fails: the stage builds an artifact validate
        judges, and the model's `require:` (given) leaves that artifact out. The model is then
        `partial` (docs/architecture.md §6)."""
        if self.require is None:
            return False
        kind = pipeline.get(stage).artifact
        return kind is not None and kind in pipeline.document_slots() and kind not in self.require

    @property
    def training(self) -> bool:
        from pt2flow.stages.options import FunctionalizeOptions

        return self.options[pipeline.configured_by(FunctionalizeOptions)].mode == "training"  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Pipeline:
    path: str
    store: str
    storage_options: Mapping[str, Any] = field(repr=False)  # may hold credentials
    stages: tuple[str, ...] = ()
    models: tuple[ResolvedModel, ...] = ()
    raw: Mapping[str, Any] = field(repr=False, default_factory=dict)
    retention: RetentionConfig | None = None
    dask: DaskConfig = field(default_factory=DaskConfig)
    python: str | None = None  # resolved against the config's folder when it is a path

    def model(self, name: str) -> ResolvedModel:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)
