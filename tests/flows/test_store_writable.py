"""A local store that cannot be written is refused before anything runs by every way a fleet
starts (`api.run`, `pt2flow run`, `serve`, `upgrade-check`: flows/api/running.py
open_checked_store), as a UsageError (the CLI's exit 2) naming the store and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import write_config

MODEL = {"name": "m", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [2, 8]}}}


def test_api_run_refuses_a_store_under_a_regular_file_before_anything_runs(tmp_path: Path) -> None:
    from pt2flow.flows import api

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the store's parent folder would go\n")
    config = write_config(tmp_path / "c.yaml", [MODEL], stages=["trace", "serialize", "validate"])
    with pytest.raises(api.UsageError) as caught:
        api.run(config, store=str(blocker / "store"))
    message = str(caught.value)
    assert f"the store {blocker / 'store'} cannot be written" in message, message
    assert "a file stands where the store's folder (or one above it) would go" in message
    assert blocker.read_text().startswith("a file where")  # nothing written, nothing replaced


def test_a_writable_store_passes_and_keeps_no_probe(tmp_path: Path) -> None:
    from pt2flow.flows.api.running import refuse_unwritable_store
    from pt2flow.storage import ArtifactStore

    store = ArtifactStore(str(tmp_path / "fresh" / "store"))
    refuse_unwritable_store(store)
    assert (tmp_path / "fresh" / "store").is_dir()
    assert [p.name for p in (tmp_path / "fresh" / "store").iterdir() if p.name.startswith(".pt2flow-write-probe")] == []
