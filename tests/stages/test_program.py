"""stages.program: the facts every program-producing stage reports, and the program fingerprint."""

from __future__ import annotations

import operator

import torch

from pt2flow.stages import program
from tests import models
from tests.stages.helpers import builder, functional, mlp_inputs, traced


def test_fingerprint_is_stable_across_exports_and_tracks_weights_and_graph() -> None:
    first = traced(builder(models.tiny_mlp), mlp_inputs()).output
    second = traced(builder(models.tiny_mlp), mlp_inputs()).output
    assert first is not second
    assert program.fingerprint(first) == program.fingerprint(second)
    with torch.no_grad():
        second.state_dict["fc2.bias"][0] += 1.0
    assert program.fingerprint(first) != program.fingerprint(second)
    narrower = traced(builder(models.tiny_mlp), mlp_inputs(1, 8)).output  # same graph, other range
    assert program.fingerprint(first) != program.fingerprint(narrower)


class _Scale(torch.nn.Module):
    """No weights, no dtype in any op's arguments: only the tensors' metadata says the dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


def test_fingerprint_tracks_the_dtype_of_a_program_whose_graph_is_otherwise_the_same() -> None:
    """A config switching its example input from float32 to float64 (or a half type) changes only
    the tensors' metadata: the fingerprint must change, or the float32 program's serialized and
    compiled artifacts would be served for the float64 one."""
    exported = {
        dtype: torch.export.export(_Scale(), (torch.ones(2, 3, dtype=dtype),))
        for dtype in (torch.float32, torch.float64, torch.bfloat16)
    }
    again = torch.export.export(_Scale(), (torch.zeros(2, 3, dtype=torch.float64),))  # other values, same program
    assert [op for op in program.op_histogram(exported[torch.float32])] == [
        op for op in program.op_histogram(exported[torch.float64])
    ]
    fingerprints = {dtype: program.fingerprint(ep) for dtype, ep in exported.items()}
    assert len(set(fingerprints.values())) == 3, fingerprints
    assert program.fingerprint(again) == fingerprints[torch.float64]


def test_op_names() -> None:
    assert program.op_name(torch.ops.aten.linear.default) == "aten.linear.default"
    assert program.op_name(operator.getitem) == "operator.getitem"
    assert program.op_name(torch.ops.higher_order.cond) == "higher_order.cond"


def test_core_aten_membership() -> None:
    assert program.is_core_aten("aten.addmm.default", torch.ops.aten.addmm.default)
    assert not program.is_core_aten("aten.linear.default", torch.ops.aten.linear.default)
    assert program.is_core_aten("operator.getitem", operator.getitem)
    assert program.is_core_aten("aten.sym_size.int", torch.ops.aten.sym_size.int)


def test_mutation_facts_before_and_after_functionalization() -> None:
    ep = traced(builder(models.buffer_counter), mlp_inputs()).output
    written = program.mutated_inputs(ep)
    assert program.buffer_targets_of(ep, written) == {"calls", "ema"}
    assert program.mutating_ops(ep) == ["aten.add_.Tensor", "aten.mul_.Tensor"]
    assert program.mutated_buffers_in_signature(ep) == set()
    functional_ep = functional(builder(models.buffer_counter), mlp_inputs()).output
    assert program.mutating_ops(functional_ep) == []
    assert program.mutated_buffers_in_signature(functional_ep) == {"calls", "ema"}


def test_effective_dims_dynamic_and_specialized() -> None:
    # a dim the program keeps dynamic reports its range; one it specialized (batch_of_four), its value
    ep = traced(builder(models.tiny_mlp), mlp_inputs(2, 9)).output
    assert program.effective_dims_of_leaves(ep, [{0: "batch"}]) == {
        "batch": {"min": 2, "max": 9, "static": False, "value": None}
    }
    static = traced(builder(models.batch_of_four), mlp_inputs()).output
    assert program.effective_dims_of_leaves(static, [{0: "batch"}]) == {
        "batch": {"min": 4, "max": 4, "static": True, "value": 4}
    }
