"""The OpenLineage emitter's contract in isolation (flows/engine/lineage/events.py): on only with
the client's standard configuration, and a collector that refuses costs each run one warning,
never an exception. A real fleet's events go to a real server in
tests/integration/test_failure_groups.py."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from pt2flow.flows.engine.lineage.events import Emitter, configured, run_event


@pytest.fixture
def no_lineage_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for key in list(__import__("os").environ):
        if key.startswith("OPENLINEAGE"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_on_only_with_the_clients_standard_configuration(no_lineage_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not configured()
    (no_lineage_env / "openlineage.yml").write_text("transport: {type: console}\n")
    assert configured()
    monkeypatch.setenv("OPENLINEAGE_DISABLED", "true")
    assert not configured()
    monkeypatch.delenv("OPENLINEAGE_DISABLED")
    (no_lineage_env / "openlineage.yml").unlink()
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__TYPE", "console")
    assert configured()


def test_a_refusing_collector_costs_each_run_one_warning(
    no_lineage_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the client's own file format; no retries, so the refusal is known at once
    (no_lineage_env / "openlineage.yml").write_text(
        f"transport: {{type: http, url: 'http://127.0.0.1:{port}', timeout: 1, retry: {{total: 0, connect: 0, read: 0}}}}\n"
    )
    emitter = Emitter()

    def event(n: int) -> object:
        return run_event(
            "START",
            run_id="run-a",
            model=f"m{n}",
            stage="trace",
            attempt=0,
            inputs=[],
            outputs=[],
            facts={"versions": {"pt2flow": "0"}},
            torch_version="2.13.0",
        )

    started = time.monotonic()
    for n in range(5):
        emitter.submit("run-a", event(n))
    emitter.submit("run-b", lambda: event(9))  # built in the sending thread, as the runner queues them
    emitter.flush("run-a", timeout=5)
    emitter.flush("run-b", timeout=5)
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "OpenLineage:" in line]
    assert len(lines) == 2 and all("cannot send events to the collector" in line for line in lines), err
    assert any("run-a" in line for line in lines) and any("run-b" in line for line in lines)
    assert emitter.sent == {} and "Traceback" not in err
