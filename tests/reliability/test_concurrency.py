"""16 concurrent writers on one store: 8 threads of this process and 8 processes, started together,
each appending records to the same index and publishing the same (shared) and different (own)
blobs, reading every blob back verified right after publishing it, while two reader threads read
every blob over and over. Afterwards: no index row lost, none duplicated, no reader ever saw a
partial blob, no blob corrupted, exactly one copy of each digest, no temp file left."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pt2flow.storage import ArtifactStore, BlobNotFound, IntegrityError
from tests.conftest import ROOT, cli_env
from tests.reliability import stats
from tests.reliability.concurrency import OWN_BLOBS, SHARED_BLOBS, own_payload, record_id, shared_payload, write_load
from tests.reliability.invariants import temp_files

pytestmark = pytest.mark.integration  # sixteen writer processes

THREADS = 8
PROCESSES = 8
ROUNDS = {"local": 10, "s3": 5}  # 5 rounds publish each writer's 5 blobs once


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_sixteen_concurrent_writers_lose_nothing_and_corrupt_nothing(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "local":
        url = str(tmp_path / "store")
    else:
        url = f"s3://{request.getfixturevalue('moto_s3').bucket}/{uuid.uuid4().hex}"
    go = tmp_path / "go"
    writers = [f"t{i}" for i in range(THREADS)] + [f"p{i}" for i in range(PROCESSES)]
    rounds = ROUNDS[backend]

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.reliability.worker",
                "writer",
                json.dumps({"url": url, "writer": w, "rounds": rounds, "go": str(go)}),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(),
            cwd=str(ROOT),
        )
        for w in writers
        if w.startswith("p")
    ]
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)

    def thread_writer(name: str) -> None:
        try:
            store = ArtifactStore(url)  # each thread its own store object, as separate runs would have
            barrier.wait()
            while not go.exists():
                time.sleep(0.005)
            write_load(store, name, rounds)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    payloads = [shared_payload(i) for i in range(SHARED_BLOBS)] + [
        own_payload(w, i) for w in writers for i in range(OWN_BLOBS)
    ]
    expected_blobs = {hashlib.sha256(p).hexdigest(): p for p in payloads}
    done = threading.Event()
    torn: list[str] = []
    reads = Counter()

    def reader() -> None:
        """Reads every expected blob over and over while the writers run: a blob that is visible
        under its name must be whole (readers never see a partial blob)."""
        store = ArtifactStore(url)
        while not done.is_set():
            for digest, payload in expected_blobs.items():
                try:
                    if store.get_blob(digest, len(payload)) != payload:
                        torn.append(f"{digest}: other bytes than were written")
                    reads["whole"] += 1
                except BlobNotFound:
                    reads["absent"] += 1
                except IntegrityError as exc:
                    torn.append(str(exc))

    threads = [threading.Thread(target=thread_writer, args=(w,)) for w in writers if w.startswith("t")]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads + readers:
        t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
        Path(f"{go}.ready-{w}").exists() for w in writers if w.startswith("p")
    ):
        time.sleep(0.02)  # every process imported, opened the store and polls for the start
    go.touch()
    for t in threads:
        t.join(timeout=300)
    outputs = [p.communicate(timeout=300) for p in procs]
    done.set()
    for t in readers:
        t.join(timeout=60)
    assert torn == [], f"readers saw {len(torn)} partial blobs: {torn[:3]}"
    assert reads["whole"] > 0
    assert errors == [], errors
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, out + err[-3000:]
        assert json.loads(out.splitlines()[-1])["ok"]

    store = ArtifactStore(url)
    expected_ids = {record_id(w, r) for w in writers for r in range(rounds)}
    # every row of every index file, not de-duplicated: nothing lost, nothing written twice
    raw: list[str] = []
    for path in store.index.files():
        raw += pq.read_table(io.BytesIO(store.fs.cat_file(path)), columns=["record_id"])["record_id"].to_pylist()
    assert len(raw) == len(expected_ids) and set(raw) == expected_ids, (
        f"lost {expected_ids - set(raw)}; duplicated {[i for i, n in Counter(raw).items() if n > 1]}"
    )
    assert len(store.index.files()) == len(writers) * rounds
    records = store.index.read(["record_id", "sha256", "size"]).to_pylist()
    assert {r["record_id"] for r in records} == expected_ids

    listed = [b.digest for b in store.list_blobs()]
    assert sorted(listed) == sorted(expected_blobs)  # exactly one copy of each digest
    for digest, payload in expected_blobs.items():
        assert store.get_blob(digest, len(payload)) == payload  # none corrupted
    for record in records:
        assert record["sha256"] in expected_blobs and record["size"] == len(expected_blobs[record["sha256"]])
    if backend == "local":
        assert temp_files(Path(url)) == []
        files = [p for p in (Path(url) / "blobs").rglob("*") if p.is_file()]
        assert len(files) == len(expected_blobs)
    stats.add_records(len(expected_ids), len(expected_ids - set(raw)))
