"""A program's identity is a pure function of the program (docs/architecture.md §5, "Program
fingerprint"): the fingerprint a stage records, that of the same program loaded back from its
bytes, and that of the next stage run on either are equal. One test per cause found on the
shipped configs (issue 29), each on a model that has it."""

from __future__ import annotations

import io
import json
import re
import zipfile

import torch
from torch import nn

from pt2flow.stages import program
from pt2flow.stages.example_inputs import InputSpec, ModelInputs
from pt2flow.stages.decompose import decompose
from pt2flow.stages.functionalize import functionalize
from pt2flow.stages.options import DecomposeOptions, FunctionalizeOptions, TraceOptions
from pt2flow.stages.serialize import load_archive, serialize, stored_program
from pt2flow.stages.trace import trace
from tests import models
from tests.stages.helpers import builder, regressor_inputs, traced


class Heads(nn.Module):
    """Attention heads split out of one projection (reshape, permute, unbind), as
    nn.TransformerEncoderLayer does: views whose strides are symbolic expressions."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        return (torch.softmax(q @ k.transpose(-1, -2), -1) @ v).reshape(b * s, 8)


HEADS_INPUTS = ModelInputs(
    {"x": InputSpec((2, 6, 8))}, {"x": {0: "batch", 1: "seq"}}, {"batch": (1, 8), "seq": (2, 32)}
)
TRAINING = FunctionalizeOptions(mode="training")


def _model_json(data: bytes) -> str:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("models/model.json"))).decode()


def test_the_identity_is_the_program_as_it_loads_back() -> None:
    """tiny-encoder's cause: torch's loader re-derives tensor metadata an export keeps in memory
    only (a stride `Min(32, 32*s72)` becomes 32, a storage offset 0), so the program in memory
    and the same program read from its blob had two fingerprints. The recorded one is the loaded
    program's, which loads back to itself."""
    ep = trace(Heads(), HEADS_INPUTS, TraceOptions()).output
    stored = stored_program(ep)
    assert program.fingerprint(ep) != stored.fingerprint  # the cause: the loader's form differs
    reloaded = load_archive(stored.data)[0]
    assert program.fingerprint(reloaded) == stored.fingerprint == program.fingerprint(stored.program)
    again = stored_program(reloaded)  # a program read from the store, stored again
    assert again.fingerprint == stored.fingerprint
    # so the serialize stage takes its parent's identity for its archive instead of taking it again
    archive = serialize(stored.program, {}).output
    assert program.fingerprint(load_archive(archive)[0]) == stored.fingerprint
    assert serialize(stored.program, {}, identity=stored.fingerprint).metadata["fingerprint"] == stored.fingerprint
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(stored.program.module()(x), ep.module()(x))


def test_the_next_stage_is_given_the_program_as_stored() -> None:
    """residual-regressor-train's cause: the joint forward+backward export of the traced program
    kept in memory reads the shared batch size off another input than that of the same program
    read back from the store (audit's rebuild, a warm run), another graph. The next stage is
    given the stored program, so both paths give one identity."""
    ep = traced(builder(models.regressor, training=True), regressor_inputs()).output
    stored = stored_program(ep)
    from_memory = stored_program(functionalize(ep, TRAINING).output)
    from_worker = stored_program(functionalize(stored.program, TRAINING).output)
    from_store = stored_program(functionalize(load_archive(stored.data)[0], TRAINING).output)
    assert from_memory.fingerprint != from_store.fingerprint  # the cause
    assert from_worker.fingerprint == from_store.fingerprint
    assert from_worker.data == from_store.data


class MseRegressor(nn.Module):
    """demo's residual-regressor-train in small: mse_loss, whose gradient divides by the dynamic
    batch size (a `sym_float` node in the core ATen joint program)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc(x).squeeze(-1), y)


def _provenance_targets(ep: torch.export.ExportedProgram) -> list[str]:
    found, pending = [], [s for n in ep.graph.nodes for s in n.meta.get("from_node") or []]
    while pending:
        source = pending.pop()
        found.append(source.target)
        pending.extend(source.from_node)
    return found


def test_an_archive_names_no_function_address() -> None:
    """A training archive had another ID in every store: torch writes the pass provenance of a
    node made from a Python function with the function's repr, `<function sym_float at 0x7f..>`.
    Saved without the address (the function's name stays); restored in memory afterwards."""
    ep = traced(builder(MseRegressor, training=True), regressor_inputs()).output
    joint = stored_program(functionalize(ep, TRAINING).output).program
    core = decompose(joint, DecomposeOptions()).output
    targets = _provenance_targets(core)
    assert any(re.fullmatch(r"<function sym_float at 0x[0-9a-f]+>", t) for t in targets), targets
    for data in (serialize(core, {}).output, stored_program(core).data):
        saved = _model_json(data)
        assert "<function sym_float>" in saved and re.search(r" at 0x[0-9a-f]+", saved) is None
    assert _provenance_targets(core) == targets


def test_the_canonical_form_is_torchs_serialized_form_without_its_self_check(monkeypatch) -> None:
    """canonical_program skips torch's check that the canonical form is well defined (its result
    is thrown away; torch.export.save runs it): the form is the same as with it, on a program with
    symbolic strides, and the check is really not run."""
    from torch._export.serde import serialize as serde

    stored = stored_program(trace(Heads(), HEADS_INPUTS, TraceOptions()).output)
    skipped = program.canonical_program(stored.program)
    checks = []
    real = serde.canonicalize

    def counted(*args, **kwargs):
        checks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(serde, "canonicalize", counted)
    assert program.canonical_program(stored.program) == skipped  # without the check inside
    assert checks == []
    with program._without_canonical_form_check():
        pass
    assert serde.canonicalize is counted  # put back as it was
    # torch's own serializer, check included, gives the same form
    full = serde.serialize(
        stored.program, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False
    )
    assert len(checks) == 1
    document = json.loads(full.exported_program)
    for name in program.VOLATILE_PROGRAM_FIELDS:
        document.pop(name, None)
    assert json.dumps(program._strip_volatile(document), sort_keys=True, separators=(",", ":")).encode() == skipped
