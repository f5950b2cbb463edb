"""A model's next stage goes to its worker as soon as the stage before it came back, before that
stage's record and Prefect task end (flows/engine/orchestrator/runner.py, Ahead); work sent ahead
that its model does not take is waited for and dropped, so the next model's stages never read it.

The ground truth: the index records' own timestamps, the programs in the store loaded with
torch.export.load, and what a later run finds to do.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from pt2flow.storage import ArtifactStore, StorageError
from tests.conftest import run_in_process, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]


def _config(tmp_path: Path, hidden: list[int]) -> Path:
    models = [
        {
            "name": f"m{size}",
            "factory": "tests.models:tiny_mlp",
            "kwargs": {"hidden": size},
            "inputs": {"x": {"shape": [3, 8]}},
        }
        for size in hidden
    ]
    return write_config(tmp_path / "fleet.yaml", models, stages=STAGES, defaults={"validate": {"samples": 1}})


def _records(store: str, run_id: str) -> list[dict[str, Any]]:
    rows = ArtifactStore(store).index.read().to_pylist()
    return [r for r in rows if r["run_id"] == run_id]


def test_each_stage_starts_before_the_stage_before_it_is_recorded(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    code, document = run_in_process(_config(tmp_path, [12]), store=store, workers=1)
    assert code == 0, document
    by_stage = {r["stage"]: r for r in _records(store, document["run_id"])}
    chain = ["source", *STAGES]
    assert sorted(by_stage) == sorted(chain)
    for before, after in zip(chain, chain[1:]):
        # the stage after began (its work was sent) before the stage before it had its record
        assert by_stage[after]["started_at"] < by_stage[before]["ended_at"], (before, after)
        assert by_stage[after]["parent_keys"][-1] == by_stage[before]["key"]  # and on its output


def test_work_sent_ahead_for_a_model_that_fails_first_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """m12's trace is computed, functionalize is sent ahead, and then trace's record cannot be
    written (not a transient error): m12 fails at trace. Its functionalize's answer is waited for
    and dropped; m20, on the same worker, gets its own answers at every stage."""
    store = str(tmp_path / "store")
    index_class = ArtifactStore(store).index.__class__
    real_append = index_class.append

    def append(self: Any, records: Any) -> Any:
        if any(r.model == "m12" and r.stage == "trace" for r in records):
            raise StorageError("injected: the index refuses m12's trace record")
        return real_append(self, records)

    monkeypatch.setattr(index_class, "append", append)
    code, document = run_in_process(_config(tmp_path, [12, 20]), store=store, workers=1)
    monkeypatch.undo()
    assert code == 1, document
    first, second = document["models"]
    assert (first["status"], first["failed_stage"], first["error_class"]) == ("failed", "trace", "storage"), first
    assert "injected" in first["error"]
    assert second["status"] == "ok", second
    assert second["worker"] == first["worker"]  # one worker: it answered m12's dropped stage, then m20's

    # m20's programs are m20's: its hidden size in every weight shape
    blobs = ArtifactStore(store)
    for stage in ("trace", "functionalize", "decompose"):
        digest = second["stages"][stage]["artifact"]
        program = torch.export.load(io.BytesIO(blobs.get_blob(digest)))
        assert program.state_dict["fc1.weight"].shape == (20, 8), stage
    assert second["validation"]["passed"] is True

    # m12's dropped functionalize has no record: the next run computes it (and trace, unrecorded)
    code, again = run_in_process(_config(tmp_path, [12, 20]), store=store, workers=1)
    assert code == 0, again
    stages = again["models"][0]["stages"]
    assert [stages[s]["cached"] for s in STAGES] == [False] * len(STAGES)
    assert [s["cached"] for s in again["models"][1]["stages"].values()] == [True] * len(STAGES)
    program = torch.export.load(io.BytesIO(blobs.get_blob(stages["functionalize"]["artifact"])))
    assert program.state_dict["fc1.weight"].shape == (12, 8)
