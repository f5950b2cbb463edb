"""pt2flow's own stages, each declared once (docs/architecture.md §2).

The declaration order is the order of stages that do not depend on each other (serialize before
aot_compile before the targets); everything else about the order follows from the inputs.
"""

from __future__ import annotations

from pt2flow.flows.pipeline.stage import Input, Stage
from pt2flow.stages.options import (
    AotCompileOptions,
    DecomposeOptions,
    FunctionalizeOptions,
    SerializeOptions,
    TraceOptions,
    ValidateOptions,
)
from pt2flow.stages.target_options import TARGET_EXTRAS, ExecutorchOptions, OnnxOptions

_COMPUTE = "pt2flow.flows.engine.worker.compute"
_KEYS = "pt2flow.flows.engine.orchestrator.stage_keys"
_REPRO = "pt2flow.flows.engine.maintenance.repro"

# a program consumer takes the newest program the run has
NEWEST_PROGRAM = Input("program", ("decompose", "functionalize", "trace"))
# the deployment targets take the functional program, before core ATen: their exporters run
# decomposition tables of their own that keep what their backends handle whole (docs/architecture.md §2)
FUNCTIONAL_PROGRAM = Input("program", ("functionalize", "trace"))

# what the config, the weights and the model's code are: the key comes from the planner's
# manifest (flows/engine/orchestrator/planner.py), not from a key function
# 3: the dependency manifest no longer depends on the worker's history (stages/deps.py)
# 4: the data files the build reads, the declared ones (checkpoint, depends_on) and the eager
# model's digest are part of it; imports resolve against the start-up sys.path
SOURCE = Stage("source", 4, compute=f"{_COMPUTE}:source", publishes="source")

BUILTIN: tuple[Stage, ...] = (
    # 2 (trace, functionalize, decompose, serialize, aot_compile): the program fingerprint covers
    # every node's tensor metadata (stages/program.py); no record keyed by the old one is reused.
    # 3 (trace, functionalize, decompose), serialize 5: a program's identity is the program's as it
    # loads back, and the next stage is given that program (stages.serialize.stored_program); an
    # archive's node provenance names no function address
    Stage(
        "trace", 3, compute=f"{_COMPUTE}:trace", inputs=(Input.of("source"),), options=TraceOptions,
        key=f"{_KEYS}:trace_key", repro=f"{_REPRO}:trace_repro", default=True,
        description="the traced program (training IR)",
    ),
    Stage(
        "functionalize", 3, compute=f"{_COMPUTE}:functionalize", inputs=(Input("program", ("trace",)),),
        options=FunctionalizeOptions, repro=f"{_REPRO}:functionalize_repro", default=True,
        description="the functional ATen program (training: the joint forward+backward program)",
    ),
    Stage(
        "decompose", 3, compute=f"{_COMPUTE}:decompose", inputs=(Input("program", ("functionalize", "trace")),),
        options=DecomposeOptions, repro=f"{_REPRO}:decompose_repro", default=True,
        description="the core ATen program",
    ),
    # 2: the archive names the modules its pytree types need; 3: the new fingerprint; 4: the
    # same program saves to the same bytes (graph ids of the pass provenance numbered, not addresses)
    Stage(
        "serialize", 5, compute=f"{_COMPUTE}:serialize", inputs=(NEWEST_PROGRAM,), options=SerializeOptions,
        publishes="archive", artifact="serialized", suffix=".pt2", candidate="pt2flow.stages.serialize:load_archive",
        repro=f"{_REPRO}:serialize_repro", default=True,
        description=".pt2 archive (torch.export.save)",
    ),
    Stage(
        "aot_compile", 2, compute=f"{_COMPUTE}:aot_compile", inputs=(NEWEST_PROGRAM,), options=AotCompileOptions,
        publishes="package", artifact="compiled", suffix=".pt2", key=f"{_KEYS}:compile_key",
        candidate="pt2flow.stages.aot_compile:load_runner", repro=f"{_REPRO}:aot_compile_repro", default=True,
        description="AOTInductor package",
    ),
    Stage(
        "onnx", 1, compute=f"{_COMPUTE}:onnx", inputs=(FUNCTIONAL_PROGRAM,), options=OnnxOptions,
        publishes="onnx", artifact="onnx", suffix=".onnx", candidate="pt2flow.stages.onnx_target:load_onnx",
        repro=f"{_REPRO}:onnx_repro", libraries=TARGET_EXTRAS["onnx"][1], extra=TARGET_EXTRAS["onnx"][0],
        accepts_training=False, description=".onnx model, for ONNX Runtime",
    ),
    Stage(
        "executorch", 1, compute=f"{_COMPUTE}:executorch", inputs=(FUNCTIONAL_PROGRAM,), options=ExecutorchOptions,
        publishes="pte", artifact="pte", suffix=".pte", candidate="pt2flow.stages.executorch_target:load_pte",
        repro=f"{_REPRO}:executorch_repro", libraries=TARGET_EXTRAS["executorch"][1], extra=TARGET_EXTRAS["executorch"][0],
        accepts_training=False, description=".pte program, for the ExecuTorch runtime (XNNPACK)",
    ),
    # 2: the candidates' signatures are checked against the configured inputs
    Stage(
        "validate", 2, compute=f"{_COMPUTE}:validate", inputs=(Input.of("source"), Input.of("trace")),
        options=ValidateOptions, publishes="report", artifact="report", suffix=".json", key=f"{_KEYS}:validate_key",
        default=True, description="validation report (JSON)",
    ),
)
