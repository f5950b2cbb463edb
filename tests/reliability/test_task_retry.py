"""A Prefect task that fails with a transient storage error is retried by Prefect, and the retry
re-uses what the failed attempt already published: no second upload, one ok record.

The fault is injected with PT2FLOW_FAULT_AT=<point>@N (storage.fs.crash_point raises a
TransientStorageError there, once): after the trace blob is uploaded but before its record is
written, and after its record is written but before the task returns. The flows run in this
process (against the session's Prefect server) so that uploads can be counted.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import storage.store
from flows.config import load_config
from flows.pipeline import STAGE_RETRIES, RunContext, export_model_flow, new_run_id
from storage import ArtifactStore
from storage.errors import TransientStorageError
from storage.fs import reset_points
from tests.conftest import write_config
from tests.reliability import stats

pytestmark = pytest.mark.integration

STAGES = ("trace", "functionalize")


def _model(tmp_path: Path) -> Any:
    config = write_config(
        tmp_path / "retry.yaml",
        [{"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [3, 8]}}}],
        stages=list(STAGES),
    )
    return load_config(config).models[0]


def _task_runs(flow_run_id: Any) -> dict[str, int]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0]: run.run_count for run in runs}  # task run names are "<task>-<suffix>"


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, Counter]:
    """Counts put_blob calls and actual uploads (atomic_write) per digest."""
    counts: dict[str, Counter] = {"puts": Counter(), "uploads": Counter()}
    real_put, real_write = ArtifactStore.put_blob, storage.store.atomic_write

    def put_blob(self: ArtifactStore, data: bytes) -> Any:
        counts["puts"][hashlib.sha256(data).hexdigest()] += 1
        return real_put(self, data)

    def atomic_write(fs: Any, path: str, data: bytes, **kwargs: Any) -> bool:
        counts["uploads"][path.rsplit("/", 1)[-1]] += 1
        return real_write(fs, path, data, **kwargs)

    monkeypatch.setattr(ArtifactStore, "put_blob", put_blob)
    monkeypatch.setattr(storage.store, "atomic_write", atomic_write)
    reset_points()
    yield counts
    reset_points()


@pytest.mark.parametrize("point", ["after_blob_upload@2", "after_index_append@2"])
def test_retried_task_reuses_what_it_already_published(point: str, tmp_path: Path, prefect_server: str, counted: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tmp_path)
    ctx = RunContext(run_id=new_run_id(), store_url=str(tmp_path / "store"), stages=STAGES)
    monkeypatch.setenv("PT2FLOW_FAULT_AT", point)  # the 2nd blob / 2nd record is trace's (source is 1st)

    state = export_model_flow(model, ctx, return_state=True)
    result = state.result(raise_on_failure=False)
    assert result["status"] == "ok", result
    assert _task_runs(state.state_details.flow_run_id)["trace"] == 2  # failed once, retried once by Prefect

    trace = result["stages"]["trace"]["artifact"]
    assert counted["uploads"][trace] == 1, "the retry uploaded the blob again"
    # after_blob_upload: the retry re-ran the stage, found its blob in the store, did not upload it;
    # after_index_append: the retry found its own record and did not even re-run the stage
    assert counted["puts"][trace] == (2 if point.startswith("after_blob_upload") else 1)
    records = ArtifactStore(ctx.store_url).index.read(["stage", "status", "run_id", "sha256"]).to_pylist()
    assert Counter((r["stage"], r["status"]) for r in records) == Counter({("source", "ok"): 1, ("trace", "ok"): 1, ("functionalize", "ok"): 1})
    assert all(n == 1 for n in counted["uploads"].values() if n)  # nothing uploaded twice
    stats.add_faults(1)


def test_a_storage_outage_outlasting_the_retries_is_recorded_once_as_a_storage_failure(tmp_path: Path, prefect_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tmp_path)
    ctx = RunContext(run_id=new_run_id(), store_url=str(tmp_path / "store"), stages=STAGES)
    real_put = ArtifactStore.put_blob
    calls = Counter()

    def put_blob(self: ArtifactStore, data: bytes) -> Any:
        calls["put"] += 1
        if calls["put"] > 1:  # the source blob goes through; the store is down from then on
            raise TransientStorageError("injected outage: 503 Service Unavailable")
        return real_put(self, data)

    monkeypatch.setattr(ArtifactStore, "put_blob", put_blob)
    state = export_model_flow(model, ctx, return_state=True)
    result = state.result(raise_on_failure=False)
    assert result["status"] == "failed" and result["failed_stage"] == "trace" and result["error_class"] == "storage", result
    assert calls["put"] == 1 + (1 + STAGE_RETRIES)  # source, then every trace attempt
    assert _task_runs(state.state_details.flow_run_id)["trace"] == 1 + STAGE_RETRIES
    records = ArtifactStore(ctx.store_url).index.read(["stage", "status", "error_class"]).to_pylist()
    trace = [r for r in records if r["stage"] == "trace"]
    assert trace == [{"record_id": trace[0]["record_id"], "stage": "trace", "status": "failed", "error_class": "storage"}]
    stats.add_faults(1 + STAGE_RETRIES)
