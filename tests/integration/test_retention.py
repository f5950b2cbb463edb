"""Retention (`pt2flow gc --keep-runs/--keep-days`, serve's `retention:`) and reproducible archives,
on real runs (fleets run in this process, `gc` and the queries as the CLI's main(ARGS) in this
process: conftest run_cli, cli_in_process), on a local store and on S3 (moto's server).

The local fleet: run 1 builds `mlp` (hidden 16) and `other`; run 2 changes mlp (hidden 32; other
is cached); run 3 is `--force --only mlp` (every mlp stage built again: its archive must have run
2's ID). `gc --keep-runs 1` then keeps mlp's run 3 and other's run 2 (cached records, whose
builders in run 1 stay), and frees exactly the blobs only run 1's and run 2's mlp records name."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

import pytest

from pt2flow.storage import ArtifactStore
from pt2flow.storage.leases import RunLease, live_leases
from pt2flow.storage.retention import RetentionRule, apply_retention, blobs_of
from tests.conftest import cli_in_process, json_result, run_cli, run_in_process, run_json, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]


def _models(hidden: int) -> list[dict[str, Any]]:
    return [
        {
            "name": "mlp",
            "factory": "tests.models:tiny_mlp",
            "kwargs": {"hidden": hidden},
            "inputs": {"x": {"shape": [3, 8]}},
        },
        {"name": "other", "factory": "tests.models:regressor", "inputs": {"x": {"shape": [4, 4]}, "y": {"shape": [4]}}},
    ]


def _run(config: Path, store: str, **options: Any) -> dict[str, Any]:
    """The fleet run in this process (pt2flow.flows.api's run): what it keeps is under test here,
    not the CLI (gc, verify, get and lineage run as the real binary)."""
    code, doc = run_in_process(config, store=store, **options)
    assert code == 0, doc
    return doc


def _s3_json(args: list[str]) -> tuple[int, Any, str]:
    """`pt2flow ARGS --json` on an S3 store as main(ARGS) in this process (cli_in_process; run_cli
    starts the binary for an s3:// argument): the S3 variables are this process's (moto_s3). What
    gc deletes and the queries answer is under test, not the process (tests/integration/
    test_run_cli.py runs the binary's queries on S3)."""
    return json_result(cli_in_process([*args, "--json"]))


def _records(store: ArtifactStore) -> list[dict[str, Any]]:
    return store.index.read().to_pylist()


def _named(rows: list[dict[str, Any]]) -> set[str]:
    return {digest for row in rows for digest, _, _ in blobs_of(row)}


def _present(store: ArtifactStore) -> set[str]:
    return {b.digest for b in store.list_blobs()}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("retention")
    store = str(work / "store")
    config = write_config(work / "c.yaml", _models(16), stages=STAGES)
    first = _run(config, store)
    write_config(config, _models(32), stages=STAGES)
    second = _run(config, store)
    third = _run(config, store, force=True, only=["mlp"])
    return {"work": work, "store": store, "config": config, "runs": [first, second, third]}


def _model(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(m for m in doc["models"] if m["name"] == name)


def test_force_on_an_unchanged_model_gives_the_same_archive_id(fleet: dict[str, Any]) -> None:
    _, second, third = fleet["runs"]
    rebuilt = _model(third, "mlp")
    assert rebuilt["stages"]["serialize"]["cached"] is False and rebuilt["stages"]["decompose"]["cached"] is False
    assert rebuilt["artifacts"]["serialized"] == _model(second, "mlp")["artifacts"]["serialized"]
    # and a changed model gives another one
    assert _model(fleet["runs"][0], "mlp")["artifacts"]["serialized"] != rebuilt["artifacts"]["serialized"]


def test_gc_keep_runs_frees_exactly_what_only_superseded_runs_need(fleet: dict[str, Any]) -> None:
    store = ArtifactStore(fleet["store"])
    run1, run2, run3 = (doc["run_id"] for doc in fleet["runs"])
    before = _records(store)
    present_before = _present(store)
    mlp_old = [r for r in before if r["model"] == "mlp" and r["run_id"] in (run1, run2)]
    kept_rows = [r for r in before if r not in mlp_old]
    expected = _named(mlp_old) - _named(kept_rows)
    old_archive = _model(fleet["runs"][0], "mlp")["artifacts"]["serialized"]
    old_io = [r for r in mlp_old if r["run_id"] == run1 and r["stage"] == "validate"]
    io_blobs = {d for r in old_io for d, _, role in blobs_of(r) if role == "validation inputs and outputs"}
    assert (
        old_archive in expected and len(io_blobs) == 1 and io_blobs <= expected
    )  # the old model's archive and io blob

    # keeping a day of runs keeps all of them; a dry run deletes nothing and says what would go, per run
    code, doc, stderr = run_json(["gc", "--store", fleet["store"], "--keep-days", "1", "--dry-run"])
    assert code == 0 and doc["retention"]["records"] == 0 and doc["retention"]["blobs"] == [], stderr
    code, doc, stderr = run_json(["gc", "--store", fleet["store"], "--keep-runs", "1", "--dry-run", "--grace", "0"])
    assert code == 0, stderr
    plan = doc["retention"]
    assert (
        set(plan["blobs"]) == expected
        and plan["deleted"] == []
        and plan["bytes"] == sum(b.size for b in store.list_blobs() if b.digest in expected)
    )
    assert {r["run_id"]: r["records"] for r in plan["dropped_runs"]} == {run1: len(STAGES) + 1, run2: len(STAGES) + 1}
    assert all(r["models"] == ["mlp"] for r in plan["dropped_runs"])
    assert plan["kept_runs"] == {"mlp": [run3], "other": [run2]}
    assert _present(store) == present_before and len(_records(store)) == len(before)

    # a run in progress (its lease) defers everything; its fresh blob, named by no record yet, survives
    fresh = store.put_blob(b"a blob a running export just published " + uuid.uuid4().bytes)
    with RunLease(store, "run-in-progress"):
        code, doc, stderr = run_json(["gc", "--store", fleet["store"], "--keep-runs", "1", "--grace", "0"])
        assert code == 0, stderr
        assert doc["retention"]["deferred"] == ["run-in-progress"] and doc["retention"]["records_dropped"] == 0
        assert doc["deferred"] == ["run-in-progress"] and doc["deleted"] == []
        proc = run_cli(["gc", "--store", fleet["store"], "--keep-runs", "1", "--grace", "0"])
        assert proc.returncode == 0 and "deferred: run(s) in progress (run-in-progress)" in proc.stdout, (
            proc.stdout + proc.stderr
        )
    assert _present(store) == present_before | {fresh.digest} and len(_records(store)) == len(before)
    assert live_leases(store) == []

    # the real thing: exactly the expected blobs go, and the fresh one (inside the grace period) stays
    code, doc, stderr = run_json(["gc", "--store", fleet["store"], "--keep-runs", "1"])
    assert code == 0, stderr
    assert doc["retention"]["records_dropped"] == len(mlp_old)
    assert set(doc["retention"]["kept_within_grace"]) == expected  # just written: younger than an hour
    assert _present(store) == present_before | {fresh.digest}
    code, doc, stderr = run_json(["gc", "--store", fleet["store"], "--keep-runs", "1", "--grace", "0"])
    assert code == 0, stderr
    assert doc["retention"]["records"] == 0  # the records went in the gc before
    assert set(doc["deleted"]) == expected | {fresh.digest}  # now unreferenced, past a zero grace
    after = _records(store)
    assert _present(store) == present_before - expected
    assert {r["record_id"] for r in after} == {r["record_id"] for r in kept_rows}
    assert _named(after) == _present(store)  # nothing kept that no record names, nothing named missing

    # the kept runs still answer: verify, lineage to the source, get, ls
    proc = run_cli(["verify", "--store", fleet["store"]])
    assert proc.returncode == 0 and "0 missing, 0 corrupt" in proc.stdout, proc.stdout + proc.stderr
    for doc in (fleet["runs"][2], fleet["runs"][1]):
        name = "mlp" if doc is fleet["runs"][2] else "other"
        archive = _model(doc, name)["artifacts"]["serialized"]
        code, lineage, stderr = run_json(["lineage", "--store", fleet["store"], archive])
        assert code == 0, stderr
        chain = [r["stage"] for r in lineage["ancestors"] if r["record_id"] != lineage["record"]["record_id"]] + [
            lineage["record"]["stage"]
        ]
        assert chain == ["source", "trace", "functionalize", "decompose", "serialize"]
        target = fleet["work"] / f"{name}.pt2"
        proc = run_cli(["get", "--store", fleet["store"], archive, "-o", str(target)])
        assert proc.returncode == 0, proc.stderr
        assert hashlib.sha256(target.read_bytes()).hexdigest() == archive
    code, listed, stderr = run_json(["ls", "--store", fleet["store"], "--run", run1])
    assert code == 0 and {r["model"] for r in listed} == {"other"}, stderr  # other's builders stay


@pytest.fixture(scope="module")
def s3_runs(tmp_path_factory: pytest.TempPathFactory, moto_s3: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A fresh S3 store, and the documents of two runs of one model whose code changed between
    them: built once; each test changes a copy of it (_copied)."""
    url = f"s3://{moto_s3.bucket}/retention-{uuid.uuid4().hex[:8]}"
    work = tmp_path_factory.mktemp("retention-s3")
    config = write_config(work / "c.yaml", _models(16)[:1], stages=["trace", "serialize"])
    first = _run(config, url)
    write_config(config, _models(32)[:1], stages=["trace", "serialize"])
    return url, first, _run(config, url)


def _copied(
    s3_runs: tuple[str, dict[str, Any], dict[str, Any]], moto_s3: Any
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The two runs' S3 store copied, object by object inside the S3 server, to a prefix of this
    test's own; the runs' documents (the records name blobs by digest, not by the store's URL)."""
    import boto3

    url, first, second = s3_runs
    source = url.removeprefix(f"s3://{moto_s3.bucket}/") + "/"
    target = f"retention-{uuid.uuid4().hex[:8]}/"
    client = boto3.client("s3", endpoint_url=moto_s3.url)
    copied = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=moto_s3.bucket, Prefix=source):
        for item in page.get("Contents", []):
            client.copy_object(
                Bucket=moto_s3.bucket,
                Key=target + item["Key"][len(source) :],
                CopySource={"Bucket": moto_s3.bucket, "Key": item["Key"]},
            )
            copied += 1
    assert copied, f"nothing under {url}"
    return f"s3://{moto_s3.bucket}/{target.rstrip('/')}", first, second


def test_a_lease_taken_while_the_index_is_rewritten_stops_the_blob_deletions(
    tmp_path: Path, moto_s3: Any, s3_runs: Any
) -> None:
    """On S3: two runs of a changing model; a run that starts (takes its lease) between the index
    rewrite and the deletions stops them: the records are gone, every blob is still there."""
    url, first, second = _copied(s3_runs, moto_s3)
    store = ArtifactStore(url)
    before = _records(store)
    old = [r for r in before if r["run_id"] == first["run_id"]]
    expected = _named(old) - _named([r for r in before if r["run_id"] == second["run_id"]])
    assert (
        _model(first, "mlp")["artifacts"]["serialized"] in expected and len(expected) == 3
    )  # source, trace, serialize

    rewrite = store.index.compact
    lease = RunLease(store, "starts-meanwhile")

    def rewrite_then_a_run_starts(*args: Any, **kwargs: Any) -> Any:
        done = rewrite(*args, **kwargs)
        lease.__enter__()
        return done

    store.index.compact = rewrite_then_a_run_starts  # type: ignore[method-assign]
    try:
        result = apply_retention(store, RetentionRule(keep_runs=1), dry_run=False, grace_seconds=0)
    finally:
        lease.__exit__(None, None, None)
        store.index.compact = rewrite  # type: ignore[method-assign]
    assert (
        result["deferred"] == ["starts-meanwhile"] and result["records_dropped"] == len(old) and result["deleted"] == []
    )
    assert expected <= _present(store)

    # with nobody running, the CLI frees them (they are unreferenced now) on S3
    code, doc, stderr = _s3_json(["gc", "--store", url, "--keep-runs", "1", "--grace", "0"])
    assert code == 0, stderr
    assert set(doc["deleted"]) == expected
    assert _present(store) == _named(_records(store))
    assert {r["run_id"] for r in _records(store)} == {second["run_id"]}
    proc = cli_in_process(["verify", "--store", url])
    assert proc.returncode == 0 and "0 missing, 0 corrupt" in proc.stdout, proc.stdout + proc.stderr
    archive = _model(second, "mlp")["artifacts"]["serialized"]
    proc = cli_in_process(["get", "--store", url, archive, "-o", str(tmp_path / "m.pt2")])
    assert proc.returncode == 0 and hashlib.sha256((tmp_path / "m.pt2").read_bytes()).hexdigest() == archive, (
        proc.stderr
    )


def test_keep_runs_the_s3_store_frees_superseded_blobs_directly(moto_s3: Any, s3_runs: Any) -> None:
    """gc --keep-runs 1 on S3 with nothing in the way: the superseded run's blobs go in one gc."""
    url, first, second = _copied(s3_runs, moto_s3)
    store = ArtifactStore(url)
    before = _records(store)
    expected = _named([r for r in before if r["run_id"] == first["run_id"]]) - _named(
        [r for r in before if r["run_id"] == second["run_id"]]
    )
    code, doc, stderr = _s3_json(["gc", "--store", url, "--keep-runs", "1", "--grace", "0"])
    assert code == 0, stderr
    assert set(doc["retention"]["deleted"]) == expected and doc["retention"]["deleted_bytes"] > 0
    assert not expected & _present(store)
    code, lineage, stderr = _s3_json(["lineage", "--store", url, _model(second, "mlp")["artifacts"]["serialized"]])
    assert code == 0, stderr


def test_retention_config_is_checked_and_applied_after_a_served_run(tmp_path: Path, prefect_server: str) -> None:
    """The config's retention block: refused without keep_runs/keep_days; applied by the fleet flow
    when serve asks (apply_retention), not by a plain run."""
    from pt2flow.flows.config import load_config
    from pt2flow.flows.config.issues import ConfigError

    bad = write_config(tmp_path / "bad.yaml", _models(16)[:1], retention={"grace_seconds": 5})
    with pytest.raises(ConfigError, match="retention needs keep_runs, keep_days or both"):
        load_config(str(bad))
    proc = run_cli(["validate", str(bad)])
    assert proc.returncode == 2 and "retention" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

    store = str(tmp_path / "store")
    config = write_config(
        tmp_path / "c.yaml",
        _models(16)[:1],
        stages=["trace", "serialize"],
        retention={"keep_runs": 1, "grace_seconds": 0},
    )
    assert load_config(str(config)).retention.keep_runs == 1
    first = _run(config, store)
    write_config(config, _models(32)[:1], stages=["trace", "serialize"], retention={"keep_runs": 1, "grace_seconds": 0})
    second = _run(config, store)  # a plain run applies no retention
    assert {r["run_id"] for r in _records(ArtifactStore(store))} == {first["run_id"], second["run_id"]}

    from pt2flow.flows.fleet import fleet_flow

    state = fleet_flow(
        config_path=str(config), store=store, apply_retention=True, return_state=True
    )  # on prefect_server
    served = state.result(raise_on_failure=False)
    # the served run (all cached) is mlp's newest; run 2 built what it reused, so run 2 stays
    assert {r["run_id"] for r in _records(ArtifactStore(store))} == {second["run_id"], served["run_id"]}
    assert _model(first, "mlp")["artifacts"]["serialized"] not in _present(ArtifactStore(store))


def test_gc_keeps_each_models_newest_artifact_of_every_kind(tmp_path: Path) -> None:
    """`make demo` then the README's walk (issue 31): a plain run, a targets run (onnx,
    executorch) into the same store, then two `--only mlp` runs without targets. mlp's newest run
    built no targets, yet `gc --keep-runs 1` keeps its .onnx and .pte (and their lineage): `get
    --artifact onnx|pte` hands out the targets run's files, which ONNX Runtime runs in a fresh
    process; the dry run lists what goes by model and kind, and only cached records go."""
    store = str(tmp_path / "store")
    plain = write_config(
        tmp_path / "demo.yaml", _models(16), stages=["trace", "functionalize", "serialize", "validate"]
    )
    targets = write_config(
        tmp_path / "targets.yaml",
        _models(16),
        stages=["trace", "functionalize", "serialize", "onnx", "executorch", "validate"],
    )
    first = _run(plain, store)
    built = _run(targets, store)
    later = [_run(plain, store, only=["mlp"]) for _ in range(2)]
    onnx, pte = (_model(built, "mlp")["artifacts"][kind] for kind in ("onnx", "pte"))
    assert onnx and pte and all(_model(doc, "mlp")["artifacts"].get("onnx") is None for doc in later)
    before = _records(ArtifactStore(store))

    code, doc, stderr = run_json(["gc", "--store", store, "--keep-runs", "1", "--dry-run"])
    assert code == 0, stderr
    plan = doc["retention"]
    assert plan["kept_runs"] == {"mlp": [later[1]["run_id"]], "other": [built["run_id"]]}
    assert plan["kept_newest"]["mlp"]["onnx"] == plan["kept_newest"]["mlp"]["executorch"] == built["run_id"]
    dropped = {(k["model"], k["stage"]): sorted(k["runs"]) for k in plan["dropped_kinds"]}
    # mlp: the records of the targets run and of the first --only run go (cached, or a validate
    # another validate superseded); the builders of the kept ones stay (the first run's validate
    # built the newest run's cached one). other keeps its newest run, whose validate is not the first's.
    gone = sorted([built["run_id"], later[0]["run_id"]])
    assert dropped == {
        ("mlp", stage): gone for stage in ("source", "trace", "functionalize", "serialize", "validate")
    } | {("other", "validate"): [first["run_id"]]}, dropped
    proc = run_cli(["gc", "--store", store, "--keep-runs", "1", "--dry-run"])
    assert (
        proc.returncode == 0
        and "by model and kind:" in proc.stdout
        and "  mlp validate: 2 record(s) of 2 run(s)" in proc.stdout
    ), proc.stdout
    assert len(_records(ArtifactStore(store))) == len(before)

    code, doc, stderr = run_json(["gc", "--store", store, "--keep-runs", "1", "--grace", "0"])
    assert code == 0, stderr
    present = _present(ArtifactStore(store))
    assert {onnx, pte} <= present and not {onnx, pte} & set(doc["retention"]["deleted"])
    kept = _records(ArtifactStore(store))
    assert _named(kept) == present  # nothing kept that no record names, nothing named missing
    for kind, digest in (("onnx", onnx), ("pte", pte)):
        out = tmp_path / f"mlp.{kind}"
        proc = run_cli(["get", "--store", store, "--model", "mlp", "--artifact", kind, "-o", str(out)])
        assert proc.returncode == 0, proc.stderr
        assert hashlib.sha256(out.read_bytes()).hexdigest() == digest
    # ground truth outside pt2flow: ONNX Runtime runs the file in a fresh process (tiny_mlp: 8 -> 4 features)
    import subprocess
    import sys

    script = (
        "import sys, numpy, onnxruntime as ort; s = ort.InferenceSession(sys.argv[1]); "
        "print(s.run(None, {s.get_inputs()[0].name: numpy.ones((3, 8), numpy.float32)})[0].shape)"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "mlp.onnx")], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0 and ran.stdout.strip() == "(3, 4)", ran.stderr[-2000:]
    code, lineage, stderr = run_json(["lineage", "--store", store, onnx])
    assert code == 0, stderr
    assert {r["stage"] for r in lineage["ancestors"]} == {
        "source",
        "trace",
        "functionalize",
    }  # the onnx's lineage stayed whole
