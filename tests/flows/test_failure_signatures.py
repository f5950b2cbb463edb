"""Root-cause signatures (flows/report/failures.py, stages/classify.py failure_origin): what
differs between models that hit one cause (names, sizes, symbol numbers, addresses, paths) never
splits a group, and what makes another cause (the op, the guard, the frame) always does. The
fleet-level behaviour runs for real in tests/integration/test_failure_groups.py."""

from __future__ import annotations

import json

from pt2flow.flows.report.failures import draft_issues, normalise, signature, where_of
from pt2flow.stages.classify import failure_origin

GUARD = (
    "GuardOnDataDependentSymNode: Could not guard on data-dependent expression Eq({u}, 1) (unhinted: Eq({u}, 1)).  "
    '(Size-like symbols: none)\n\nThe following call raised this error:\n  File "{path}/blocks.py", line 34, in forward\n'
    "    if h.sum() > 0: (tried: configured, other_strictness)"
)


def test_what_varies_per_model_does_not_change_the_signature() -> None:
    a = signature("data_dependent", "trace", GUARD.format(u="u0", path="/home/a/zoo"), model="bert-small")
    b = signature("data_dependent", "trace", GUARD.format(u="u17", path="/srv/ci/other"), model="bert-large")
    assert a == b and a.subject == "data-dependent Eq(u, 1)" and a.where == "blocks:forward"
    shapes = [
        f"RuntimeError: shape mismatch for {name}: torch.Size([{n}, 64]) vs [{n}, 128] at 0x{addr}"
        for name, n, addr in (("resnet-a", 3, "7f3a9c"), ("resnet-b", 17, "55d0e1"))
    ]
    first, second = (
        signature("runtime", "validate", text, model=name) for text, name in zip(shapes, ("resnet-a", "resnet-b"))
    )
    assert first.id == second.id and "resnet" not in first.subject and "0x7f" not in first.subject, first.subject
    assert normalise("u12 > s3 + 512 in /a/b/c.py, see https://x.org/a/1") == "u > s + N in c.py, see <url>"
    mismatch = (
        "outputs differ beyond atol=1e-05, rtol=0.0001: compiled on example: {out}: max abs err {e}, max rel err 0.3 | "
        "compiled on random-1: {out}: max abs err 2.1"
    )
    a, b = (
        signature("numeric_mismatch", "validate", mismatch.format(out=o, e=e))
        for o, e in (("logits", 1.67), ("output", 0.02))
    )
    assert a.id == b.id and a.subject == "outputs differ beyond atol=1e-N, rtol=N (compiled)", a.subject


def test_another_op_guard_or_frame_is_another_cause() -> None:
    op = "RuntimeError: There was no fake impl registered for <CustomOpDef(mylib::{name})>. This is necessary"
    assert signature("unsupported_op", "trace", op.format(name="gelu2")).subject == "op mylib::gelu2"
    assert (
        signature("unsupported_op", "trace", op.format(name="gelu2")).id
        != signature("unsupported_op", "trace", op.format(name="swish9")).id
    )
    here = {"module": "zoo.blocks", "function": "Gate.forward", "line": 3, "code": "if x:"}
    there = {**here, "function": "Router.forward"}
    message = GUARD.format(u="u0", path="/p")
    assert signature("data_dependent", "trace", message, origin=here).where == "zoo.blocks:Gate.forward"
    assert (
        signature("data_dependent", "trace", message, origin=here).id
        != signature("data_dependent", "trace", message, origin=there).id
    )
    # the same cause met at another stage, or classed otherwise, is not the same failure
    assert signature("data_dependent", "trace", message).id != signature("data_dependent", "functionalize", message).id
    decomposition = "ops outside core ATen remain after decomposition, and torch has no decomposition for them: mylib.fused.default, aten.foo.bar"
    assert (
        signature("decomposition", "decompose", decomposition).subject
        == "no decomposition for aten.foo.bar, mylib::fused"
    )


