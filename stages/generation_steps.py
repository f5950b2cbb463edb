"""One generation step through a component's artifact, per kind: stages/generation.py's second
part. A step function takes generate()'s forward kwargs, as the component's program was traced with
them, and returns what the component returns (logits and the cache); greedy generation
(stages/generation.py `greedy_tokens`) drives any of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.export import ExportedProgram

from pt2flow.stages.generation_export import Component, register_cache_pytrees

if TYPE_CHECKING:
    from pt2flow.stages.target_options import PartitionerName


# ── Running components ───────────────────────────────────────────────────────

StepFn = Callable[..., Any]


def program_step(program: ExportedProgram) -> StepFn:
    """A step function of an ExportedProgram: called with generate()'s forward kwargs, it passes the
    ones the program was traced with, in its order, to `program.module()`."""
    module = program.module()
    names = traced_kwargs(program)

    def step(**kwargs: Any) -> Any:
        with torch.no_grad():
            return module(**{name: kwargs.get(name) for name in names})

    return step


def traced_kwargs(program: ExportedProgram) -> list[str]:
    """The kwarg names a program takes, in the order its input spec lists them."""
    in_spec = program.call_spec.in_spec
    return list(in_spec.child(1).context)


def eager_step(component: Component) -> StepFn:
    """The component's own module, called with the kwargs it was captured with (the eager reference)."""
    names = list(component.inputs)

    def step(**kwargs: Any) -> Any:
        with torch.no_grad():
            return component.module(**{name: kwargs.get(name) for name in names if name in kwargs})

    return step


# ── Artifacts of a component: archive, .pte, ONNX, AOTInductor package ───────
#
# Each kind's step function takes generate()'s forward kwargs, like program_step. A runtime that
# knows no Python containers (ExecuTorch, ONNX Runtime) is fed the tensor leaves of the kwargs flattened by the
# program's in_spec, and its flat outputs are put back into the output structure by the out_spec
# (the cache a decode step returns is a transformers Cache again): CallSpecs carries both specs
# beside such an artifact (a .pte, an ONNX model). torch.export.load and aoti_load_package read the specs from the
# artifact itself, once the cache classes are registered (register_cache_pytrees).


