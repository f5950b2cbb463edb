"""Damaged and unknown blobs never reach torch.

- The store of a real `pt2flow run`, its archive blob bit-flipped, truncated, swapped for another
  valid archive or extended: the pipeline's validate task (re-run with a new atol, so not cached)
  fails with a `storage` error naming the corrupt blob, and torch's loaders are never called.
- A second real run on a store whose archive was corrupted does not reuse it: serialize runs again
  and validate passes.
- An archive or package whose digest the index does not vouch for (no record, a failed record,
  a record of another stage) is never loaded, even when its bytes are a perfectly good archive.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest

from pt2flow.storage import ArtifactStore, IntegrityError, RecordNotFound
from tests.conftest import run_json, write_config
from tests.security.conftest import MLP, STAGES, SecurityRun, call_validate, record


def blob_file(store_dir: Path, digest: str) -> Path:
    return store_dir / "blobs" / "sha256" / digest[:2] / digest


def ok_row(store_dir: Path, digest: str) -> dict:
    store = ArtifactStore(str(store_dir))
    rows = store.index.read(None, filter=(pc.field("sha256") == digest) & (pc.field("status") == "ok")).to_pylist()
    assert rows, digest
    return rows[0]


def damage(store_dir: Path, digest: str, how: str, other: str) -> None:
    path = blob_file(store_dir, digest)
    data = path.read_bytes()
    if how == "bit-flip":
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x10
        data = bytes(flipped)
    elif how == "truncated":
        data = data[: len(data) - 100]
    elif how == "swapped":  # another valid torch archive (the trace program): torch would load it happily
        data = blob_file(store_dir, other).read_bytes()
    elif how == "extended":
        data = data + b"\x00" * 64
    path.chmod(0o644)
    path.write_bytes(data)


@pytest.mark.integration
@pytest.mark.parametrize("how", ["bit-flip", "truncated", "swapped", "extended"])
def test_validate_refuses_a_damaged_archive_before_torch_sees_it(
    security_run: SecurityRun, tmp_path: Path, no_torch_loads: list[str], how: str
) -> None:
    store_dir = security_run.copy_store(tmp_path / "store")
    mlp = security_run.model("mlp")
    digest = mlp["artifacts"]["serialized"]
    row = ok_row(store_dir, digest)
    damage(store_dir, digest, how, other=mlp["stages"]["trace"]["artifact"])

    outcome = call_validate(
        str(store_dir), archive={"artifact": digest, "size": row["size"], "key": row["key"]}, atol=2e-5
    )
    assert outcome["status"] == "failed"
    assert outcome["error_class"] == "storage"
    assert f"blob {digest} is corrupt" in outcome["error"]
    assert no_torch_loads == []
    # and the failure is on record
    failed = (
        ArtifactStore(str(store_dir))
        .index.read(None, filter=(pc.field("stage") == "validate") & (pc.field("status") == "failed"))
        .to_pylist()
    )
    assert [(r["error_class"], r["error_message"]) for r in failed] == [("storage", outcome["error"])]


@pytest.mark.integration
def test_validate_on_the_undamaged_store_loads_the_archive(
    security_run: SecurityRun, tmp_path: Path, no_torch_loads: list[str]
) -> None:
    """The control for the test above: same call, intact blob, the archive loads and validates."""
    store_dir = security_run.copy_store(tmp_path / "store")
    digest = security_run.model("mlp")["artifacts"]["serialized"]
    row = ok_row(store_dir, digest)
    outcome = call_validate(
        str(store_dir), archive={"artifact": digest, "size": row["size"], "key": row["key"]}, atol=2e-5
    )
    assert outcome["status"] == "ok", outcome.get("error")
    assert no_torch_loads == ["torch.export.load"]


@pytest.mark.integration
def test_a_second_run_does_not_reuse_a_corrupted_archive(security_run: SecurityRun, tmp_path: Path) -> None:
    store_dir = security_run.copy_store(tmp_path / "store")
    mlp = security_run.model("mlp")
    digest = mlp["artifacts"]["serialized"]
    damage(store_dir, digest, "bit-flip", other="")
    config = write_config(tmp_path / "again.yaml", [{**MLP, "stages": {"validate": {"atol": 2e-5}}}], stages=STAGES)
    code, doc, stderr = run_json(["run", str(config), "--store", str(store_dir)], timeout=600)
    assert code == 0, stderr[-3000:]
    (model,) = doc["models"]
    stages = model["stages"]
    assert stages["trace"]["cached"] is True
    assert stages["serialize"]["cached"] is False  # the corrupt blob is not a cache hit
    assert stages["validate"]["cached"] is False and stages["validate"]["status"] == "ok"
    assert model["validation"]["passed"] is True
    new = model["artifacts"]["serialized"]
    ArtifactStore(str(store_dir)).get_blob(new)  # what validate loaded verifies


# ---------------------------------------------------------------------------------------------
# digests the index does not vouch for


@pytest.fixture
def archive_blob(tmp_path: Path) -> tuple[str, ArtifactStore, str, int]:
    """A store holding a good, loadable torch archive that no index record mentions."""
    import torch

    from pt2flow.stages.serialize import serialize
    from tests.models import tiny_mlp

    torch.manual_seed(0)  # the weights validate's eager reference gets (build_model seeds 0)
    ep = torch.export.export(tiny_mlp().eval(), (torch.randn(3, 8),))
    url = str(tmp_path / "store")
    store = ArtifactStore(url)
    ref = store.put_blob(serialize(ep, {}).output)
    return url, store, ref.digest, ref.size


@pytest.mark.parametrize("vouch", ["no-record", "failed-record", "other-stage"])
def test_an_archive_the_index_does_not_vouch_for_is_never_loaded(
    archive_blob, no_torch_loads: list[str], vouch: str
) -> None:
    from pt2flow.flows.engine.worker.artifacts import load_artifact

    url, store, digest, size = archive_blob
    if vouch == "failed-record":
        record(store, digest, size, "serialize", status="failed")
    elif vouch == "other-stage":
        record(store, digest, size, "validate")
    with pytest.raises(RecordNotFound, match=f"archive {digest} has no ok serialize record in the index"):
        load_artifact(store, digest, size, ("serialize",), "archive")
    outcome = call_validate(url, archive={"artifact": digest, "size": size, "key": "k"})
    assert outcome["status"] == "failed" and outcome["error_class"] == "storage"
    assert "has no ok serialize record in the index" in outcome["error"]
    assert no_torch_loads == []


def test_a_workers_own_blob_loads_without_a_record_only_for_its_stage_and_store(archive_blob, tmp_path: Path) -> None:
    """artifacts.vouch: the process that published a blob may load it back for the model's next
    stage without an index query; for another stage or another store the index must vouch."""
    from pt2flow.flows.engine.worker.artifacts import _OWN, load_artifact, vouch

    url, store, digest, size = archive_blob
    try:
        vouch(store, digest, "serialize")
        assert load_artifact(store, digest, size, ("serialize",), "archive") == store.get_blob(digest, size)
        with pytest.raises(RecordNotFound, match="has no ok aot_compile record"):
            load_artifact(store, digest, size, ("aot_compile",), "package")
        elsewhere = ArtifactStore(str(tmp_path / "other-store"))
        elsewhere.put_blob(store.get_blob(digest, size))
        with pytest.raises(RecordNotFound, match="has no ok serialize record"):
            load_artifact(elsewhere, digest, size, ("serialize",), "archive")
        # still read back verified: a changed blob is refused even though this process made it
        path = next(p for p in Path(url).rglob(digest + "*") if p.is_file())
        path.chmod(0o644)
        path.write_bytes(b"PK\x03\x04 not what was published")
        with pytest.raises(IntegrityError):
            load_artifact(store, digest, size, ("serialize",), "archive")
    finally:
        _OWN.clear()


def test_a_package_the_index_does_not_vouch_for_is_never_loaded(archive_blob, no_torch_loads: list[str]) -> None:
    url, store, digest, size = archive_blob
    record(store, digest, size, "serialize")  # vouched for as an archive, not as a package
    outcome = call_validate(url, package={"artifact": digest, "size": size, "key": "k"})
    assert outcome["error_class"] == "storage"
    assert f"package {digest} has no ok aot_compile record in the index" in outcome["error"]
    assert no_torch_loads == []


def test_an_archive_the_index_vouches_for_is_loaded(archive_blob, no_torch_loads: list[str]) -> None:
    """The control: once an ok serialize record names it, the same blob goes through and validates."""
    url, store, digest, size = archive_blob
    record(store, digest, size, "serialize")
    outcome = call_validate(url, archive={"artifact": digest, "size": size, "key": "k"})
    assert outcome["status"] == "ok", outcome.get("error")
    assert no_torch_loads == ["torch.export.load"]
