"""The summary of `pt2flow run` reports the command's whole wall time: from the process's start
(interpreter, imports, Prefect's server, the workers importing torch), not from the flow's."""

from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from pt2flow.storage import ArtifactStore
from tests.conftest import BIN, cli_env, write_config

pytestmark = pytest.mark.integration


def test_the_summary_counts_from_the_start_of_the_command(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "one.yaml",
        [{"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [3, 8]}}}],
        stages=["trace", "serialize"],
    )
    launched = time.time()
    proc = subprocess.run(
        [str(BIN / "pt2flow"), "run", str(config), "--store", str(tmp_path / "store"), "--json"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=600,
    )
    waited = time.time() - launched
    assert proc.returncode == 0, proc.stderr[-3000:]
    document = json.loads(proc.stdout)
    rows = ArtifactStore(str(tmp_path / "store")).index.read(columns=["run_id", "ended_at"]).to_pylist()
    last_end = max(
        r["ended_at"] for r in rows if r["run_id"] == document["run_id"] and isinstance(r["ended_at"], datetime)
    )
    # The last stage ended this long after the command was started; the summary was written later
    # still. A summary counted from the flow's start misses the seconds before it (Prefect's server
    # starting: several seconds); the half second allows for fork and exec before the process exists.
    assert document["summary"]["seconds"] >= last_end.timestamp() - launched - 0.5, (
        document["summary"],
        last_end.timestamp() - launched,
    )
    assert document["summary"]["seconds"] <= waited
