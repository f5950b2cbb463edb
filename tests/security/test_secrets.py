"""Credentials never leave the process environment.

A real `pt2flow run` on S3 (the moto server) with sentinel credentials in the environment
(AWS_SECRET_ACCESS_KEY, used to read the weights) and in the config's storage_options (a literal
value and a ${VAR} reference, used for the store). Then the sentinels must appear in no stdout or
stderr line, no object of the store (blobs and index files, read as bytes and as tables), no file
under PREFECT_HOME (the Prefect database with every flow and task parameter and log line, the
server log, any result storage), and no error message: neither a model's failure inside the run
nor the refusal of a store that does not exist.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pyarrow.parquet as pq
import pytest

from pt2flow.flows.engine.services.prefect_server import DATABASE
from tests.conftest import run_cli, write_config
from tests.security.conftest import MLP, STAGES

pytestmark = pytest.mark.integration

TAG = uuid.uuid4().hex[:10]
SENTINELS = {
    "env": f"SENTINEL-ENV-{TAG}",  # AWS_SECRET_ACCESS_KEY
    "literal": f"SENTINEL-LIT-{TAG}",  # storage_options.secret written in the config
    "expanded": f"SENTINEL-EXP-{TAG}",  # storage_options.client_kwargs.aws_session_token: ${PT2FLOW_SENTINEL_TOKEN}
}


def leaks(text: str | bytes) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [name for name, value in SENTINELS.items() if value.encode() in data]


def s3_objects(endpoint: Any, prefix: str) -> Iterator[tuple[str, bytes]]:
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint.url, aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1"
    )
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=endpoint.bucket, Prefix=prefix)
    for page in pages:
        for item in page.get("Contents", []):
            yield item["Key"], client.get_object(Bucket=endpoint.bucket, Key=item["Key"])["Body"].read()


@pytest.fixture(scope="module")
def secret_run(moto_s3, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import boto3
    from safetensors.torch import save

    from tests.models import tiny_mlp

    root = tmp_path_factory.mktemp("secrets")
    prefix = f"secrets-{TAG}"
    client = boto3.client(
        "s3", endpoint_url=moto_s3.url, aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1"
    )
    weights = save({k: v.contiguous() for k, v in tiny_mlp().state_dict().items()})
    client.put_object(Bucket=moto_s3.bucket, Key=f"{prefix}-weights/mlp.safetensors", Body=weights)

    config = write_config(
        root / "pipeline.yaml",
        [
            {**MLP, "weights": f"s3://{moto_s3.bucket}/{prefix}-weights/mlp.safetensors"},
            {**MLP, "name": "missing-weights", "weights": f"s3://{moto_s3.bucket}/{prefix}-weights/absent.safetensors"},
        ],
        store=f"s3://{moto_s3.bucket}/{prefix}",
        storage_options={
            "key": "pt2flow-test-key",
            "secret": SENTINELS["literal"],
            "client_kwargs": {"aws_session_token": "${PT2FLOW_SENTINEL_TOKEN}"},
        },
        stages=STAGES,
    )
    env = {**moto_s3.env, "AWS_SECRET_ACCESS_KEY": SENTINELS["env"], "PT2FLOW_SENTINEL_TOKEN": SENTINELS["expanded"]}
    proc = run_cli(["run", str(config), "--json", "--verbose"], env=env, timeout=600)
    bad_bucket = run_cli(
        ["run", str(config), "--store", f"s3://pt2flow-no-such-bucket-{TAG}/x", "--json"], env=env, timeout=300
    )
    return {"proc": proc, "bad_bucket": bad_bucket, "prefix": prefix, "config": config, "endpoint": moto_s3}


def test_the_run_used_the_credentials_and_reported_both_models(secret_run: dict[str, Any]) -> None:
    proc = secret_run["proc"]
    assert proc.returncode == 1, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    by_name = {m["name"]: m for m in doc["models"]}
    assert by_name["mlp"]["status"] == "ok" and by_name["mlp"]["validation"]["passed"] is True
    assert by_name["missing-weights"]["error_class"] == "weights"
    assert "absent.safetensors" in by_name["missing-weights"]["error"]


def test_no_sentinel_in_stdout_or_stderr(secret_run: dict[str, Any]) -> None:
    proc = secret_run["proc"]
    assert proc.stderr.strip(), "--verbose run printed no log lines: nothing was checked"
    for stream in (proc.stdout, proc.stderr):
        for line in stream.splitlines():
            assert not leaks(line), line


def test_no_sentinel_in_any_store_object(secret_run: dict[str, Any]) -> None:
    objects = dict(s3_objects(secret_run["endpoint"], secret_run["prefix"] + "/"))
    index_files = [key for key in objects if key.endswith(".parquet")]
    blobs = [key for key in objects if "/blobs/sha256/" in key]
    assert index_files and len(blobs) >= 5
    for key, data in objects.items():
        assert not leaks(data), key
    for key in index_files:
        table = pq.read_table(io.BytesIO(objects[key]))
        text = repr(table.to_pylist()) + repr(table.schema.metadata)
        assert not leaks(text), key
        assert "mlp" in text  # the records are readable, so the check above means something


def _task_runs_recorded(home: Path) -> None:
    """Wait until the server has written every task run it was sent: it records them in batches,
    a flush a second (flows/engine/services/prefect_runtime.py BATCHED_TASK_RUNS); two reads of
    the task runs and their states 2 s apart that agree."""
    import sqlite3
    import time

    def rows() -> list[tuple[Any, ...]]:
        with sqlite3.connect(home / DATABASE) as db:
            return db.execute(
                "SELECT t.id, t.state_type, count(s.id) FROM task_run t LEFT JOIN task_run_state s ON s.task_run_id = t.id GROUP BY t.id"
            ).fetchall()

    before, deadline = rows(), time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(2)
        now = rows()
        if now == before:
            break
        before = now
    assert before, "no task run recorded"


def test_no_sentinel_in_prefect_state(secret_run: dict[str, Any]) -> None:
    """Every file under PREFECT_HOME: the SQLite database (and its WAL) with flow and task run
    parameters, states and log lines; the server log; any result storage."""
    home = Path(os.environ["PREFECT_HOME"])
    _task_runs_recorded(home)
    files = [p for p in home.rglob("*") if p.is_file()]
    assert any(p.name.startswith("prefect.db") for p in files)
    everything = b""
    for path in files:
        data = path.read_bytes()
        assert not leaks(data), path
        everything += data
    doc_run_id = json.loads(secret_run["proc"].stdout)["run_id"]
    assert doc_run_id.encode() in everything  # the run's parameters are in what was searched
    assert b"mlp: trace" in everything  # and so are its log lines


def test_no_sentinel_in_the_errors_of_a_bucket_that_does_not_exist(secret_run: dict[str, Any]) -> None:
    """The store cannot be written: every model fails with a storage error (exit 1) whose message,
    like every other line, carries no credential."""
    proc = secret_run["bad_bucket"]
    assert proc.returncode in (1, 2), proc.stderr[-3000:]
    if proc.returncode == 1:
        assert proc.stdout.startswith("{"), proc.stderr[-3000:]  # --json: the document, every model failed
        doc = json.loads(proc.stdout)
        errors = [m["error"] for m in doc["models"]]
        assert all("pt2flow-no-such-bucket" in e and "bucket does not exist" in e for e in errors), errors
    assert "pt2flow-no-such-bucket" in proc.stdout + proc.stderr
    assert not leaks(proc.stdout + proc.stderr)


def test_credentials_in_a_store_url_stay_out_of_the_error(tmp_path: Path) -> None:
    """fsspec reads user:password@ from URLs such as ftp://; such a URL would be stored in
    Prefect's flow parameters, so it is refused up front, without echoing the secret."""
    config = write_config(tmp_path / "c.yaml", [MLP], stages=STAGES)
    secret = SENTINELS["literal"]
    proc = run_cli(["run", str(config), "--store", f"ftp://user:{secret}@127.0.0.1:1/store", "--json"], timeout=120)
    assert proc.returncode == 2
    assert "holds credentials" in proc.stderr
    assert not leaks(proc.stdout + proc.stderr), proc.stderr
