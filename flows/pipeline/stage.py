"""A stage is one object: everything pt2flow knows about a stage, declared once.

Planning stays torch-free: the functions that do torch work (compute, the candidate loader, the
compat check, the repro template) and a stage's own key, where it has one, are named by dotted
path ("module:function") and imported only where they run. Order and parents are not written
down anywhere: they follow from each stage's declared inputs (flows/pipeline/registry.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict


# the blobs validate and check-compat load themselves, with the checks they allow (the signature of
# an archive, the mutated buffers of a package); every other candidate runs through its stage's
# loader (Stage.candidate)
LOADED_BY_VALIDATE = ("archive", "package")
# what a benchmark stage publishes (Stage.publishes): its report; its record's details hold the
# report's summary under the same key (the run document, the summary and the views read it there)
TIMINGS = "timings"


class NoOptions(BaseModel):
    """A stage with nothing to configure (its section exists for symmetry and future use)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Input:
    """An artifact a stage consumes, read by its compute function as `inputs[name]`.

    stages: the stages that make it, in order of preference: the first one the run has is used
    (a program consumer takes the newest program: decompose's, else functionalize's, else
    trace's). optional: the stage runs without it (validate compares whichever candidates exist).
    """

    name: str
    stages: tuple[str, ...]
    optional: bool = False

    @classmethod
    def of(cls, stage: str, *, optional: bool = False) -> Input:
        return cls(stage, (stage,), optional)


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline.

    name, version: the version is part of every key, so bump it when the stage's output for
      the same inputs changes (what an older pt2flow built is then rebuilt, never reused);
    compute: "module:function" taking a flows.engine.worker.compute.StageCall and returning its
      Produced; it runs in a worker process (the place torch is imported);
    inputs: the artifacts it consumes (Input); order and parents derive from them;
    options: its pydantic options model (the config section `defaults.<name>` and
      `models[*].stages.<name>`, and its part of the JSON Schema);
    publishes: what its blob is: program, archive, package, report, or a target format;
    artifact: where the run document's `artifacts` and `get --artifact` name its blob
      (None: not a deliverable); suffix: the file name suffix `get` gives it;
    key: "module:function" (stage, model, inputs) -> key, for a stage whose key is not the
      default one (its name and version, its inputs' identities, its options, and the torch,
      Python and library versions: flows/engine/orchestrator/stage_keys.default_key);
    candidate: "module:function" loading its blob into a runner of flat tensor lists (the
      user's tensor inputs in, the output leaves out: stages/targets.FlatRunner), which
      validate runs beside eager on every sample and check-compat on the stored ones; the
      archive and the package (serialize's and aot_compile's) are loaded by validate itself,
      with the signature checks they allow. A loader that also takes `threads` (an int, or
      None for its runtime's default) is timed by the benchmark on the benchmark's thread
      count, and a runner with a `close()` gives back there what loading it changed in the
      process (stages/targets.py TargetArtifact);
    repro: "module:function" giving the body of a torch-only script that makes the same call
      (flows/engine/maintenance/repro.py);
    libraries: the distributions it needs besides torch: their versions are in its key, and a
      config naming it without them installed is a config error naming `extra`;
    default: whether the config's default `stages` list holds it;
    accepts_training: whether it takes the joint forward+backward program of training mode;
    description: what its output is, in a few words (help texts, `ls`);
    position: where it goes among stages the inputs leave unordered (lower first; a plugin's
      default puts it after pt2flow's own);
    rebuild: "module:function" taking a flows.engine.worker.rebuild.RebuildCall and returning the
      fingerprint of its program made again from the recorded inputs: `pt2flow audit` checks the
      records of the stages that have one (a program stage's; the archive's);
    device: "module:function" (model) -> the device its artifact is made for, the records'
      `device` column (None: the CPU, not recorded);
    checks_candidates: it uses every candidate stage's artifact (validate compares them with
      eager, benchmark times them): every candidate registered is an optional input of it;
    step: "module:function" (bytes, stages.generation.StepContext) -> a step function of one
      generative component's artifact (generate()'s forward kwargs in, the model's output out),
      which validate drives token by token against eager generate(); a candidate without one
      is run by stages.generation.flat_step over its `candidate` runner (the component's
      tensor leaves in, by its traced call spec; the output leaves back into the output's
      structure), as ONNX and OpenVINO are;
    exact: whether its artifact is meant to compute what eager does (validate: allclose, or
      tolerance auto); false for an artifact that trades accuracy for speed (int8), which
      validate judges by the model's accuracy budgets instead (stages/accuracy.py);
    quiet: it times the machine (benchmark): it runs while no other stage work of pt2flow runs
      on this machine, and the others wait their turn meanwhile (flows/engine/worker/turns.py).
    """

    name: str
    version: int
    compute: str
    inputs: tuple[Input, ...] = ()
    options: type[BaseModel] = NoOptions
    publishes: str = "program"
    artifact: str | None = None
    suffix: str = ""
    key: str | None = None
    candidate: str | None = None
    repro: str | None = None
    libraries: tuple[str, ...] = ()
    extra: str | None = None
    default: bool = False
    accepts_training: bool = True
    description: str = ""
    position: int = 1000
    rebuild: str | None = None
    device: str | None = None
    checks_candidates: bool = False
    step: str | None = None
    exact: bool = True
    quiet: bool = False
    origin: str = field(default="pt2flow", compare=False)  # the distribution or module that declared it

    def __post_init__(self) -> None:
        from pt2flow.stages.vocabulary import MODULE_NAME_PATTERN

        if not MODULE_NAME_PATTERN.fullmatch(self.name) or "." in self.name:
            raise ValueError(f"stage name {self.name!r} must be an identifier")
        for path in (self.compute, self.key, self.candidate, self.repro, self.rebuild, self.device, self.step):
            if path is not None and ":" not in path:
                raise ValueError(f"stage {self.name}: {path!r} is not a 'module:function' path")

    @property
    def program(self) -> bool:
        """Whether its output is an ExportedProgram that later stages may consume."""
        return self.publishes == "program"


def resolve(path: str) -> Any:
    """The object a "module:attribute" path names (imported here, not at declaration time)."""
    module, _, attribute = path.partition(":")
    target: Any = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target
