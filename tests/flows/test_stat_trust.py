"""An unchanged re-run does not re-read big artifacts: a cache hit on a blob of 8 MiB or more
trusts the stat signature (size, mtime, ctime, inode; the ETag on S3) recorded when the blob was
last verified, as git's index does, and re-hashes it when the signature changed. Every read for
use verifies the bytes again; a corrupt blob is refused before torch sees it, and removed, so
that the next run rebuilds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pt2flow.flows.engine.worker.artifacts import load_artifact
from pt2flow.storage import ArtifactStore
from pt2flow.storage.errors import IntegrityError
from pt2flow.storage.store import TRUST_STAT_MIN_BYTES
from tests.conftest import run_in_process, write_config


def _flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every blob read (a spy: it counts, then reads for real)."""
    seen: list[str] = []
    real = ArtifactStore._read

    def spy(self: ArtifactStore, digest: str) -> bytes:
        seen.append(digest)
        return real(self, digest)

    monkeypatch.setattr(ArtifactStore, "_read", spy)
    return seen


def test_a_big_blob_with_its_recorded_signature_is_not_read(tmp_path: Path, reads: list[str]) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    ref = store.put_blob(b"\x01" * TRUST_STAT_MIN_BYTES)
    signature = store.blob_signature(ref.digest)
    reads.clear()
    assert store.blob_status_trusting(ref.digest, ref.size, signature) == ("ok", signature)
    assert reads == []  # trusted: not a byte read
    assert store.blob_status_trusting(ref.digest, ref.size, None)[0] == "ok"
    assert reads == [ref.digest]  # no recorded signature: re-hashed


def test_a_small_blob_is_always_re_hashed(tmp_path: Path, reads: list[str]) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    ref = store.put_blob(b"small artifact")
    signature = store.blob_signature(ref.digest)
    reads.clear()
    assert store.blob_status_trusting(ref.digest, ref.size, signature)[0] == "ok"
    assert reads == [ref.digest]


def test_a_blob_rewritten_in_place_changes_its_signature_and_is_re_hashed(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    ref = store.put_blob(b"\x02" * TRUST_STAT_MIN_BYTES)
    signature = store.blob_signature(ref.digest)
    path = Path(store.blob_path(ref.digest))
    _flip_a_byte(path)  # same size and inode; the ctime moves even if the mtime were put back
    status, current = store.blob_status_trusting(ref.digest, ref.size, signature)
    assert status == "corrupt" and current != signature


def test_a_corrupt_blob_is_refused_before_torch_and_removed(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    ref = store.put_blob(b"PK\x05\x06" + b"\x00" * 18)  # an empty zip
    store.index.append(
        [
            {
                "record_id": "r1",
                "run_id": "r",
                "model": "m",
                "stage": "serialize",
                "status": "ok",
                "sha256": ref.digest,
                "size": ref.size,
            }
        ]
    )
    _flip_a_byte(Path(store.blob_path(ref.digest)))
    with pytest.raises(IntegrityError, match="removed it, so that the next run rebuilds it"):
        load_artifact(store, ref.digest, ref.size, ("serialize",), "archive")
    assert store.blob_status(ref.digest) == "missing"


@pytest.mark.integration
def test_a_run_rebuilds_a_big_artifact_whose_blob_changed(tmp_path: Path) -> None:
    """fc1 holds 1024 x 2048 float32 weights: every program blob is over 8 MiB. Unchanged, the
    re-run is all cached; after a blob is rewritten, the stage that made it runs again."""
    stages = ["trace", "functionalize", "decompose", "serialize", "validate"]
    big = {
        "name": "big",
        "factory": "tests.models:tiny_mlp",
        "kwargs": {"features": 1024, "hidden": 2048},
        "inputs": {"x": {"shape": [2, 1024]}},
    }
    store = tmp_path / "store"
    config = write_config(tmp_path / "big.yaml", [big], stages=stages)

    def run() -> dict[str, Any]:
        code, document = run_in_process(config, store=str(store))  # the fleet run in this process
        assert code == 0, document
        return document["models"][0]

    first = run()
    digest = first["stages"]["functionalize"]["artifact"]
    blob = store / "blobs" / "sha256" / digest[:2] / digest
    assert blob.stat().st_size >= TRUST_STAT_MIN_BYTES
    assert all(stage["cached"] for stage in run()["stages"].values())
    records = ArtifactStore(str(store)).index.read(["sha256", "blob_stat"]).to_pylist()
    assert all(r["blob_stat"] for r in records if r["sha256"] == digest)  # every record of it carries the signature

    _flip_a_byte(blob)
    again = run()
    assert again["stages"]["functionalize"]["cached"] is False
    rebuilt = again["stages"]["functionalize"]["artifact"]  # torch.export.save bytes differ run to run
    assert ArtifactStore(str(store)).blob_status(rebuilt) == "ok"
