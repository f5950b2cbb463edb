"""executorch_int8: the functional program quantized to int8 through PT2E with XNNPACK's quantizer,
calibrated on batches of the model's inputs, and lowered for ExecuTorch with the XNNPACK partitioner
(stages/quantize.py). Not meant to equal eager: validate judges it by the model's accuracy budgets
(`validate.accuracy`), not by allclose."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

from pt2flow.flows.builtin._programs import FUNCTIONAL_PROGRAM
from pt2flow.flows.pipeline.stage import Input, Stage
from pt2flow.stages.target_options import Int8Options

if TYPE_CHECKING:
    from pt2flow.flows.config.models import ResolvedModel
    from pt2flow.flows.engine.stage_api import Outcome, Produced, RebuildCall, ReproJob, StageCall

STAGE = Stage(
    "executorch_int8",
    1,
    compute=f"{__name__}:compute",
    # the source: what the calibration batches are drawn from (the inputs spec, an inputs factory
    # or file and what it reads) is in its key, not in the program's fingerprint
    inputs=(FUNCTIONAL_PROGRAM, Input.of("source")),
    options=Int8Options,
    key=f"{__name__}:key",
    publishes="pte-int8",
    artifact="pte-int8",
    suffix=".int8.pte",
    candidate="pt2flow.stages.executorch_target:load_pte",
    libraries=("executorch", "torchao"),
    extra="executorch",
    accepts_training=False,
    exact=False,
    position=75,
    rebuild=f"{__name__}:rebuild",
    repro=f"{__name__}:repro",
    description="int8 .pte (PT2E, XNNPACK), for the ExecuTorch runtime; judged by accuracy budgets",
)


def compute(call: StageCall) -> Produced:
    from pt2flow.stages.quantize import quantize_for_executorch

    options = call.options(Int8Options)
    calibration, example = calibration_inputs(
        call.model, call.eager_model(), call.example_inputs(), options, STAGE.name
    )
    result = quantize_for_executorch(call.program(), calibration, example, options)
    return call.publish_result(described(result, call.model, options))


def repro(job: ReproJob) -> str:
    """The failed quantization again with torch, torchao and ExecuTorch alone: the functional
    program it was given, the calibration batches it took (written to calibration.pt, made as the
    stage made them), the quantizer as configured (stages.quantize.int8_repro_body)."""
    return int8_repro(job, "executorch")


def int8_repro(job: ReproJob, target: str) -> str:
    """An int8 stage's repro body for `target` (executorch, inductor): calibration.pt written."""
    import dataclasses

    import torch

    from pt2flow.flows.engine.stage_api import model_inputs, recorded_weights
    from pt2flow.stages.quantize import int8_repro_body
    from pt2flow.stages.source import build_model, import_factory

    model, options, details = job.model, Int8Options(**job.options), job.source.get("details") or {}
    state = recorded_weights(job.store, details)
    eager = build_model(import_factory(model.factory, model.search_path), model.kwargs, state)
    if model.data is not None and details.get("search_path"):  # its data factory, from the config's folder
        model = dataclasses.replace(model, search_path=details["search_path"])
    calibration, example = calibration_inputs(model, eager, model_inputs(model), options, str(job.record["stage"]))
    job.files.append("calibration.pt")
    torch.save(
        {"calibration": [(b.args, b.kwargs) for b in calibration], "example": (example.args, example.kwargs)},
        job.folder / "calibration.pt",
    )
    return job.program() + int8_repro_body(options, target)


def described(result: Any, model: ResolvedModel, options: Int8Options) -> Any:
    """`result` with its record's `calibration`: what it was calibrated on, for `get --json` and
    `show` (the model's own data: its factory and the batches taken, whose module's source hash
    and files are its source parent's; else the seeds of the batches drawn from its inputs spec)."""
    import dataclasses

    from pt2flow.stages.quantize import calibration_seeds

    if model.data is not None and model.data.file is not None:  # the file's bytes are its source parent's
        source: dict[str, Any] = {"data_file": model.data.file, "batches": model.data.calibration, "first_batch": 0}
    elif model.data is not None:
        source = {"data": model.data.factory, "batches": model.data.calibration, "first_batch": 0}
    else:
        seeds = calibration_seeds(options)
        source = {"inputs": "drawn from the model's inputs spec", "batches": len(seeds), "seeds": [seeds[0], seeds[-1]]}
    return dataclasses.replace(result, metadata={**result.metadata, "calibration": source})


def rebuild(call: RebuildCall) -> str | None:
    """`pt2flow audit`: the .pte made again from the stored functional program, the recorded
    options and the model's calibration batches (so the config's model: --config), as the sha256
    of its bytes, which the record's fingerprint is. PT2E, XNNPACK's lowering and ExecuTorch's
    serializer are deterministic here (the same bytes in fresh stores and processes), so any
    other digest is a dependency the key misses. None without the model or the program."""
    import hashlib

    from pt2flow.stages.quantize import quantize_for_executorch

    if call.model is None or call.parent is None:
        return None
    options = Int8Options(**call.options)
    calibration, example = calibration_inputs(call.model, call.eager(), call.example_inputs(), options, STAGE.name)
    return hashlib.sha256(quantize_for_executorch(call.parent, calibration, example, options).output).hexdigest()


def key(stage: Stage, model: ResolvedModel, inputs: Mapping[str, Outcome]) -> str:
    """The program's fingerprint, the source's key (the calibration batches are drawn from the
    model's inputs: a change of their spec, factory or file that leaves the program as it was
    changes them), the options, and the torch, Python and libraries' versions (Stage.libraries)."""
    return int8_key(stage, model, inputs)


def int8_key(stage: Stage, model: ResolvedModel, inputs: Mapping[str, Outcome], env: Mapping[str, Any] = {}) -> str:  # noqa: B006 - read only
    """What an int8 artifact's key covers (key's docstring), with `env` added to the environment
    part: what else the artifact depends on (aot_compile_int8's native toolchain)."""
    from pt2flow.flows.engine.stage_api import derivation_key, environment_part, options_json

    return derivation_key(
        stage.name,
        [inputs["program"].fingerprint, inputs["source"].key],
        options_json(model, stage.name),
        {**environment_part("cpu", stage.libraries), **env},
    )


def calibration_inputs(
    model: ResolvedModel, eager: Any, inputs: Any, options: Int8Options, stage: str
) -> tuple[list[Any], Any]:
    """The calibration batches and the example the quantized module is exported on: the model's
    own data (`data:`, its first `data.calibration` batches) where it has some, else
    `calibration_batches` batches drawn from its inputs spec at the example sizes (seeded by
    stages.quantize.calibration_seeds)."""
    from pt2flow.stages.binding import bind_inputs
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.example_inputs import ModelInputs
    from pt2flow.stages.quantize import calibration_seeds
    from pt2flow.stages.vocabulary import ErrorClass

    if model.component:
        raise StageError(ErrorClass.CONFIG, f"{stage} does not quantize a generative model's components yet")
    example = bind_inputs(eager, inputs, seed=0)
    if model.data is not None:
        from pt2flow.flows.engine.stage_api import data_batches

        given = [
            ModelInputs(inputs=kwargs, dynamic={}, dims={}, positional=args) for args, kwargs in data_batches(model)
        ]
        return [bind_inputs(eager, batch) for batch in given], example
    return [bind_inputs(eager, inputs, seed=seed) for seed in calibration_seeds(options)], example
