"""Transient S3 errors injected between pt2flow and the moto server by a real HTTP proxy
(tests/reliability/faults.py): 500, 503, 503 SlowDown, 429 throttling, a connection dropped
before the request reaches S3 and one dropped after it took effect.

botocore's and s3fs's own retries are turned off for these stores (total_max_attempts=1, and
S3FileSystem.retries=1) so that the attempts the proxy counts are pt2flow's RetryPolicy alone.
One client layer cannot be turned off: aiohttp re-sends an idempotent request (PUT, GET) once,
at once, when a kept-alive connection closes without an answer. The proxy sees that as a second
hit within milliseconds; `policy_attempts` counts bursts of hits, one per RetryPolicy attempt.
"""

from __future__ import annotations

import hashlib
import io
import time
import uuid
from typing import Iterator

import pyarrow.parquet as pq
import pytest

from pt2flow.storage import ArtifactStore, StorageError
from pt2flow.storage.retry import RetryPolicy
from tests.reliability import stats
from tests.reliability.faults import FaultProxy, run_proxy

ATTEMPTS = 4
BASE_DELAY = 0.3  # the first retry waits 0.15-0.3 s: far above any re-send delay on a loaded machine
# hits closer than this are aiohttp's immediate re-send, not a new attempt. It is milliseconds on
# an idle machine; 57 ms was seen with other test runs loading both cores, hence the margin (a
# retry still cannot start closer than BASE_DELAY / 2 * 0.9 = 0.135 s, which _assert_backoff checks)
SAME_ATTEMPT = 0.12


@pytest.fixture(scope="module")
def proxy(moto_s3) -> Iterator[FaultProxy]:
    yield from run_proxy(moto_s3.url)


