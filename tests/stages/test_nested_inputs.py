"""Inputs beyond one tensor per argument: scalars, strings, None, lists, tuples and dicts (nested),
*args and **kwargs, given tensors; a dynamic dim inside a container; open range bounds; input
mutation in validation; the static-fallback switch; torch's full decomposition registry."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pt2flow.stages import program
from pt2flow.stages.decompose import decompose, registry_decompositions
from pt2flow.stages.errors import StageError
from pt2flow.stages.options import DecomposeOptions, FunctionalizeOptions, TraceOptions, ValidateOptions
from pt2flow.stages.functionalize import functionalize
from pt2flow.stages.serialize import serialize
from pt2flow.stages.binding import bind_inputs, export_dynamic_shapes
from pt2flow.stages.example_inputs import InputSpec, ModelInputs
from pt2flow.stages.trace import trace
from pt2flow.stages.validate import validate


class Mixed(torch.nn.Module):
    """Every kind of input at once; `xs[0]` has a dynamic batch."""

    def forward(
        self, xs: list, pair: tuple, cfg: dict, scale: float, steps: int, flag: bool, mode: str, extra: Any = None
    ) -> torch.Tensor:
        out = xs[0] * scale + xs[1].sum()
        out = out + pair[0] * pair[1]["w"]
        for _ in range(steps):
            out = out + cfg["bias"]
        if flag and mode == "double":
            out = out * 2
        return out if extra is None else out + 1


def mixed_inputs() -> ModelInputs:
    return ModelInputs(
        {
            "xs": [InputSpec((4, 3)), InputSpec((2,))],
            "pair": (InputSpec((3,)), {"w": InputSpec((), value=0.5)}),
            "cfg": {"bias": InputSpec((3,), value=1.0)},
            "scale": 2.0,
            "steps": 2,
            "flag": True,
            "mode": "double",
            "extra": None,
        },
        {"xs": [{0: "batch"}, None]},
        {"batch": (1, 9)},
    )


def _pipeline(model: torch.nn.Module, inputs: ModelInputs, **trace_options: Any) -> tuple[Any, Any]:
    tr = trace(model, inputs, TraceOptions(**trace_options))
    fn = functionalize(tr.output, FunctionalizeOptions())
    return tr, decompose(fn.output, DecomposeOptions())


def test_every_input_kind_is_made_and_bound() -> None:
    bound = bind_inputs(Mixed(), mixed_inputs(), seed=1)
    xs, pair, cfg, scale, steps, flag, mode, extra = bound.args
    assert isinstance(xs, list) and xs[0].shape == (4, 3) and xs[1].shape == (2,)
    assert isinstance(pair, tuple) and float(pair[1]["w"]) == 0.5
    assert torch.equal(cfg["bias"], torch.ones(3))
    assert (scale, steps, flag, mode, extra) == (2.0, 2, True, "double", None)
    resized = bind_inputs(Mixed(), mixed_inputs(), seed=1, dim_sizes={"batch": 7})
    assert resized.args[0][0].shape == (7, 3) and resized.args[0][1].shape == (2,)
    spec = export_dynamic_shapes(mixed_inputs(), bound)
    assert spec is not None and spec[0][0][0].__name__ == "batch" and spec[0][1] is None
    assert isinstance(spec[1], tuple) and spec[1][1] == {"w": None}  # containers mirror their input


def test_a_dynamic_dim_inside_a_list_stays_dynamic_and_validates_at_min_and_max() -> None:
    tr, dec = _pipeline(Mixed(), mixed_inputs())
    assert tr.metadata["strategy"] == "configured" and tr.metadata["static_fallback"] is False
    assert tr.metadata["dims"]["batch"] == {"min": 1, "max": 9, "static": False, "value": None}
    report = validate(
        Mixed, mixed_inputs(), tr.metadata["dims"], ValidateOptions(samples=3), archive=serialize(dec.output, {}).output
    ).output
    assert report["passed"] is True
    assert [p["sizes"] for p in report["plan"]] == [{}, {"batch": 1}, {"batch": 9}]


def test_args_and_kwargs_parameters_take_a_list_and_extra_names() -> None:
    class Varargs(torch.nn.Module):
        def forward(self, a: torch.Tensor, *rest: torch.Tensor, k: torch.Tensor, **named: torch.Tensor) -> torch.Tensor:
            return a + sum(rest) + k * named["gain"]

    inputs = ModelInputs(
        {
            "a": InputSpec((2,)),
            "rest": [InputSpec((2,)), InputSpec((2,))],
            "k": InputSpec((2,)),
            "gain": InputSpec((), value=3.0),
        }
    )
    bound = bind_inputs(Varargs(), inputs)
    assert len(bound.args) == 3 and set(bound.kwargs) == {"k", "gain"}
    assert bound.order == ("a", "rest", "k", "named")
    tr, _ = _pipeline(Varargs(), inputs)
    assert tr.metadata["strategy"] == "configured"
    with pytest.raises(StageError, match=r"\*rest: give it a list") as info:
        bind_inputs(Varargs(), ModelInputs({"a": InputSpec((2,)), "rest": InputSpec((2,)), "k": InputSpec((2,))}))
    assert info.value.error_class == "config"


def test_given_tensors_are_used_as_they_are_and_resized_for_other_samples() -> None:
    given = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    inputs = ModelInputs(
        {
            "xs": [given, torch.ones(2)],
            "pair": (torch.ones(3), {"w": torch.tensor(0.5)}),
            "cfg": {"bias": torch.zeros(3)},
            "scale": 1.0,
            "steps": 1,
            "flag": False,
            "mode": "x",
        },
        {"xs": [{0: "batch"}, None]},
        {"batch": (1, 9)},
    )
    example = bind_inputs(Mixed(), inputs)
    assert torch.equal(example.args[0][0], given) and example.args[0][0] is not given  # a copy
    other = bind_inputs(Mixed(), inputs, dim_sizes={"batch": 5})
    assert other.args[0][0].shape == (5, 3) and other.args[0][1].shape == (2,)


def test_a_dims_tree_that_does_not_mirror_the_input_is_a_config_error() -> None:
    inputs = ModelInputs({"xs": [InputSpec((4, 3))]}, {"xs": {0: "batch"}}, {"batch": (1, 9)})

    class One(torch.nn.Module):
        def forward(self, xs: list) -> torch.Tensor:
            return xs[0]

    with pytest.raises(StageError, match=r"dynamic_shapes\.xs: a list of 1 takes a list of 1") as info:
        bind_inputs(One(), inputs)
    assert info.value.error_class == "config"


def test_unbounded_and_unbacked_symbols_are_open_bounds() -> None:
    class Item(torch.nn.Module):
        def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            k = n.item()
            return x * k

    tr = trace(Item(), ModelInputs({"x": InputSpec((3,)), "n": InputSpec((), dtype="int64", value=4)}), TraceOptions())
    ranges = tr.metadata["range_constraints"]
    assert ranges and all(bounds == [None, None] for bounds in ranges.values()), ranges


class Mutates(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x.cos()


class DoesNotMutate(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).cos()


def test_input_mutation_validates_and_the_mutated_input_is_compared() -> None:
    inputs = ModelInputs({"x": InputSpec((3, 2))})
    tr, dec = _pipeline(Mutates(), inputs)
    kinds = [s.kind.name for s in dec.output.graph_signature.output_specs]
    assert "USER_INPUT_MUTATION" in kinds
    report = validate(
        Mutates, inputs, tr.metadata["dims"], ValidateOptions(), archive=serialize(dec.output, {}).output
    ).output
    assert report["passed"] is True and report["nondeterministic"] is False
    # an artifact with the same outputs that leaves its input alone is caught by the input comparison
    _, plain = _pipeline(DoesNotMutate(), inputs)
    with pytest.raises(StageError) as info:
        validate(
            Mutates, inputs, tr.metadata["dims"], ValidateOptions(samples=1), archive=serialize(plain.output, {}).output
        )
    assert info.value.error_class == "numeric_mismatch"
    failures = info.value.details["candidates"]["archive"]["samples"][0]["failures"]
    assert failures and all(f.startswith("input ") for f in failures), failures


class CountsCalls(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x + self.calls


def test_mutated_buffers_are_compared_after_every_call() -> None:
    inputs = ModelInputs({"x": InputSpec((2,))})
    tr, dec = _pipeline(CountsCalls(), inputs)
    report = validate(
        CountsCalls, inputs, tr.metadata["dims"], ValidateOptions(samples=3), archive=serialize(dec.output, {}).output
    ).output
    assert report["passed"] is True  # outputs x+1, x+2, x+3 and the buffer 1, 2, 3 in both
    ep = dec.output
    with torch.no_grad():
        ep.state_dict["calls"].fill_(10.0)  # the archive starts from another count
    with pytest.raises(StageError) as info:
        validate(CountsCalls, inputs, tr.metadata["dims"], ValidateOptions(samples=1), archive=serialize(ep, {}).output)
    failures = info.value.details["candidates"]["archive"]["samples"][0]["failures"]
    assert any(f.startswith("buffer ['calls']") for f in failures), failures


class Rounds(torch.nn.Module):
    """ExportDB's dynamic_shape_round: round() of a dynamic size cannot be traced symbolically."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[: round(x.shape[0] / 2)]


