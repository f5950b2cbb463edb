"""What the deployment targets (stages/onnx_target.py, stages/executorch_target.py) share: the
refusal of training programs, the flat calling convention of their runners and the op named in a
library's error.

A target's runner takes the flat list of the user's input tensors (torch's flattening order of
`(args, kwargs)`, non-tensor leaves left out: the program holds them as constants) and returns
the flat list of output tensors: neither ONNX Runtime nor the ExecuTorch runtime knows Python
containers. stages/validate.py puts the eager output's structure back (FlatCandidate)."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import re
import tempfile
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from pt2flow.stages.errors import StageError
from pt2flow.stages.vocabulary import ErrorClass

# a runner of a target's artifact: flat user input tensors in, flat output tensors out
FlatRunner = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]

# output kinds only a joint forward+backward program (functionalize, mode: training) has
_TRAINING_OUTPUTS = frozenset({"LOSS_OUTPUT", "GRADIENT_TO_PARAMETER", "GRADIENT_TO_USER_INPUT"})


def refuse_training(ep: ExportedProgram, target: str) -> None:
    """StageError(config) for a joint forward+backward program: a target deploys inference."""
    kinds = sorted({s.kind.name for s in ep.graph_signature.output_specs} & _TRAINING_OUTPUTS)
    if kinds:
        raise StageError(
            ErrorClass.CONFIG,
            f"the {target} target takes inference programs, and this one is a training program "
            f"(joint forward+backward: it returns {', '.join(kinds)}); "
            "set functionalize.mode to inference for a model that is deployed to this target",
        )


def refuse_state(ep: ExportedProgram, stateless: str, consequence: str) -> None:
    """StageError(lowering) for a program that updates buffers (running statistics, a counter, a
    cache) going to a target whose model has no state: it would compute every call from the
    initial buffers and silently disagree with the model after its first call. stateless: the
    sentence saying so of the target; consequence: what its runtime would do instead."""
    mutated = sorted(ep.graph_signature.buffers_to_mutate.values())
    if mutated:
        shown = ", ".join(mutated[:5]) + (f" (+{len(mutated) - 5} more)" if len(mutated) > 5 else "")
        raise StageError(
            ErrorClass.LOWERING,
            f"{stateless}, and this program updates buffers on every call ({shown}): {consequence}; deploy it to a target that keeps state",
            details={"buffers": mutated},
        )


def flat_tensor_inputs(args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The user's tensor leaves of a call, in torch's flattening order: what a runner takes."""
    return [leaf for leaf in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(leaf, torch.Tensor)]


def restructure(flat: Sequence[Any], like: Any) -> Any:
    """`flat` (a runner's output tensors) in the structure of `like` (the eager output): its
    tensor leaves replaced in order, its other leaves (ints, None: constants in the program) kept.
    A count that does not match returns `flat` as a list, so the comparison reports the difference."""
    leaves, spec = pytree.tree_flatten(like)
    if sum(isinstance(leaf, torch.Tensor) for leaf in leaves) != len(flat):
        return list(flat)
    supply = iter(flat)
    return pytree.tree_unflatten([next(supply) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """exc, then its causes (or contexts), outermost first."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


_OP_PATTERNS = (
    re.compile(r"OpOverload\(op='([\w.]+)', overload='(\w+)'\)"),
    re.compile(r"call_function\[target=(?:torch\.ops\.)?([\w.]+)\]"),
)


def ops_named_in(exc: BaseException) -> list[str]:
    """The ops (`aten.x.default`, `mylib.op.default`) a library's error and its causes name, in order."""
    found: list[str] = []
    for link in exception_chain(exc):
        text = str(link)
        for pattern in _OP_PATTERNS:
            for match in pattern.finditer(text):
                name = ".".join(g for g in match.groups() if g)
                if name not in found:
                    found.append(name)
    return found


def innermost_reason(exc: BaseException, limit: int = 300) -> str:
    """The deepest cause's type and first line: usually the library's own words for the refusal."""
    *_, last = exception_chain(exc)
    text = (str(last).strip().splitlines() or [""])[0]
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(last).__name__}: {text}" if text else type(last).__name__


@contextlib.contextmanager
def native_stderr() -> Iterator[list[str]]:
    """Capture what native code writes to file descriptor 2 inside the block (a runtime's own log,
    which Python's sys.stderr never sees); the list holds its lines once the block ends."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(line for line in sink.read().decode(errors="replace").splitlines() if line.strip())


class RuntimeDiagnosed(RuntimeError):
    """A runtime's failure with the runtime's own log lines (what it said on stderr) added to the
    message: `error: 0x10` alone does not say that an input outgrew its planned memory."""


def with_runtime_log(exc: BaseException, lines: Sequence[str], keep: Callable[[str], bool]) -> BaseException:
    """exc, or a RuntimeDiagnosed whose message adds the log lines `keep` selects (at most five)."""
    said = [line.strip() for line in lines if keep(line)][:5]
    if not said:
        return exc
    return RuntimeDiagnosed(f"{exc} (runtime log: {' | '.join(said)})")


class FlatCandidate:
    """A target's runner as a validate candidate: called like the model, with the user's
    (args, kwargs); feeds the runner their tensor leaves and returns its flat output list, which
    stages/validate.py puts into the eager output's structure (restructure) before comparing."""

    def __init__(self, runner: FlatRunner) -> None:
        self.runner = runner

    def __call__(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        return self.runner(flat_tensor_inputs(args, kwargs))

    def prepare(self, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        """A call of the runtime on these inputs, converted to its own form once (a runner's
        `prepare`, where it has one): what the benchmark times, as a server that receives its
        inputs in the runtime's form would see it; else a call of the runner as validate makes it."""
        flat = flat_tensor_inputs(args, kwargs)
        prepare = getattr(self.runner, "prepare", None)
        return prepare(flat) if prepare is not None else lambda: self.runner(flat)

    def close(self) -> None:
        """Give back what loading it changed in the process (a runner's `close`, where it has
        one: ExecuTorch's thread pool is the process's own, stages/executorch_target.py)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()


def takes_threads(load: Callable[..., Any]) -> bool:
    """Whether a loader takes `threads` (the intra-op threads its runtime runs on)."""
    try:
        return "threads" in inspect.signature(load).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


@dataclass(frozen=True)
class TargetArtifact:
    """A target's artifact for validate and check-compat: its bytes and the function that loads
    them into a runner (stages.onnx_target.load_onnx, stages.executorch_target.load_pte). A
    loader may take `threads` (an int, or None for its runtime's own default): the benchmark
    times every artifact on the same number of threads (stages/benchmark.py)."""

    data: bytes
    load: Callable[..., FlatRunner]
    exact: bool = True  # false: judged by the accuracy budgets, not allclose (an int8 artifact)

    @property
    def takes_threads(self) -> bool:
        return takes_threads(self.load)

    def candidate(self, threads: int | None = None) -> FlatCandidate:
        """Its bytes loaded, as a candidate called like the model; on `threads` intra-op threads
        where its loader takes them (else, and with None, its runtime's own default)."""
        if threads is None or not self.takes_threads:
            return FlatCandidate(self.load(self.data))
        return FlatCandidate(self.load(self.data, threads=threads))