def test_a_crash_is_placed_by_the_traceback_in_its_stderr() -> None:
    stderr = (
        'Traceback (most recent call last):\n  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1778, in _call\n'
        '  File "/work/zoo/models/attn.py", line 88, in forward\n    return kernel(q)\n'
        '  File "/venv/lib/python3.11/site-packages/torch/_ops.py", line 875, in __call__\nSegmentation fault'
    )
    assert where_of(None, "worker died (signal SIGSEGV)", stderr) == "attn:forward"
    assert (
        where_of(None, 'File "/venv/lib/python3.11/site-packages/torch/_ops.py", line 875, in __call__')
        == "torch._ops:__call__"
    )
    assert where_of(None, "no frame here") == "-"
    # a model library that is installed (transformers) is the model's code; torch below it is not
    hf = (
        'The following call raised this error:\n  File "/venv/lib/python3.11/site-packages/transformers/models/bert/modeling_bert.py", '
        'line 210, in forward\n    if attention_mask.sum() > 0:\n  File "/venv/lib/python3.11/site-packages/torch/_ops.py", line 875, in __call__'
    )
    assert where_of(None, hf) == "transformers.models.bert.modeling_bert:forward"


class Config:
    def parse(self, text: str) -> dict:
        return json.loads(text)  # the error is raised in the standard library, below this frame


def test_failure_origin_is_the_frame_in_the_models_own_code() -> None:
    try:
        Config().parse("{not json")
    except ValueError as exc:
        origin = failure_origin(exc)
    assert origin == {
        "module": __name__,
        "function": "Config.parse",
        "line": origin["line"],
        "code": "return json.loads(text)  # the error is raised in the standard library, below this frame",
        "own": True,
    }
    try:
        json.loads("[")
    except ValueError as exc:
        wrapped = RuntimeError("stage failed")
        wrapped.__cause__ = exc
        # the test's own frame raised it here: still own code; a library-only chain names the library
        assert failure_origin(wrapped)["own"] is True
    library_only = ValueError("x")
    library_only.__traceback__ = None
    assert failure_origin(library_only) is None


DRAFT = """
###################################################################################################
WARNING: 4 issue(s) found during export, and it was not able to soundly produce a graph.
###################################################################################################

1. Data dependent error.
    When exporting, we were unable to evaluate the value of `Eq(u3, 1)`.
    This was encountered 2 times.
    This occurred at the following user stacktrace: 
        File /venv/lib/python3.11/site-packages/torch/nn/modules/module.py, lineno 1789, in _call_impl
        File /zoo/blocks.py, lineno 34, in forward
            if h.sum() > 0:

        Locals:
            h: ['Tensor(shape: torch.Size([2, 8]), stride: (8, 1), storage_offset: 0)']

    And the following framework stacktrace: 
        File /venv/lib/python3.11/site-packages/torch/_export/non_strict_utils.py, lineno 1205, in __torch_function__

2. Missing fake kernel.
    torch.ops.mylib.mystery.default is missing a fake kernel implementation.

3. Data dependent error.
    When exporting, we were unable to evaluate the value of `Eq(u9, 1)`.
    This was encountered 5 times.
    This occurred at the following user stacktrace: 
        File /zoo/blocks.py, lineno 34, in forward
            if h.sum() > 0:

4. Data dependent error.
    When exporting, we were unable to evaluate the value of `u0`.
    This was encountered 1 times.
    This occurred at the following user stacktrace: 
        File /zoo/router.py, lineno 80, in forward
            choice = int(x.argmax())
"""


def test_a_draft_export_report_is_grouped_by_the_same_signature() -> None:
    issues = draft_issues(DRAFT)
    assert [(d.subject, d.where, d.issues, d.occurrences) for d in issues] == [
        ("data-dependent Eq(u, 1)", "blocks:forward", 2, 7),
        ("data-dependent u", "router:forward", 1, 1),
        ("op mylib::mystery", "-", 1, 1),
    ]
    assert issues[0].code == "if h.sum() > 0:"