def test_static_fallback_is_recorded_and_can_be_forbidden() -> None:
    inputs = ModelInputs({"x": InputSpec((6, 2))}, {"x": {0: "batch"}}, {"batch": (2, 16)})
    tr = trace(Rounds(), inputs, TraceOptions())
    assert tr.metadata["strategy"] == "static" and tr.metadata["static_fallback"] is True
    assert tr.metadata["specialized_dims"] == ["batch"]
    with pytest.raises(StageError) as info:
        trace(Rounds(), inputs, TraceOptions(fallback={"static": False}))
    assert info.value.error_class == "dynamic_shape"
    assert "static fallback forbidden" in info.value.message
    assert [a["strategy"] for a in info.value.attempts] == ["configured", "other_strictness"]
    assert TraceOptions(fallback=False).allows("static") is False and TraceOptions().allows("static") is True


def test_ops_the_default_table_leaves_are_looked_up_in_torchs_registry() -> None:
    class Hard(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.hardswish(x)

    ep = functionalize(
        trace(Hard(), ModelInputs({"x": InputSpec((4,))}), TraceOptions()).output, FunctionalizeOptions()
    ).output
    table = torch.export.default_decompositions()
    table.pop(torch.ops.aten.hardswish.default)  # as if torch's default table left it
    left = ep.run_decompositions(table)
    stray = program.non_core_ops(left)
    assert stray == ["aten.hardswish.default"]
    found = registry_decompositions(left, stray, table)
    assert list(found) == [torch.ops.aten.hardswish.default]
    table.update(found)
    assert program.non_core_ops(ep.run_decompositions(table)) == []


def test_an_op_torch_cannot_decompose_fails_with_its_name() -> None:
    @torch.library.custom_op("pt2flow_test::opaque", mutates_args=())
    def opaque(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @opaque.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    class Opaque(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return opaque(x) + 1

    ep = functionalize(
        trace(Opaque(), ModelInputs({"x": InputSpec((4,))}), TraceOptions()).output, FunctionalizeOptions()
    ).output
    with pytest.raises(StageError) as info:
        decompose(ep, DecomposeOptions())
    assert info.value.error_class == "decomposition"
    assert "pt2flow_test.opaque.default" in info.value.message and "torch has no decomposition" in info.value.message
