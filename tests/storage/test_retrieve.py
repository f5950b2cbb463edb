"""Taking artifacts out of the store (storage.retrieve, behind `pt2flow get`): by ID or by model,
only what an ok record vouches for, re-hashed and zip-checked, written atomically."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from pt2flow.storage import ArtifactStore, IntegrityError, RecordNotFound
from pt2flow.storage.errors import UnsafeArchive
from pt2flow.storage.retrieve import ArtifactKinds, ArtifactRequestError, copy_out, find_by_id, find_for_model
from tests.records import make_chain

# what the flows layer derives from its stages (storage knows none)
KINDS = ArtifactKinds(
    {"serialized": "serialize", "compiled": "aot_compile", "report": "validate"},
    frozenset({"serialize", "aot_compile"}),
)


def _zip(text: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.txt", text)
    return buffer.getvalue()


def _publisher(store: ArtifactStore):
    def blob(name: str) -> tuple[str, int]:
        data = _zip(name) if name.endswith(("serialize", "aot_compile")) else f'{{"name": "{name}"}}'.encode()
        ref = store.put_blob(data)
        return ref.digest, ref.size

    return blob


@pytest.fixture
def runs(store: ArtifactStore) -> dict:
    old = make_chain(store, "alpha", "run-1", None, salt="v1", offset=0, blob=_publisher(store))
    new = make_chain(store, "alpha", "run-2", None, salt="v2", offset=10, blob=_publisher(store))
    return {"old": old, "new": new}


def test_by_model_the_newest_ok_artifact_of_each_kind(store: ArtifactStore, runs: dict, tmp_path: Path) -> None:
    for kind, stage in (("serialized", "serialize"), ("compiled", "aot_compile"), ("report", "validate")):
        record = find_for_model(store.index, "alpha", kind, kinds=KINDS)
        assert record["sha256"] == runs["new"][stage]["sha256"]
        out = copy_out(store, record, str(tmp_path / f"{kind}.bin"), kinds=KINDS)
        assert out["artifact"] == kind and out["path"] == str(tmp_path / f"{kind}.bin")
        assert (tmp_path / f"{kind}.bin").read_bytes() == store.get_blob(record["sha256"])
    # --run picks that run's artifact; an unknown model or run is refused
    assert (
        find_for_model(store.index, "alpha", "serialized", "run-1", kinds=KINDS)["sha256"]
        == runs["old"]["serialize"]["sha256"]
    )
    with pytest.raises(RecordNotFound, match="no ok serialized artifact of model 'beta'"):
        find_for_model(store.index, "beta", "serialized", kinds=KINDS)
    with pytest.raises(RecordNotFound, match="in run run-9"):
        find_for_model(store.index, "alpha", "compiled", "run-9", kinds=KINDS)
    with pytest.raises(ArtifactRequestError, match="unknown artifact 'weights'"):
        find_for_model(store.index, "alpha", "weights", kinds=KINDS)


def test_by_id_only_what_an_ok_record_vouches_for(store: ArtifactStore, runs: dict) -> None:
    digest = runs["old"]["aot_compile"]["sha256"]
    assert find_by_id(store.index, digest[:10], kinds=KINDS)["stage"] == "aot_compile"
    assert find_by_id(store.index, digest, "compiled", kinds=KINDS)["sha256"] == digest
    with pytest.raises(ArtifactRequestError, match="compiled artifact of alpha, not its serialized"):
        find_by_id(store.index, digest, "serialized", kinds=KINDS)
    with pytest.raises(ArtifactRequestError, match="trace record of alpha, which has no artifact"):
        find_by_id(store.index, runs["old"]["trace"]["sha256"], kinds=KINDS)
    # a blob in the store that no record names
    stray = store.put_blob(_zip("stray")).digest
    with pytest.raises(RecordNotFound):
        find_by_id(store.index, stray, kinds=KINDS)
    # a digest whose only record is a failure
    failed = store.put_blob(b"draft export report").digest
    store.index.append(
        [{**runs["old"]["serialize"], "record_id": "f1", "status": "failed", "sha256": failed, "size": 19}]
    )
    with pytest.raises(RecordNotFound, match="only records are failures"):
        find_by_id(store.index, failed, kinds=KINDS)


def test_a_corrupt_or_unsafe_blob_is_refused_and_nothing_is_written(
    store: ArtifactStore, runs: dict, tmp_path: Path
) -> None:
    record = find_for_model(store.index, "alpha", "serialized", kinds=KINDS)
    out = tmp_path / "out"
    out.mkdir()
    target = out / "model.pt2"
    target.write_bytes(b"the previous copy")
    store.fs.pipe_file(store.blob_path(record["sha256"]), b"other bytes at the same path")  # same path, other bytes
    with pytest.raises(IntegrityError, match="corrupt"):
        copy_out(store, record, str(target), kinds=KINDS)
    assert target.read_bytes() == b"the previous copy"
    assert sorted(p.name for p in out.iterdir()) == ["model.pt2"]  # no temporary file left

    # bytes that hash right but are no zip (an index that vouches for something torch must not open)
    junk = store.put_blob(b"not a zip at all")
    with pytest.raises(UnsafeArchive):
        copy_out(store, {**record, "sha256": junk.digest, "size": junk.size}, str(target), kinds=KINDS)
    assert target.read_bytes() == b"the previous copy"


def test_destination_problems_are_named(store: ArtifactStore, runs: dict, tmp_path: Path) -> None:
    record = find_for_model(store.index, "alpha", "report", kinds=KINDS)
    with pytest.raises(ArtifactRequestError, match="is a directory"):
        copy_out(store, record, str(tmp_path), kinds=KINDS)
    with pytest.raises(ArtifactRequestError, match="no folder"):
        copy_out(store, record, str(tmp_path / "missing" / "report.json"), kinds=KINDS)
