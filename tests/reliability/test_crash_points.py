"""Kill pt2flow with SIGKILL at every named crash point, then check the store.

The invariant after every crash (tests/reliability/invariants.py): every index record points to a
blob that exists with its digest and size (re-hashed); no blob is half-visible under its name; no
temp file is visible; every published index file parses. Then the same fleet, re-run without
the crash (from the test's process: the crash is the binary's, the recovery is what a run finds
in the store), completes, loses no record written before the crash and duplicates none.

Points are armed with PT2FLOW_CRASH_AT=<point>@<N>: the Nth time a process reaches the point.
Blobs are published by the worker process, index records by the orchestrating CLI process: a
blob point kills the worker (its model fails as `crash`, the run goes on and reports), an index
point kills the CLI itself (and its worker goes with it).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

from pt2flow.storage import ArtifactStore
from pt2flow.storage.faults import CRASH_POINTS
from tests.conftest import ROOT, cli_env, run_cli, run_in_process, run_json, write_config
from tests.reliability import stats
from tests.reliability.invariants import check_local_store, raw_index_rows, temp_files

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]
MODELS = 2
STAGES_PER_MODEL = 1 + len(STAGES)  # the source record, then one per stage: one blob + one record each
# (validate publishes one more blob before its report: the inputs and eager outputs it used)

# Where each point is armed in a 2-model fleet run (14 blob publishes; each record's index append
# follows its stage's blobs): spread over both models and over the stages.
FLEET_POINTS = {
    "mid_blob_write": 3,
    "before_blob_publish": 5,
    "after_blob_upload": 8,
    "before_index_append": 4,
    "mid_index_write": 7,
    "before_index_publish": 10,
    "after_index_append": 2,
}
# gc --compact on a store with garbage and several index files.
MAINTENANCE_POINTS = {"mid_gc": 1, "mid_compaction": 1, "mid_compaction_delete": 2}
S3_POINTS = {"mid_multipart_upload": 1}

KILLED = -signal.SIGKILL
WORKER_POINTS = frozenset({"mid_blob_write", "before_blob_publish", "after_blob_upload"})  # the worker publishes blobs


def _fleet_config(path: Path) -> Path:
    models = [
        {
            "name": f"mlp{i}",
            "factory": "tests.models:tiny_mlp",
            "kwargs": {"hidden": 12 + i},
            "inputs": {"x": {"shape": [3, 8]}},
        }
        for i in range(MODELS)
    ]
    return write_config(path, models, stages=STAGES, defaults={"validate": {"samples": 1}})


@pytest.fixture(scope="module")
def fleet_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _fleet_config(tmp_path_factory.mktemp("crash-config") / "fleet.yaml")


def _expected_before(point: str, nth: int) -> tuple[int, int]:
    """(blobs, records) on disk when an index point fires for the nth time: each record's append
    follows its stage's blobs, and each model's validate (its last record) published two. The
    stage after the nth record's may have published its own blobs by then, too (up to two more:
    it was sent to the worker before that record was written, runner.Ahead)."""
    blobs = nth + nth // STAGES_PER_MODEL  # the validate io blobs of the models done by then
    if point == "after_index_append":
        return blobs, nth
    return blobs, nth - 1  # before_index_append, mid_index_write, before_index_publish


@pytest.mark.integration
@pytest.mark.parametrize("point", list(FLEET_POINTS))
def test_fleet_killed_at_crash_point(
    point: str, tmp_path: Path, fleet_config: Path, prefect_env: dict[str, str]
) -> None:
    store_dir = tmp_path / "store"
    nth = FLEET_POINTS[point]
    args = ["run", str(fleet_config), "--store", str(store_dir), "--json", "--workers", "1"]
    marker = tmp_path / "crashed"
    crash_env = {**prefect_env, "PT2FLOW_CRASH_AT": f"{point}@{nth}", "PT2FLOW_CRASH_ONCE": str(marker)}

    crashed = run_cli(args, env=crash_env, timeout=300)
    assert marker.exists(), f"no process reached {point}@{nth}:\n{crashed.stderr[-3000:]}"
    if point in WORKER_POINTS:
        # the worker died there; its model failed as a crash and the CLI reported the whole fleet
        assert crashed.returncode == 1, f"exit {crashed.returncode}:\n{crashed.stderr[-3000:]}"
        failed = [(m["error_class"], m["error"]) for m in json.loads(crashed.stdout)["models"] if m["status"] != "ok"]
        assert len(failed) == 1 and failed[0][0] == "crash" and "SIGKILL" in failed[0][1], failed
        before = check_local_store(store_dir)
    else:
        assert crashed.returncode == KILLED, (
            f"not killed at {point}@{nth} (exit {crashed.returncode}):\n{crashed.stderr[-3000:]}"
        )
        before = check_local_store(store_dir)
        blobs, records = _expected_before(point, nth)
        assert len(before["records"]) == records and blobs <= len(before["blobs"]) <= blobs + 2, (
            f"the crash did not happen where {point}@{nth} is: "
            f"{len(before['records'])} records and {len(before['blobs'])} blobs, expected {records} and {blobs} (+2)"
        )
    ids_before = {r["record_id"] for r in before["records"]}

    # the re-run from this process (the crash above is the binary's): what is checked is what it
    # finds and leaves in the store
    code, doc = run_in_process(fleet_config, store=str(store_dir), workers=1)
    assert code == 0, doc
    assert [m["status"] for m in doc["models"]] == ["ok"] * MODELS

    after = check_local_store(store_dir)
    ids_after = {r["record_id"] for r in after["records"]}
    lost = ids_before - ids_after
    assert not lost, f"records written before the crash are gone: {lost}"
    raw = raw_index_rows(store_dir)
    duplicated = [rid for rid, n in Counter(raw["record_id"].to_pylist()).items() if n > 1]
    assert not duplicated, f"record ids written twice: {duplicated}"
    rerun = [r for r in after["records"] if r["run_id"] == doc["run_id"]]
    assert Counter((r["model"], r["stage"]) for r in rerun) == Counter(
        {(f"mlp{i}", s): 1 for i in range(MODELS) for s in ["source", *STAGES]}
    )
    # no stage's work recorded twice: across the crashed run and the re-run, each derivation key
    # has at most one ok record that did the work (cached=False); the re-run reused the rest
    done = Counter(
        r["key"] for r in after["records"] if r["status"] == "ok" and not r["cached"] and r["stage"] != "source"
    )
    assert all(n == 1 for n in done.values()), f"stage work recorded twice: {done}"
    assert len(done) == MODELS * len(STAGES)
    reused = sum(1 for r in rerun if r["stage"] != "source" and r["cached"])
    assert reused == sum(1 for r in before["records"] if r["stage"] != "source" and r["status"] == "ok")

    from pt2flow.flows.api.upkeep import verify_store

    verified = verify_store(ArtifactStore(str(store_dir)))
    assert verified["missing"] == [] and verified["corrupt"] == []
    stats.crash_points_tested.add(point)
    stats.add_records(len(ids_before), len(lost))


# ---------------------------------------------------------------------------------------------
# gc and compaction


def _maintenance_store(root: Path) -> dict:
    """Six index files of two records each, every record pointing to its own blob, plus four
    unreferenced blobs older than any grace period."""
    store = ArtifactStore(str(root))
    ids, referenced = [], set()
    for f in range(6):
        rows = []
        for r in range(2):
            ref = store.put_blob(f"artifact {f}-{r}".encode() * 500)
            referenced.add(ref.digest)
            rid = f"rec-{f}-{r}"
            ids.append(rid)
            rows.append(
                {
                    "record_id": rid,
                    "run_id": "r1",
                    "model": f"m{f}",
                    "stage": "trace",
                    "status": "ok",
                    "sha256": ref.digest,
                    "size": ref.size,
                }
            )
        store.index.append(rows)
    garbage = set()
    for g in range(4):
        ref = store.put_blob(f"garbage {g}".encode() * 300)
        os.utime(store.blob_path(ref.digest), (1_000_000_000, 1_000_000_000))
        garbage.add(ref.digest)
    return {"ids": set(ids), "referenced": referenced, "garbage": garbage}


@pytest.mark.parametrize("point", list(MAINTENANCE_POINTS))
def test_gc_and_compaction_killed_at_crash_point(point: str, tmp_path: Path) -> None:
    root = tmp_path / "store"
    setup = _maintenance_store(root)
    index_files = sorted(p.name for p in (root / "index").glob("*.parquet"))
    nth = MAINTENANCE_POINTS[point]
    args = ["gc", "--compact", "--grace", "60", "--store", str(root), "--json"]

    crashed = run_cli(args, env={"PT2FLOW_CRASH_AT": f"{point}@{nth}"}, timeout=120)
    assert crashed.returncode == KILLED, f"not killed at {point} (exit {crashed.returncode}):\n{crashed.stderr[-3000:]}"

    state = check_local_store(root)
    ids = {r["record_id"] for r in state["records"]}
    assert ids == setup["ids"], f"lost {setup['ids'] - ids}"
    assert setup["referenced"] <= set(state["blobs"])  # gc never touches a referenced blob
    left_garbage = setup["garbage"] & set(state["blobs"])
    now_files = sorted(p.name for p in (root / "index").glob("*.parquet") if not p.name.startswith("_"))
    if point == "mid_gc":  # killed between two deletions
        assert len(left_garbage) == len(setup["garbage"]) - 1
        assert now_files == index_files
    elif point == "mid_compaction":  # merged file written, nothing deleted: every row twice on disk, once to readers
        assert not left_garbage
        assert len(now_files) == len(index_files) + 1
        assert raw_index_rows(root).num_rows == 2 * len(setup["ids"])
    else:  # mid_compaction_delete: some small files deleted, not all
        assert 1 < len(now_files) < len(index_files) + 1

    code, doc, stderr = run_json(args, timeout=120)
    assert code == 0, stderr[-2000:]
    state = check_local_store(root)
    assert {r["record_id"] for r in state["records"]} == setup["ids"]
    assert set(state["blobs"]) == setup["referenced"]
    files = [p.name for p in (root / "index").glob("*.parquet") if not p.name.startswith("_")]
    assert len(files) == 1 and files[0].startswith("compact-")
    raw = raw_index_rows(root)
    assert sorted(raw["record_id"].to_pylist()) == sorted(setup["ids"])  # exactly once on disk too
    assert temp_files(root) == []
    stats.crash_points_tested.add(point)
    stats.add_records(len(setup["ids"]), len(setup["ids"] - {r["record_id"] for r in state["records"]}))


def test_gc_sweeps_the_temp_files_of_writers_killed_without_o_tmpfile(tmp_path: Path) -> None:
    """Where O_TMPFILE is unavailable, a writer killed mid-write leaves a dot-named temp file:
    never listed as a blob, and removed by gc once past the grace period."""
    root = tmp_path / "store"
    args = {"url": str(root), "seed": 5, "size": 100_000, "named_temps": True}
    crashed = _worker("put", args, env={"PT2FLOW_CRASH_AT": "mid_blob_write"})
    assert crashed.returncode == KILLED, crashed.stdout + crashed.stderr[-2000:]
    leftovers = temp_files(root)
    assert len(leftovers) == 1 and os.path.getsize(leftovers[0]) == args["size"] // 2  # torn, and hidden
    state = check_local_store(root, allow_named_temps=True)
    assert state["blobs"] == {}

    code, doc, _ = run_json(["gc", "--store", str(root)])  # within the grace period: kept
    assert code == 0 and doc["temp_files_deleted"] == 0 and temp_files(root) == leftovers
    os.utime(leftovers[0], (1_000_000_000, 1_000_000_000))
    code, doc, _ = run_json(["gc", "--store", str(root)])
    assert code == 0 and doc["temp_files_deleted"] == 1 and temp_files(root) == []
    done = _worker("put", args)
    assert done.returncode == 0 and check_local_store(root)["blobs"] == {
        json.loads(done.stdout.splitlines()[-1])["digest"]: args["size"]
    }


# ---------------------------------------------------------------------------------------------
# S3: a multipart upload killed between its parts


def _payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _worker(
    command: str, args: dict, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.reliability.worker", command, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(env),
        cwd=str(ROOT),
    )


def test_s3_multipart_upload_killed_between_parts_leaves_no_object(moto_s3) -> None:
    import boto3

    prefix = uuid.uuid4().hex
    url = f"s3://{moto_s3.bucket}/{prefix}"
    part = 5 * 2**20  # S3's minimum part size
    args = {"url": url, "threshold": part, "part_size": part, "seed": 11, "size": 2 * part + 12345}
    digest = hashlib.sha256(_payload(args["seed"], args["size"])).hexdigest()
    key = f"{prefix}/blobs/sha256/{digest[:2]}/{digest}"
    s3 = boto3.client("s3", endpoint_url=moto_s3.url)

    crashed = _worker("multipart", args, env={"PT2FLOW_CRASH_AT": "mid_multipart_upload@1"})
    assert crashed.returncode == KILLED, crashed.stdout + crashed.stderr[-3000:]
    uploads = [
        u for u in s3.list_multipart_uploads(Bucket=moto_s3.bucket, Prefix=prefix).get("Uploads", []) if u["Key"] == key
    ]
    assert len(uploads) == 1, "the child should have died in the middle of its multipart upload"
    sent = s3.list_parts(Bucket=moto_s3.bucket, Key=key, UploadId=uploads[0]["UploadId"]).get("Parts", [])
    assert [p["PartNumber"] for p in sent] == [1]  # one part sent, the object not completed
    assert s3.list_objects_v2(Bucket=moto_s3.bucket, Prefix=prefix).get("KeyCount", 0) == 0  # nothing visible
    store = ArtifactStore(url)
    assert not store.has_blob(digest) and list(store.list_blobs()) == []

    done = _worker("multipart", args)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["digest"] == digest
    assert store.blob_status(digest, args["size"]) == "ok"
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=moto_s3.bucket, Prefix=prefix)["Contents"]] == [key]
    s3.abort_multipart_upload(
        Bucket=moto_s3.bucket, Key=key, UploadId=uploads[0]["UploadId"]
    )  # what a lifecycle rule does
    stats.crash_points_tested.add("mid_multipart_upload")


# ---------------------------------------------------------------------------------------------
# the count


@pytest.mark.integration
def test_every_declared_crash_point_is_tested(request: pytest.FixtureRequest) -> None:
    """Every point storage.faults declares has a crash test here, and each selected one passed."""
    covered = set(FLEET_POINTS) | set(MAINTENANCE_POINTS) | set(S3_POINTS)
    assert covered == set(CRASH_POINTS), (
        f"crash points without a test: {set(CRASH_POINTS) - covered}; unknown: {covered - set(CRASH_POINTS)}"
    )
    selected = {
        p
        for p in CRASH_POINTS
        if any(
            f"[{p}]" in item.nodeid or (p in S3_POINTS and "multipart_upload_killed" in item.nodeid)
            for item in request.session.items
        )
    }
    assert stats.crash_points_tested == selected, (
        f"crash tests that did not pass: {selected - stats.crash_points_tested}"
    )
    assert stats.records_lost == 0  # conftest.py prints "crash points tested: N of M" at the end
