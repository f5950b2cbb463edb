"""The stage model (flows/pipeline): order and parents follow from the declared inputs, never
from a list; a registered stage joins in its place; bad declarations are refused up front."""

from __future__ import annotations

import pytest

from pt2flow.flows import pipeline
from pt2flow.flows.pipeline import Input, Stage, StageRegistrationError


ORDER = ("trace", "functionalize", "decompose", "serialize", "aot_compile", "onnx", "executorch", "validate")


def test_the_order_is_a_topological_sort_of_the_inputs() -> None:
    names = pipeline.names()
    # the order every config keeps (a new target joins between the others and validate, by its position)
    assert [n for n in names if n in ORDER] == list(ORDER)
    assert names[0] == "trace" and names.index("validate") > max(names.index(c) for c in pipeline.candidates())
    assert names[-1] == "benchmark"  # it times what validate passed
    assert [s.position for s in pipeline.stages()] == sorted(s.position for s in pipeline.stages())
    for stage in pipeline.stages():  # every provider of every input comes before the stage
        for item in pipeline.inputs_of(stage):
            assert all(names.index(p) < names.index(stage.name) for p in item.stages if p != "source"), stage.name
    assert pipeline.default_stages() == ("trace", "functionalize", "decompose", "serialize", "aot_compile", "validate")


@pytest.mark.parametrize(
    ("stage", "selected", "parents"),
    [
        ("serialize", ["trace", "serialize"], ["trace"]),  # a valid list repro once got wrong (issue 20)
        ("serialize", ["trace", "functionalize", "decompose", "serialize"], ["decompose"]),
        ("aot_compile", ["trace", "functionalize", "aot_compile"], ["functionalize"]),
        ("onnx", ["trace", "functionalize", "decompose", "onnx"], ["functionalize"]),  # targets skip core ATen
        ("validate", ["trace", "serialize", "executorch", "validate"], ["source", "trace", "serialize", "executorch"]),
    ],
)
def test_parents_are_the_first_provider_the_run_has(stage: str, selected: list[str], parents: list[str]) -> None:
    assert pipeline.parents(stage, selected) == parents


def test_a_registered_stage_joins_after_what_it_consumes_and_leaves_cleanly() -> None:
    extra = Stage(
        "counted", 1, compute="tests.plugin_stage:compute", inputs=(Input("program", ("decompose", "trace")),)
    )
    pipeline.register(extra)
    try:
        names = pipeline.names()
        assert names.index("counted") > names.index("decompose")
        assert pipeline.get("counted").origin == "tests.plugin_stage"
        assert "counted" not in pipeline.default_stages()
        with pytest.raises(StageRegistrationError, match="already registered"):
            pipeline.register(Stage("counted", 2, compute="tests.plugin_stage:compute"))
    finally:
        pipeline.unregister("counted")
    assert "counted" not in pipeline.names()
    early = Stage(
        "early",
        1,
        compute="tests.plugin_stage:compute",
        inputs=(Input("program", ("functionalize", "trace")),),
        position=35,
    )
    pipeline.register(early)  # its position puts it before serialize, which its inputs leave unordered
    try:
        names = pipeline.names()
        assert names.index("functionalize") < names.index("early") < names.index("serialize")
        assert names.index("decompose") < names.index("early")  # position 35: after decompose's 30
    finally:
        pipeline.unregister("early")
    with pytest.raises(StageRegistrationError, match="own stages"):
        pipeline.unregister("trace")


def test_bad_declarations_are_refused() -> None:
    with pytest.raises(StageRegistrationError, match="no registered stage makes"):
        pipeline.register(Stage("orphan", 1, compute="m:f", inputs=(Input.of("nowhere"),)))
    with pytest.raises(ValueError, match="module:function"):
        Stage("dotless", 1, compute="just_a_name")
    with pytest.raises(ValueError, match="identifier"):
        Stage("has.dot", 1, compute="m:f")
    assert "orphan" not in pipeline.names()