@pytest.fixture
def faulty_store(proxy: FaultProxy, moto_s3) -> Iterator[ArtifactStore]:
    options = {"endpoint_url": proxy.url, "config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 5, "read_timeout": 10}}
    store = ArtifactStore(f"s3://{moto_s3.bucket}/{uuid.uuid4().hex}", options, retry=RetryPolicy(attempts=ATTEMPTS, base_delay=BASE_DELAY, max_delay=2.0))
    store.fs.retries = 1  # s3fs's own retry loop: off
    proxy.clear()
    yield store
    proxy.clear()


def _records(store: ArtifactStore, tag: str, n: int) -> list[dict]:
    return [{"record_id": f"{tag}-{i}", "run_id": tag, "model": "m", "stage": "trace", "status": "ok"} for i in range(n)]


def _raw_index_ids(store: ArtifactStore) -> list[str]:
    ids: list[str] = []
    for path in store.index.files():
        ids += pq.read_table(io.BytesIO(store.fs.cat_file(path)), columns=["record_id"])["record_id"].to_pylist()
    return ids


SCHEDULES = {
    "500,503,slowdown": ["500", "503", "slowdown"],
    "429,drop,500": ["429", "drop", "500"],
    "drop_after": ["drop_after"],  # the PUT took effect, its answer was lost: the retry must not duplicate
    "slowdown,drop_after,503": ["slowdown", "drop_after", "503"],
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_transient_faults_fewer_than_the_budget_are_retried_to_success(schedule: str, faulty_store: ArtifactStore, proxy: FaultProxy) -> None:
    faults = SCHEDULES[schedule]
    store = faulty_store
    data = f"artifact under faults {schedule}".encode() * 1000
    digest = hashlib.sha256(data).hexdigest()

    put = proxy.plan("PUT", f"/blobs/sha256/{digest[:2]}/{digest}", faults)
    ref = store.put_blob(data)
    assert put.injected == len(faults), put.seen  # every fault was met, and survived
    # one attempt per fault at most, plus the one that succeeds (after a drop_after the object
    # exists: the next attempt's existence check or If-None-Match PUT sees it, writes nothing)
    assert policy_attempts(put.seen) <= min(ATTEMPTS, len(faults) + 1)
    _assert_backoff(put.seen)

    get = proxy.plan("GET", f"/blobs/sha256/{digest[:2]}/{digest}", [f for f in faults if f != "drop_after"])
    assert store.get_blob(ref.digest, ref.size) == data
    assert get.injected == len([f for f in faults if f != "drop_after"])

    append = proxy.plan("PUT", "/index/part-", faults)
    store.index.append(_records(store, "ok", 3))
    assert append.injected == len(faults)
    assert sorted(_raw_index_ids(store)) == [f"ok-{i}" for i in range(3)]  # one file, each record once
    assert len(store.index.files()) == 1
    assert [b.digest for b in store.list_blobs()] == [digest]
    stats.add_faults(put.injected + get.injected + append.injected)


@pytest.mark.parametrize("fault", ["503", "slowdown", "500", "drop"])
def test_persistent_faults_become_a_storage_error_after_the_budget(fault: str, faulty_store: ArtifactStore, proxy: FaultProxy) -> None:
    store = faulty_store
    put = proxy.plan("PUT", "/blobs/", [fault] * 20)
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        store.put_blob(b"never makes it" * 100)
    assert policy_attempts(put.seen) == ATTEMPTS, put.seen  # bounded: exactly the policy's attempts
    assert "cannot write blob" in str(info.value)
    _assert_backoff(put.seen)
    assert time.monotonic() - started < 10

    append = proxy.plan("PUT", "/index/", [fault] * 20)
    with pytest.raises(StorageError, match="cannot write index file"):
        store.index.append(_records(store, "lost", 2))
    assert policy_attempts(append.seen) == ATTEMPTS
    proxy.clear()
    assert list(store.list_blobs()) == [] and store.index.files() == []  # nothing half-written
    store.index.append(_records(store, "later", 2))  # the store works again once S3 does
    assert sorted(_raw_index_ids(store)) == ["later-0", "later-1"]
    stats.add_faults(put.injected + append.injected)


def test_failed_multipart_upload_is_aborted_and_leaves_no_object(faulty_store: ArtifactStore, proxy: FaultProxy, moto_s3, monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    import pt2flow.storage.multipart as multipart

    part = 5 * 2**20
    monkeypatch.setattr(multipart, "MULTIPART_THRESHOLD", part)
    monkeypatch.setattr(multipart, "MULTIPART_PART_SIZE", part)
    store = faulty_store
    data = b"\x01" * (2 * part + 1)
    digest = hashlib.sha256(data).hexdigest()
    parts = proxy.plan("PUT", "partNumber=2", ["503"] * 20)  # the second part always fails
    with pytest.raises(StorageError):
        store.put_blob(data)
    assert policy_attempts(parts.seen) == ATTEMPTS
    s3 = boto3.client("s3", endpoint_url=moto_s3.url)
    prefix = store.root.split("/", 1)[1]
    assert s3.list_objects_v2(Bucket=moto_s3.bucket, Prefix=prefix).get("KeyCount", 0) == 0
    pending = s3.list_multipart_uploads(Bucket=moto_s3.bucket, Prefix=prefix).get("Uploads", [])
    assert pending == [], "a failed multipart upload must be aborted"
    proxy.clear()
    partial = proxy.plan("PUT", "partNumber=2", ["500"])  # one fault: retried, then completed
    assert store.put_blob(data).digest == digest
    assert partial.injected == 1 and store.blob_status(digest, len(data)) == "ok"
    stats.add_faults(parts.injected + partial.injected)


def _bursts(seen: list[tuple[float, str]]) -> list[float]:
    """Start times of the RetryPolicy attempts: hits SAME_ATTEMPT apart or less are one attempt."""
    starts: list[float] = []
    last = None
    for t, _action in seen:
        if last is None or t - last > SAME_ATTEMPT:
            starts.append(t)
        last = t
    return starts


def policy_attempts(seen: list[tuple[float, str]]) -> int:
    return len(_bursts(seen))


def _assert_backoff(seen: list[tuple[float, str]]) -> None:
    """Retry i+1 starts at least half the exponential delay (BASE_DELAY * 2**i) after retry i."""
    starts = _bursts(seen)
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        assert b - a >= BASE_DELAY * 2**i * 0.5 * 0.9, f"retry {i + 1} came after {b - a:.3f} s: no backoff"
