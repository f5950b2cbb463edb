"""A stage defined outside pt2flow, in this one file (docs/architecture.md, "Adding a stage").

`opcount` counts the operators of the newest program a run has and stores the counts as JSON.
With `forbid: [op, ...]` it fails, with class unsupported_op, on a program that calls one of them:
a stand-in for a deployment check a platform team adds without touching pt2flow.

tests/integration/test_plugin_stage.py registers it the way a distribution would, through an
entry point of the group `pt2flow.stages` naming STAGE, and runs it through the CLI.
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from pt2flow.flows.pipeline import Input, Stage

if TYPE_CHECKING:  # a stage module's engine API, typed (mypy checks this file with it: tests/test_layout.py)
    from pt2flow.flows.engine.stage_api import Produced, ReproJob, StageCall


class OpCountOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    forbid: tuple[str, ...] = ()  # operator names such as aten.relu.default


def count_ops(program: Any) -> dict[str, int]:
    return dict(sorted(Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function").items()))


def compute(call: StageCall) -> Produced:
    """Runs in a pt2flow worker: the StageCall gives the program and publishes the result."""
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.vocabulary import ErrorClass

    options = call.options(OpCountOptions)
    counts = count_ops(call.program())
    found = sorted(set(options.forbid) & set(counts))
    if found:
        raise StageError(ErrorClass.UNSUPPORTED_OP, f"forbidden operators in the program: {', '.join(found)}")
    return call.publish(
        json.dumps(counts, sort_keys=True).encode(), details={"ops": len(counts), "calls": sum(counts.values())}
    )


def repro(job: ReproJob) -> str:
    """The body of a torch-only script that raises what compute raised."""
    forbid = tuple(job.options.get("forbid") or ())
    return job.program() + textwrap.dedent(f"""\
        from collections import Counter
        counts = Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")
        found = sorted(set({forbid!r}) & set(counts))
        if found:
            raise RuntimeError("forbidden operators in the program: " + ", ".join(found))
        """)


STAGE = Stage(
    "opcount",
    1,
    compute="tests.plugin_stage:compute",
    inputs=(Input("program", ("decompose", "functionalize", "trace")),),
    options=OpCountOptions,
    publishes="opcount",
    artifact="opcount",
    suffix=".json",
    repro="tests.plugin_stage:repro",
    description="operator counts of the newest program (JSON)",
)
