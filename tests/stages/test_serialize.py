"""serialize: torch.export.save bytes, pt2flow metadata in extra_files, a checked round trip."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import re
import zipfile

import pytest
import torch

from pt2flow.stages import program
from pt2flow.stages import serialize as serialize_module
from pt2flow.stages.errors import StageError
from pt2flow.stages.serialize import METADATA_FILE, load_archive, program_bytes, roundtrip_differences, serialize
from tests import models
from tests.stages.helpers import builder, decomposed, functional, mlp_inputs, regressor_inputs

METADATA = {"pt2flow_version": "0.0.test", "program_fingerprint": "ab" * 32, "nested": {"k": [1, 2]}}


@pytest.fixture(scope="module")
def mlp_program() -> torch.export.ExportedProgram:
    return decomposed(builder(models.tiny_mlp), mlp_inputs(1, 16))[1].output


def test_archive_loads_back_with_torch_export_load(mlp_program: torch.export.ExportedProgram) -> None:
    result = serialize(mlp_program, METADATA)
    data = result.output
    assert isinstance(data, bytes) and zipfile.is_zipfile(io.BytesIO(data))
    extra = {METADATA_FILE: ""}
    loaded = torch.export.load(io.BytesIO(data), extra_files=extra)
    assert json.loads(extra[METADATA_FILE]) == METADATA
    # same program: ops, signature, dynamic range, weights; same function at any batch in range
    assert program.op_histogram(loaded) == program.op_histogram(mlp_program)
    assert program.range_constraints(loaded) == program.range_constraints(mlp_program)
    assert list(program.range_constraints(loaded).values()) == [[1, 16]]
    for batch in (1, 5, 16):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(loaded.module()(x), mlp_program.module()(x), rtol=0, atol=0)


def test_metadata_file_sits_in_the_archive(mlp_program: torch.export.ExportedProgram) -> None:
    data = serialize(mlp_program, METADATA).output
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = [n for n in archive.namelist() if n.endswith("/" + METADATA_FILE)]
        assert len(names) == 1 and "/extra/" in names[0]
        assert json.loads(archive.read(names[0])) == METADATA


def test_result_metadata(mlp_program: torch.export.ExportedProgram) -> None:
    result = serialize(mlp_program, METADATA)
    assert result.metadata["size"] == len(result.output)
    assert result.metadata["fingerprint"] == program.fingerprint(mlp_program)
    loaded, meta = load_archive(result.output)
    assert meta == METADATA
    assert program.fingerprint(loaded) == result.metadata["fingerprint"]  # stable across save/load
    assert result.metadata["op_histogram"] == {
        "aten.addmm.default": 2,
        "aten.permute.default": 2,
        "aten.relu.default": 1,
    }


def test_program_bytes_have_no_pt2flow_metadata(mlp_program: torch.export.ExportedProgram) -> None:
    loaded, meta = load_archive(program_bytes(mlp_program))
    assert meta == {}
    assert program.fingerprint(loaded) == program.fingerprint(mlp_program)


def test_buffer_mutations_survive_the_round_trip() -> None:
    ep = functional(builder(models.buffer_counter), mlp_inputs()).output
    loaded, _ = load_archive(serialize(ep, {}).output)
    assert program.mutated_buffers_in_signature(loaded) == {"calls", "ema"}
    eager, module = builder(models.buffer_counter)(), loaded.module()
    for batch in (4, 3):
        x = torch.randn(batch, 8)
        with torch.no_grad():
            torch.testing.assert_close(module(x), eager(x))
    torch.testing.assert_close(module.ema, eager.ema)


def test_joint_program_round_trip_returns_loss_and_gradients() -> None:
    joint = functional(
        builder(models.regressor, training=True, loss_output=0), regressor_inputs(), mode="training"
    ).output
    loaded, _ = load_archive(serialize(joint, {}).output)
    x, y = torch.randn(6, 4), torch.randn(6)
    loss, grads = loaded.module()(x, y)
    ref_loss, ref_grads = joint.module()(x, y)
    torch.testing.assert_close(loss, ref_loss)
    assert sorted(grads) == sorted(ref_grads) and len(grads) == 6
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name])


def test_roundtrip_differences_names_what_changed(mlp_program: torch.export.ExportedProgram) -> None:
    assert roundtrip_differences(mlp_program, mlp_program) == []
    other = copy.deepcopy(mlp_program)
    with torch.no_grad():
        other.state_dict["fc1.weight"].add_(1.0)
    assert roundtrip_differences(mlp_program, other) == ["state_dict[fc1.weight]"]
    undecomposed = functional(builder(models.tiny_mlp), mlp_inputs(1, 16)).output
    problems = roundtrip_differences(mlp_program, undecomposed)
    assert problems and problems[0].startswith("op histogram")
    assert "aten.linear.default" in problems[0]


def test_a_round_trip_that_changes_the_program_is_a_serialization_error(
    monkeypatch: pytest.MonkeyPatch, mlp_program: torch.export.ExportedProgram
) -> None:
    undecomposed = functional(builder(models.tiny_mlp), mlp_inputs(1, 16)).output
    monkeypatch.setattr(serialize_module, "load_archive", lambda data: (undecomposed, METADATA))
    with pytest.raises(StageError) as info:
        serialize(mlp_program, METADATA)
    assert info.value.error_class == "serialization"
    assert "differs from the saved one" in info.value.message
    assert "op histogram" in info.value.message


def test_lost_metadata_is_a_serialization_error(
    monkeypatch: pytest.MonkeyPatch, mlp_program: torch.export.ExportedProgram
) -> None:
    monkeypatch.setattr(serialize_module, "load_archive", lambda data: (mlp_program, {}))
    with pytest.raises(StageError) as info:
        serialize(mlp_program, METADATA)
    assert info.value.error_class == "serialization"
    assert "metadata" in info.value.message


def test_a_save_failure_is_a_serialization_error(
    monkeypatch: pytest.MonkeyPatch, mlp_program: torch.export.ExportedProgram
) -> None:
    def broken_save(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(torch.export, "save", broken_save)
    with pytest.raises(StageError) as info:
        serialize(mlp_program, METADATA)
    assert info.value.error_class == "serialization"
    assert "disk on fire" in info.value.message


_LOAD_IN_A_FRESH_PROCESS = (
    "import sys; from pt2flow.stages.serialize import load_archive\n"
    "data = open(sys.argv[1], 'rb').read()\n"
    "try:\n"
    "    ep, _ = load_archive(data, import_pytree_modules=sys.argv[2] == 'import')\n"
    "    print('loaded', type(ep.module()(__import__('torch').ones(2))).__qualname__)\n"
    "except Exception as exc:\n"
    "    print('failed', exc)\n"
)


def _load_elsewhere(path, mode: str) -> str:
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_A_FRESH_PROCESS, str(path), mode],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.mark.integration  # a fresh process
def test_the_archive_names_the_modules_of_its_pytree_types_and_loads_in_a_fresh_process(tmp_path) -> None:
    from tests.pytree_models import point_output

    ep = torch.export.export(point_output(), (torch.ones(2),))
    data = serialize(ep, {"run": "r"}).output
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/extra/" + METADATA_FILE)]
        assert json.loads(archive.read(name)) == {"run": "r", "pytree_modules": ["tests.pytree_models"]}
    (tmp_path / "named.pt2").write_bytes(data)
    assert _load_elsewhere(tmp_path / "named.pt2", "import") == "loaded Point"
    assert "not registered" in _load_elsewhere(tmp_path / "named.pt2", "no-import")


@pytest.mark.integration  # a fresh process
def test_an_archive_that_names_no_modules_loads_by_its_type_names(tmp_path) -> None:
    """An archive from before serialize v2 (or not from pt2flow): the modules are guessed from the
    serialized type names of its treespecs ("module.Class")."""
    from tests.pytree_models import point_output

    buffer = io.BytesIO()
    torch.export.save(torch.export.export(point_output(), (torch.ones(2),)), buffer, extra_files={METADATA_FILE: "{}"})
    (tmp_path / "old.pt2").write_bytes(buffer.getvalue())
    assert serialize_module._spec_type_names(buffer.getvalue()) >= {"tests.pytree_models.Point"}
    assert _load_elsewhere(tmp_path / "old.pt2", "import") == "loaded Point"
    assert "not registered" in _load_elsewhere(tmp_path / "old.pt2", "no-import")


def _graph_ids(ep: torch.export.ExportedProgram) -> list[int]:
    ids = []
    pending = [s for node in ep.graph.nodes for s in node.meta.get("from_node") or []]
    while pending:
        source = pending.pop()
        ids.append(source.graph_id)
        pending.extend(source.from_node)
    return ids


def test_the_same_program_exported_twice_saves_to_the_same_bytes() -> None:
    """Two exports of one model (graphs at different addresses, as in two processes) give the
    same archive bytes, hence the same content ID; the program keeps its own provenance ids."""
    make = builder(models.tiny_mlp)
    first = decomposed(make, mlp_inputs(1, 16))[1].output
    second = decomposed(make, mlp_inputs(1, 16))[1].output
    before = _graph_ids(first)
    assert before and set(before).isdisjoint(_graph_ids(second))  # the addresses differ
    a, b = serialize(first, METADATA).output, serialize(second, METADATA).output
    assert a == b
    assert program_bytes(first) != program_bytes(second)  # what torch.export.save alone writes
    assert _graph_ids(first) == before  # restored after saving
    loaded = load_archive(a)[0]
    saved = sorted(set(_graph_ids(loaded)))
    assert saved == list(range(len(saved)))  # numbered in order of first appearance
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded.module()(x), first.module()(x))


def test_a_program_through_generated_fx_code_saves_to_the_same_bytes_whatever_the_process_compiled_before() -> None:
    """ExportDB's cond_closed_over_variable: its nodes' stack traces pass through code FX
    generated, named `<eval_with_key>.N` with N counting the graphs the process compiled. The
    same model exported after other work (as in a worker that ran other models first) must save
    to the same bytes; the stack trace keeps its frames, without the counter."""
    from torch._export.db.examples import all_examples

    case = all_examples()["cond_closed_over_variable"]

    def export() -> torch.export.ExportedProgram:
        return torch.export.export(copy.deepcopy(case.model), case.example_args, strict=False).run_decompositions()

    first = export()
    traces = [n.meta.get("stack_trace") or "" for n in first.graph.nodes]
    assert any("<eval_with_key>." in t for t in traces)
    for _ in range(3):  # the process compiles more graphs: the counter moves on
        torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    second = export()
    assert [n.meta.get("stack_trace") for n in first.graph.nodes] != [
        n.meta.get("stack_trace") for n in second.graph.nodes
    ]
    a, b = serialize(first, METADATA).output, serialize(second, METADATA).output
    assert a == b
    assert [n.meta.get("stack_trace") or "" for n in first.graph.nodes] == traces  # restored after saving
    saved = (
        zipfile.ZipFile(io.BytesIO(a))
        .read(next(n for n in zipfile.ZipFile(io.BytesIO(a)).namelist() if n.endswith("models/model.json")))
        .decode()
    )
    assert "<eval_with_key>" in saved and re.search(r"<eval_with_key>\.\d", saved) is None


@dataclasses.dataclass
class Batch:
    """A model input of a class of this module, registered as a pytree (as a user's dataclass is)."""

    features: torch.Tensor
    scale: torch.Tensor


torch.export.register_dataclass(Batch, serialized_type_name=f"{__name__}.Batch")


class _Scaled(torch.nn.Module):
    def forward(self, batch: Batch) -> torch.Tensor:
        return batch.features * batch.scale


def _with_pickle(data: bytes, entry: str, payload: bytes) -> bytes:
    """The archive with one entry's bytes replaced (the rest copied as they are, each in its place)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            target.writestr(info, payload if info.filename == entry else source.read(info.filename))
    return out.getvalue()


class _Makes:
    """Unpickles by calling os.mkdir(path): what a hostile store could put in an archive's example inputs."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


def test_an_archive_of_a_registered_class_loads_under_weights_only_with_that_class_allowed() -> None:
    batch = Batch(torch.randn(2, 3), torch.tensor(2.0))
    data = serialize(torch.export.export(_Scaled(), (batch,)), {}).output
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        (pickled,) = [archive.read(n) for n in archive.namelist() if "/sample_inputs/" in n]
    # the premise: torch's weights_only rules alone refuse the example inputs (torch.export.load
    # would retry them with weights_only=False)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(pickled)) == [f"{__name__}.Batch"]
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(io.BytesIO(pickled), weights_only=True)
    assert serialize_module.pickled_classes(data) == [Batch]
    loaded, _ = load_archive(data)
    (example,), _ = loaded.example_inputs
    assert isinstance(example, Batch) and torch.equal(example.features, batch.features)
    torch.testing.assert_close(loaded.module()(batch), batch.features * 2.0)


@pytest.mark.parametrize("where", ["example inputs", "a weight"])
def test_an_archive_whose_pickle_names_a_call_is_refused_and_the_call_never_runs(
    mlp_program: torch.export.ExportedProgram, tmp_path, where: str
) -> None:
    """What a hostile store could hold: the example inputs, or a weight its config marks as
    pickled (torch.export.load unpickles those with weights_only=False), replaced by a pickle that
    calls os.mkdir."""
    data = serialize(mlp_program, METADATA).output
    made = tmp_path / "made-by-the-archive"
    payload = io.BytesIO()
    torch.save(((_Makes(str(made)),), {}), payload)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        if where == "example inputs":
            (entry,) = [n for n in names if "/sample_inputs/" in n]
            hostile = _with_pickle(data, entry, payload.getvalue())
        else:
            (config_name,) = [n for n in names if n.endswith("/weights/model_weights_config.json")]
            config = json.loads(archive.read(config_name))
            meta = next(iter(config["config"].values()))
            meta["use_pickle"] = True
            entry = config_name.rpartition("/")[0] + "/" + meta["path_name"]
            hostile = _with_pickle(
                _with_pickle(data, config_name, json.dumps(config).encode()), entry, payload.getvalue()
            )
    with pytest.raises(
        StageError,
        match=rf"{re.escape(entry.split('/data/')[1])} pickles posix\.mkdir: not a tensor subclass nor a class",
    ) as refused:
        load_archive(hostile)
    assert refused.value.error_class.value == "serialization" and not made.exists()
    # the ground truth: torch's own loader unpickles it, and the call runs
    with contextlib.suppress(Exception):
        torch.export.load(io.BytesIO(hostile))
    assert made.is_dir()


def test_a_program_loads_the_same_with_torchs_schema_type_hints_memoized(
    mlp_program: torch.export.ExportedProgram, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stages.serialize memoizes typing.get_type_hints for torch's export schema classes in torch's
    deserializer: installed under the pinned torch, answering every schema class from memory after
    its first load, and every program (a buffer-mutating one, a joint training program, a
    decomposed MLP) loading to the same program, fingerprint and outputs as with typing's own."""
    import typing

    from torch._export.serde import schema as serde_schema
    from torch._export.serde import serialize as serde

    memo = serialize_module.SCHEMA_TYPE_HINTS
    assert memo is not None and serde.typing is memo
    programs = [
        mlp_program,
        functional(builder(models.buffer_counter), mlp_inputs()).output,
        functional(builder(models.regressor, training=True, loss_output=0), regressor_inputs(), mode="training").output,
    ]
    for ep in programs:
        data = program_bytes(ep)
        monkeypatch.setattr(serde, "typing", typing)
        plain, _ = load_archive(data)
        monkeypatch.setattr(serde, "typing", memo)
        hits = memo.hits
        memoized, _ = load_archive(data)
        assert memo.hits > hits  # the load asked for hints and was answered from memory
        assert program.fingerprint(memoized) == program.fingerprint(plain)
        assert str(memoized.graph_module.code) == str(plain.graph_module.code)
        assert memoized.graph_signature == plain.graph_signature
    # the memo answers as typing does; a class outside the schema is not kept
    assert memo.get_type_hints(serde_schema.Node, vars(serde_schema)) == typing.get_type_hints(
        serde_schema.Node, globalns=vars(serde_schema)
    )
    kept = len(memo._hints)
    assert memo.get_type_hints(dataclasses.make_dataclass("Other", [("x", int)])) == {"x": int}
    assert len(memo._hints) == kept
    # typing's other attributes are typing's own, kept once read (torch reads them per field)
    assert memo.get_origin is typing.get_origin and memo.Union is typing.Union
    assert vars(memo)["get_origin"] is typing.get_origin
