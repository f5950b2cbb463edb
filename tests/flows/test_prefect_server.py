"""The shared local Prefect server (flows/engine/services/prefect_server.py): the first run of a
PREFECT_HOME starts it, the next runs reuse it, it holds no run's storage options, and it stops
once no run has used it for PT2FLOW_PREFECT_SERVER_IDLE_S. PT2FLOW_PREFECT_SERVER=private keeps
the old way: a server per run, gone with it."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import psutil
import pytest

from pt2flow.flows.engine.services.prefect_server import DATABASE
from tests.conftest import run_json, stop_shared_server, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]
SECRET = "pt2flow-test-secret-value"


def _fleet(tmp_path: Path, name: str, hidden: int = 16) -> Path:
    model = {
        "name": name,
        "factory": "tests.models:tiny_mlp",
        "kwargs": {"hidden": hidden},
        "inputs": {"x": {"shape": [2, 8]}},
    }
    return write_config(tmp_path / f"{name}.yaml", [model], stages=STAGES, store=str(tmp_path / "store"))


def _server(home: Path) -> dict:
    return json.loads((home / "pt2flow-server.json").read_text())


def _database(path: Path) -> tuple[str, int]:
    """(alembic revision, flow runs) of a Prefect database (a file, or a PREFECT_HOME's), read with sqlite3 alone."""
    with sqlite3.connect(path / DATABASE if path.is_dir() else path) as db:
        (revision,) = db.execute("SELECT version_num FROM alembic_version").fetchone()
        (runs,) = db.execute("SELECT count(*) FROM flow_run").fetchone()
    return revision, runs


def _task_runs(home: Path) -> dict[str, list[tuple[str, str, int]]]:
    """flow run id -> (task run name, its state, how many states it went through), read with sqlite3 alone."""
    with sqlite3.connect(home / DATABASE) as db:
        rows = db.execute(
            "SELECT t.flow_run_id, t.name, t.state_type, count(s.id) FROM task_run t LEFT JOIN task_run_state s ON s.task_run_id = t.id"
            " GROUP BY t.id ORDER BY t.flow_run_id, t.name"
        ).fetchall()
    runs: dict[str, list[tuple[str, str, int]]] = {}
    for flow_run, name, state, states in rows:
        runs.setdefault(flow_run, []).append((name, state, states))
    return runs


def test_runs_share_one_server_that_holds_no_secrets_and_stops_when_idle(tmp_path: Path) -> None:
    """Also: a fresh PREFECT_HOME's database is a copy of an empty one Prefect migrated, made once
    (prefect_server.seed_database) in the user's cache; the runs are recorded in it."""
    home, cache = tmp_path / "prefect-home", tmp_path / "cache"
    # idle: longer than a loaded machine takes between two runs (6 s was not, once)
    env = {"PREFECT_HOME": str(home), "PT2FLOW_PREFECT_SERVER_IDLE_S": "20", "XDG_CACHE_HOME": str(cache)}
    try:
        code, first, stderr = run_json(
            ["run", str(_fleet(tmp_path, "a")), "--storage-option", f"secret={SECRET}", "--json"], env=env
        )
        assert code == 0, stderr[-3000:]
        server = _server(home)
        process = psutil.Process(server["pid"])
        assert process.is_running() and "prefect_server" in " ".join(process.cmdline())
        environ = process.environ()
        assert "PT2FLOW_STORAGE_OPTIONS" not in environ and SECRET not in json.dumps(environ)
        assert environ["PREFECT_HOME"] == str(home) and environ["PREFECT_API_BLOCKS_REGISTER_ON_START"] == "false"
        assert environ["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"] == "200"  # task runs recorded in batches
        assert environ["PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED"] == "false"  # no events kept twice

        code, second, stderr = run_json(
            ["run", str(_fleet(tmp_path, "b", hidden=24)), "--json"], env=env
        )  # work to do: it needs Prefect
        assert code == 0, stderr[-3000:]
        assert second["models"][0]["stages"]["trace"]["cached"] is False
        assert _server(home)["pid"] == server["pid"]  # the same server answered the second run
        assert list((home / "pt2flow-server.leases").iterdir()) == []  # both runs gave their lease back

        deadline = time.monotonic() + 60
        while process.is_running() and process.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE, "the idle server did not stop"
        assert not (home / "pt2flow-server.json").exists()

        (template,) = (cache / "pt2flow" / "prefect-db").iterdir()
        assert template.name.startswith("prefect-") and template.suffix == ".db"
        assert f"Prefect database of {home}: made and copied" in (home / "pt2flow-server.log").read_text()
        revision, runs = _database(home)
        assert runs == 2 and _database(template) == (revision, 0)  # both runs recorded; the template untouched
        # every task run of both runs is in the database, batched or not: the model's task and one
        # per stage it ran and one for its source, each completed through pending, running, completed
        for run in (first, second):
            model = run["models"][0]
            assert run["summary"]["ok"] == 1 and list(model["stages"]) == STAGES
        recorded = sorted(
            sorted((name.rpartition("-")[0] or name, state, states) for name, state, states in tasks)
            for tasks in _task_runs(home).values()
        )
        expected = sorted(
            sorted([(name, "COMPLETED", 3), *[(stage, "COMPLETED", 3) for stage in ("source", *STAGES)]])
            for name in ("a", "b")
        )
        assert recorded == expected, recorded
        with sqlite3.connect(home / DATABASE) as db:  # the task runs above came without persisted events
            assert db.execute("SELECT count(*) FROM events").fetchone() == (0,)
        made = template.stat().st_mtime_ns
        other = tmp_path / "another-home"  # a second fresh home: copied, not made again
        code, _, stderr = run_json(
            ["run", str(_fleet(tmp_path, "c", hidden=20)), "--json"], env={**env, "PREFECT_HOME": str(other)}
        )
        assert code == 0, stderr[-3000:]
        assert f"Prefect database of {other}: copied" in (other / "pt2flow-server.log").read_text()
        assert _database(other) == (revision, 1) and template.stat().st_mtime_ns == made
    finally:
        stop_shared_server(home)
        stop_shared_server(tmp_path / "another-home")


def test_a_private_server_goes_with_its_run(tmp_path: Path) -> None:
    home = tmp_path / "prefect-home"
    code, _, stderr = run_json(
        ["run", str(_fleet(tmp_path, "a")), "--json"],
        env={"PREFECT_HOME": str(home), "PT2FLOW_PREFECT_SERVER": "private"},
    )
    assert code == 0, stderr[-3000:]
    assert not (home / "pt2flow-server.json").exists()
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(home) in " ".join(p.info["cmdline"] or [])]
