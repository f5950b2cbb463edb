"""A Prefect task that fails with a transient storage error is retried by Prefect, and the retry
re-uses what the failed attempt already published: one blob, one ok record.

The fault is injected with PT2FLOW_FAULT_AT=<point>@N (storage.faults.crash_point raises a
TransientStorageError there, once, in the process that reaches it): after the trace blob is
uploaded by the worker process but before the orchestrator records it, as the orchestrator is
about to write its record, and after its record is written but before the task returns. The fleet flow `pt2flow run` runs (flows/fleet.py) runs in
this process (against the session's Prefect server) with a fresh worker pool that inherits the
fault setting.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pt2flow.flows.engine.orchestrator.model_flow import STAGE_RETRIES
from pt2flow.flows.fleet import fleet_flow
from pt2flow.storage import ArtifactStore
from pt2flow.storage.errors import TransientStorageError
from pt2flow.storage.faults import reset_points
from tests.conftest import write_config
from tests.reliability import stats

pytestmark = pytest.mark.integration

STAGES = ("trace", "functionalize")


def _run(tmp_path: Path) -> tuple[Any, dict[str, Any], str]:
    """The fleet flow on a one-model config: (its final state, the model's entry, the store)."""
    config = write_config(
        tmp_path / "retry.yaml",
        [{"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [3, 8]}}}],
        stages=list(STAGES),
    )
    store = str(tmp_path / "store")
    state = fleet_flow(str(config), store=store, return_state=True)
    document = state.result(raise_on_failure=False)
    return state, document["models"][0], store


def _task_runs(flow_run_id: Any, stages: tuple[str, ...] = STAGES) -> dict[str, int]:
    """Each task run of the flow run: its task's name -> how many times it ran. The server records
    task runs from their events, in batches (flows/engine/services/prefect_runtime.py
    BATCHED_TASK_RUNS: within a second): read once the model's task and each of its stages' are
    there (`stages`: those the model reached), all in a final state."""
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    expected = {"mlp", "source", *stages}
    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            named = {
                run.name.rsplit("-", 1)[0]: run for run in runs
            }  # "<task>-<suffix>", a model's task its name alone
            if (
                set(named) == expected and all(run.state is not None and run.state.is_final() for run in runs)
            ) or time.monotonic() > deadline:
                return {name: run.run_count for name, run in named.items()}
            time.sleep(0.2)


@pytest.fixture
def fresh_pool() -> Any:
    """A worker pool started after the test armed its fault (workers read it at start)."""
    from pt2flow.flows.engine.orchestrator.pool import stop_pool

    stop_pool()
    reset_points()
    yield
    stop_pool()
    reset_points()


@pytest.mark.parametrize("point", ["after_blob_upload@2", "before_index_append@2", "after_index_append@2"])
def test_retried_task_reuses_what_it_already_published(
    point: str, tmp_path: Path, prefect_server: str, fresh_pool: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the 2nd blob (written by the worker) / the 2nd record (written here) is trace's; source is 1st
    monkeypatch.setenv("PT2FLOW_FAULT_AT", point)

    state, result, store_url = _run(tmp_path)
    assert result["status"] == "ok", result
    assert _task_runs(state.state_details.flow_run_id)["trace"] == 2  # failed once, retried once by Prefect

    trace = result["stages"]["trace"]["artifact"]
    store = ArtifactStore(store_url)
    assert store.blob_status(trace) == "ok"
    # after_blob_upload: the retry re-ran the stage, found its blob in the store and recorded it once;
    # before_index_append: the same, after waiting for and dropping functionalize, sent ahead as
    # trace came back (runner.Ahead), which then ran again in its own task;
    # after_index_append: the retry found its own record and did not run the stage again
    records = store.index.read(["stage", "status", "run_id", "sha256"]).to_pylist()
    assert Counter((r["stage"], r["status"]) for r in records) == Counter(
        {("source", "ok"): 1, ("trace", "ok"): 1, ("functionalize", "ok"): 1}
    )
    assert [r["sha256"] for r in records if r["stage"] == "trace"] == [trace]
    stats.add_faults(1)


def test_a_storage_outage_outlasting_the_retries_is_recorded_once_as_a_storage_failure(
    tmp_path: Path, prefect_server: str, fresh_pool: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    store_url = str(tmp_path / "store")
    # once the source is recorded, the index cannot be read (every cache lookup fails); appends still work.
    # trace was looked up and sent to the worker as the source came back, before its record
    # (runner.Ahead): functionalize is the first stage whose lookups fail
    index_class = ArtifactStore(store_url).index.__class__
    real_append = index_class.append
    calls = Counter()

    def append(self: Any, records: Any) -> Any:
        calls["append"] += 1
        return real_append(self, records)

    def failing(real: Any) -> Any:
        def read(self: Any, *args: Any, **kwargs: Any) -> Any:
            if calls["append"] >= 1:
                calls["failed_read"] += 1
                raise TransientStorageError("injected outage: 503 Service Unavailable")
            return real(self, *args, **kwargs)

        return read

    monkeypatch.setattr(index_class, "append", append)
    for reader in ("read", "with_key"):  # a filtered read, and the key lookup before each stage
        monkeypatch.setattr(index_class, reader, failing(getattr(index_class, reader)))
    state, result, _ = _run(tmp_path)
    monkeypatch.undo()
    assert (
        result["status"] == "failed"
        and result["failed_stage"] == "functionalize"
        and result["error_class"] == "storage"
    ), result
    assert "injected outage" in result["error"]
    # one lookup as trace came back (so functionalize was not sent ahead), then one per functionalize attempt
    assert calls["failed_read"] == 2 + STAGE_RETRIES
    assert _task_runs(state.state_details.flow_run_id) == {
        "mlp": 1,
        "source": 1,
        "trace": 1,
        "functionalize": 1 + STAGE_RETRIES,
    }
    records = ArtifactStore(store_url).index.read(["stage", "status", "error_class"]).to_pylist()
    assert sorted((r["stage"], r["status"], r["error_class"]) for r in records) == [
        ("functionalize", "failed", "storage"),
        ("source", "ok", None),
        ("trace", "ok", None),
    ]
    stats.add_faults(2 + STAGE_RETRIES)
