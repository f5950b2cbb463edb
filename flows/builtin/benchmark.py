"""benchmark (opt-in): every artifact validate passed, and eager, timed at each size on this machine
(stages/benchmark.py); the report (JSON) is its artifact, a summary (the recommendation, each
artifact's p50 at each size) is in its record's details under `timings`.

Its key covers the machine as well as the validated artifacts: the CPU (architecture, model name,
feature flags) and the cores the workers may use (its options, `threads` among them, are in it
as every stage's are), so a store shared by different machines never serves one the timings of
another. It is a quiet stage: it runs while
no other stage work of pt2flow runs on the machine, its own run's other workers and other runs'
included (flows/engine/worker/turns.py), and the stage itself waits for, measures and reports
the load of everything else (stages/benchmark.py): timings taken beside other work are noise.
"""

from __future__ import annotations

import json
import os
import platform
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

from pt2flow.flows.pipeline.stage import LOADED_BY_VALIDATE, TIMINGS, Input, Stage
from pt2flow.stages.options import BenchmarkOptions

if TYPE_CHECKING:
    from pt2flow.flows.config.models import ResolvedModel
    from pt2flow.flows.engine.stage_api import Outcome, Produced, StageCall

# 2: the load while timing, each measurement's spread and drift, no recommendation from noisy ones;
# 3: every artifact called under inference_mode, as eager is (no_grad cost the archive 5-10 %);
# 4: `threads` (1 unless set) applied to every runtime, not to torch alone;
# 5: a sample counts only while a canary beside it says the machine ran at full speed (max_slowdown)
STAGE = Stage(
    "benchmark",
    5,
    compute=f"{__name__}:compute",
    inputs=(Input.of("source"), Input.of("trace"), Input.of("validate")),
    options=BenchmarkOptions,
    publishes=TIMINGS,
    artifact="benchmark",
    suffix=".json",
    key=f"{__name__}:key",
    checks_candidates=True,
    accepts_training=False,
    quiet=True,
    position=110,
    description="latency of every validated artifact at each size, and the fastest (JSON)",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.flows import pipeline
    from pt2flow.flows.builtin.validate import device, target_artifacts
    from pt2flow.stages.benchmark import benchmark
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.vocabulary import ErrorClass

    if call.model.training:
        raise StageError(
            ErrorClass.CONFIG,
            "benchmark times inference, and this model is in training mode (functionalize.mode: training): leave benchmark out of its stages",
        )
    verdicts = json.loads(call.blob("validate"))
    passed = validated(verdicts)
    own = {kind: pipeline.publisher_name(kind) for kind in LOADED_BY_VALIDATE}
    blobs = {
        kind: call.artifact(name, kind) if name and name in call.inputs and _slot(name) in passed else None
        for kind, name in own.items()
    }
    targets = {name: t for name, t in target_artifacts(call).items() if name in passed}
    result = benchmark(
        call.eager(),
        call.example_inputs(),
        call.inputs["trace"].details.get("dims", {}),
        call.options(BenchmarkOptions),
        archive=blobs["archive"],
        package=blobs["package"],
        device=device(call.model),
        targets=targets,
        machine=machine(),
    )
    summary = dict(result.metadata["summary"])
    judged = {  # what an artifact judged by accuracy budgets costs, beside what it saves
        name: entry["accuracy"]["metrics"]
        for name, entry in (verdicts.get("candidates") or {}).items()
        if name in targets and "accuracy" in entry
    }
    if judged:
        summary["accuracy"] = judged
    return call.publish(
        json.dumps(result.output, indent=1).encode(),
        details={TIMINGS: summary},
        warnings=result.warnings,
    )


def _slot(stage: str) -> str:
    """The name validate's report gives a stage's candidate (flows/builtin/validate.py candidate_names)."""
    from pt2flow.flows import pipeline
    from pt2flow.flows.builtin.validate import candidate_names

    return candidate_names().get(str(pipeline.get(stage).artifact), stage)


def validated(report: Mapping[str, Any]) -> set[str]:
    """The candidates of validate's report whose verdict passed: a candidate's own verdict where
    the report has one, else the report's."""
    found = set()
    for name, entry in (report.get("candidates") or {}).items():
        verdict = entry.get("verdict") if isinstance(entry, Mapping) else None
        if (verdict.get("passed") if isinstance(verdict, Mapping) else report.get("passed")) is True:
            found.add(name)
    return found


def machine() -> dict[str, Any]:
    """The kind of machine timings depend on (not which one: no host name): architecture, CPU
    model and feature flags, and the cores this process may use. Torch-free, a few file reads."""
    from pt2flow.flows.engine.stage_api import toolchain_facts

    facts = toolchain_facts("cpu")
    return {"arch": facts["machine"], "cpu": _cpu_model(), "cpu_flags": facts["cpu_flags"], "cores": _cores()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "Model", "Hardware"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def key(stage: Stage, model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
    """Validate's key (which covers every candidate artifact and the source), the artifacts, the
    options, the candidates' libraries, and the machine (`machine`)."""
    from pt2flow.flows import pipeline
    from pt2flow.flows.builtin.validate import device
    from pt2flow.flows.engine.stage_api import derivation_key, environment_part, options_json

    present = [name for name in pipeline.candidates() if name in inputs]
    libraries = [lib for name in present for lib in pipeline.get(name).libraries]
    env = {**environment_part(device(model), libraries), "machine": json.dumps(machine(), sort_keys=True)}
    parents = [inputs["validate"].key, *(inputs[name].artifact for name in present)]
    return derivation_key(stage.name, parents, options_json(model, stage.name), env)
