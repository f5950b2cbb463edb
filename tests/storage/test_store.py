"""ArtifactStore on local disk, memory:// and S3 (moto server): content addressing, atomic publish,
verification on read, listing and deletion."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from pt2flow.storage import ArtifactStore, BlobNotFound, IntegrityError, InvalidId, StorageError
from pt2flow.storage.urls import redact_url


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _raw_write(store: ArtifactStore, digest: str, data: bytes) -> None:
    """Overwrite a blob's bytes behind the store's back (corruption injection)."""
    store.fs.pipe_file(store.blob_path(digest), data)


def test_put_blob_is_content_addressed(store: ArtifactStore) -> None:
    data = b"pt2flow artifact \x00\x01\x02" * 100
    ref = store.put_blob(data)
    assert ref.digest == _digest(data)
    assert ref.size == len(data)
    assert store.blob_path(ref.digest).endswith(f"blobs/sha256/{ref.digest[:2]}/{ref.digest}")
    assert ref.uri.endswith(f"/blobs/sha256/{ref.digest[:2]}/{ref.digest}")
    assert store.get_blob(ref.digest, ref.size) == data
    assert store.blob_status(ref.digest, ref.size) == "ok"
    assert store.has_blob(ref.digest)


def test_republishing_is_idempotent_and_keeps_one_copy(store: ArtifactStore) -> None:
    first = store.put_blob(b"same bytes")
    second = store.put_blob(b"same bytes")
    assert first == second
    listed = [b.digest for b in store.list_blobs()]
    assert listed == [first.digest]


def test_republishing_over_a_corrupt_blob_replaces_it(store: ArtifactStore) -> None:
    ref = store.put_blob(b"precious model weights")
    _raw_write(store, ref.digest, b"precious model weighTs")
    assert store.blob_status(ref.digest, ref.size) == "corrupt"
    again = store.put_blob(b"precious model weights")
    assert again.digest == ref.digest
    assert store.get_blob(ref.digest, ref.size) == b"precious model weights"


def test_bit_flip_is_detected_and_named(store: ArtifactStore) -> None:
    data = bytes(range(256)) * 8
    ref = store.put_blob(data)
    flipped = bytearray(data)
    flipped[1000] ^= 0x01
    _raw_write(store, ref.digest, bytes(flipped))
    with pytest.raises(IntegrityError) as info:
        store.get_blob(ref.digest, ref.size)
    assert ref.digest in str(info.value)
    assert "hash" in str(info.value)
    assert store.blob_status(ref.digest, ref.size) == "corrupt"


def test_truncated_blob_is_detected_by_size(store: ArtifactStore) -> None:
    data = b"x" * 4096
    ref = store.put_blob(data)
    _raw_write(store, ref.digest, data[:100])
    with pytest.raises(IntegrityError, match="100 bytes, the index records 4096"):
        store.get_blob(ref.digest, ref.size)
    # without a recorded size the hash still catches it
    with pytest.raises(IntegrityError):
        store.get_blob(ref.digest)


def test_missing_blob(store: ArtifactStore) -> None:
    digest = _digest(b"never stored")
    with pytest.raises(BlobNotFound, match=digest):
        store.get_blob(digest)
    assert store.blob_status(digest) == "missing"
    assert not store.has_blob(digest)


def test_digest_must_be_a_sha256(store: ArtifactStore) -> None:
    with pytest.raises(InvalidId):
        store.blob_path("../../etc/passwd")
    with pytest.raises(InvalidId):
        store.get_blob("ABC")


def test_list_and_delete(store: ArtifactStore) -> None:
    refs = [store.put_blob(f"blob {i}".encode()) for i in range(5)]
    listed = {b.digest: b for b in store.list_blobs()}
    assert set(listed) == {r.digest for r in refs}
    assert all(listed[r.digest].size == r.size for r in refs)
    assert all(b.modified is not None for b in listed.values())
    store.delete_blob(refs[0].digest)
    assert {b.digest for b in store.list_blobs()} == {r.digest for r in refs[1:]}
    store.delete_blob(refs[0].digest)  # deleting twice is fine


def test_concurrent_publishers_of_the_same_and_different_blobs(store: ArtifactStore) -> None:
    payloads = [b"shared" * 1000] * 8 + [f"own {i}".encode() * 500 for i in range(8)]
    errors: list[BaseException] = []

    def publish(data: bytes) -> None:
        try:
            store.put_blob(data)
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    expected = {_digest(p) for p in payloads}
    listed = [b.digest for b in store.list_blobs()]
    assert sorted(listed) == sorted(expected)  # exactly one copy of each digest
    for payload in set(payloads):
        assert store.get_blob(_digest(payload)) == payload


def test_local_publish_leaves_no_temp_files(tmp_path) -> None:
    store = ArtifactStore(str(tmp_path / "s"))
    for i in range(10):
        store.put_blob(f"{i}".encode() * 1000)
    leftovers = [name for _, _, files in os.walk(tmp_path) for name in files if ".tmp-" in name]
    assert leftovers == []


def test_local_temp_files_are_never_listed_as_blobs(tmp_path) -> None:
    store = ArtifactStore(str(tmp_path / "s"))
    ref = store.put_blob(b"real")
    folder = os.path.dirname(store.blob_path(ref.digest))
    with open(os.path.join(folder, f".{ref.digest}.tmp-deadbeef"), "wb") as handle:
        handle.write(b"half written")
    assert [b.digest for b in store.list_blobs()] == [ref.digest]


def test_unreachable_store_raises_storage_error() -> None:
    with pytest.raises(StorageError, match="cannot open store"):
        ArtifactStore("nosuchprotocol://bucket/x")


def test_urls_are_redacted() -> None:
    assert redact_url("s3://AKIAXXXX:supersecret@bucket/prefix") == "s3://bucket/prefix"
    assert redact_url("/plain/path") == "/plain/path"