@dataclasses.dataclass(frozen=True)
class CallSpecs:
    """How a component's program is called, for a runtime that takes and returns flat tensors:
    `in_spec`/`out_spec` its call spec, `out_constants` the user outputs the program holds as
    constants (by leaf index; the runtime returns only the tensor ones)."""

    in_spec: Any
    out_spec: Any
    out_constants: dict[int, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, program: ExportedProgram) -> CallSpecs:
        users = [spec for spec in program.graph_signature.output_specs if spec.kind.name == "USER_OUTPUT"]
        constants = {
            index: spec.arg.value for index, spec in enumerate(users) if type(spec.arg).__name__ == "ConstantArgument"
        }
        return cls(program.call_spec.in_spec, program.call_spec.out_spec, constants)

    @property
    def kwargs(self) -> list[str]:
        """The kwarg names the program takes, in its order."""
        return list(self.in_spec.child(1).context)

    def flatten(self, kwargs: Mapping[str, Any], *, keep_none: bool = False) -> list[Any]:
        """The program's user tensor inputs from generate()'s kwargs (the others are its constants).
        `keep_none`: a None leaf stays in its place (ExecuTorch keeps a None input in the method's
        signature, as Qwen2's prefill mask `{"full_attention": None}`; ONNX drops it)."""
        import torch.fx._pytree as fx_pytree

        leaves = fx_pytree.tree_flatten_spec(((), {name: kwargs.get(name) for name in self.kwargs}), self.in_spec)
        return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) or (keep_none and leaf is None)]

    def unflatten(self, outputs: list[Any]) -> Any:
        """The model's output from a runtime's flat outputs. ExecuTorch returns the inputs a program
        updates in place first (a static cache's layers), the user outputs last: the last ones are taken."""
        wanted = self.out_spec.num_leaves - len(self.out_constants)
        if len(outputs) < wanted:
            raise RuntimeError(
                f"the runtime returned {len(outputs)} outputs; the program's out_spec has {wanted} tensors"
            )
        tensors = iter(outputs[len(outputs) - wanted :])
        leaves = [
            self.out_constants[i] if i in self.out_constants else next(tensors) for i in range(self.out_spec.num_leaves)
        ]
        return torch.utils._pytree.tree_unflatten(leaves, self.out_spec)

    def to_json(self) -> dict[str, Any]:
        """For a manifest beside the artifact (treespec_dumps; the cache classes by their import path)."""
        dumps = torch.utils._pytree.treespec_dumps
        return {
            "in_spec": dumps(self.in_spec),
            "out_spec": dumps(self.out_spec),
            "out_constants": {str(i): v for i, v in self.out_constants.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CallSpecs:
        register_cache_pytrees()
        loads = torch.utils._pytree.treespec_loads
        return cls(
            loads(data["in_spec"]),
            loads(data["out_spec"]),
            {int(i): v for i, v in data.get("out_constants", {}).items()},
        )


def flat_step(
    runner: Callable[[list[torch.Tensor]], list[Any]], specs: CallSpecs, *, keep_none: bool = False
) -> StepFn:
    """A step function of a runner taking and returning flat tensors (stages.targets.FlatRunner)."""

    def step(**kwargs: Any) -> Any:
        with torch.no_grad():
            return specs.unflatten(list(runner(specs.flatten(kwargs, keep_none=keep_none))))

    return step


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What an artifact kind's step function (its stage's `step`) gets besides the component's bytes:
    `specs` gives the component's call specs (its traced program's, made on first use) and
    `workdir` is a folder of its own that outlives the step function (a package unpacks there)."""

    specs: Callable[[], CallSpecs]
    workdir: str


def candidate_step(runner: Callable[[list[torch.Tensor]], list[Any]], context: StepContext) -> StepFn:
    """The step function of any flat runner (a candidate loader's: ONNX Runtime, OpenVINO, a
    plugin's): the component's tensor leaves in, its output rebuilt from the flat outputs."""
    return flat_step(runner, context.specs())


def archive_bytes(program: ExportedProgram) -> bytes:
    """The component's program as pt2flow's serialize stage writes it (torch.export.save, round trip checked)."""
    from pt2flow.stages.serialize import serialize

    return serialize(program, {}).output


def archive_step(data: bytes) -> StepFn:
    """A step function of a component's `.pt2` archive, loaded by torch.export.load (cache classes registered first)."""
    from pt2flow.stages.serialize import load_archive

    register_cache_pytrees()
    program, _ = load_archive(data)
    return program_step(program)


def pte_bytes(program: ExportedProgram, partitioners: tuple[PartitionerName, ...] = ()) -> bytes:
    """The component lowered by pt2flow's executorch stage: `()` the portable kernels only, `("xnnpack",)`.
    Every dynamic dim needs a maximum (a static cache bounds the prompt axis by `max_cache_len`)."""
    from pt2flow.stages.executorch_target import lower_executorch
    from pt2flow.stages.target_options import ExecutorchOptions

    return lower_executorch(program, ExecutorchOptions(partitioners=partitioners, portable_fallback=True)).output


def pte_step(data: bytes, specs: CallSpecs) -> StepFn:
    """A step function of a component's `.pte` on the ExecuTorch runtime's Python bindings."""
    from pt2flow.stages.executorch_target import load_pte

    return flat_step(load_pte(data), specs, keep_none=True)


def onnx_bytes(program: ExportedProgram) -> bytes:
    """The component converted by pt2flow's onnx stage (torch.onnx.export(program, dynamo=True));
    the cache's tensors are the model's inputs and outputs, a static cache's updates included."""
    from pt2flow.stages.onnx_target import export_onnx
    from pt2flow.stages.target_options import OnnxOptions

    return export_onnx(program, OnnxOptions()).output


def onnx_step(data: bytes, specs: CallSpecs) -> StepFn:
    """A step function of a component's ONNX model on ONNX Runtime (CPU)."""
    from pt2flow.stages.onnx_target import load_onnx

    return flat_step(load_onnx(data), specs)


def aoti_bytes(program: ExportedProgram) -> bytes:
    """The component compiled by pt2flow's aot_compile stage (an AOTInductor package, CPU)."""
    from pt2flow.stages.aot_compile import aot_compile
    from pt2flow.stages.options import AotCompileOptions

    return aot_compile(program, AotCompileOptions()).output


def aoti_step(data: bytes, workdir: str) -> StepFn:
    """A step function of a component's AOTInductor package, loaded under `workdir` (which must
    outlive it); the package flattens and unflattens by its own call spec."""
    from pt2flow.stages.aot_compile import load_package

    register_cache_pytrees()
    runner = load_package(data, workdir)
    names = list(torch.utils._pytree.treespec_loads(runner.loader.get_call_spec()[0]).child(1).context)

    def step(**kwargs: Any) -> Any:
        # compiled code indexes its inputs by the strides they were traced with (contiguous), and
        # the prefill package returns a dynamic cache's tensors non-contiguous: the decode package
        # read them wrongly (tokens diverged from the second one) until they were made contiguous
        contiguous = torch.utils._pytree.tree_map_only(
            torch.Tensor, torch.Tensor.contiguous, {name: kwargs.get(name) for name in names}
        )
        with torch.no_grad():
            return runner(**contiguous)

    return step
