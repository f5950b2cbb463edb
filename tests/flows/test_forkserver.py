"""Workers forked from the fork server (flows/engine/orchestrator/launcher.py,
flows/engine/worker/forkserver.py), on real processes: a forked worker is what a worker started
on its own would be (its environment exactly, its folder, its own session, its threads), a new
environment, folder or installed package gets a new server, the server and its workers go when
the orchestrator dies, and PT2FLOW_FORK_WORKERS=0 starts workers on their own. What a worker
does with a model, crashes and deadlines included, is tested through the pool everywhere else
(every run of the suite forks its workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from pt2flow.flows.engine.common.messages import Describe, NewModel
from pt2flow.flows.engine.orchestrator import launcher
from pt2flow.flows.engine.orchestrator.supervisor import Worker
from tests.conftest import ROOT, cli_env

pytestmark = pytest.mark.integration  # real worker processes, each server imports torch


def _describe(**worker: Any) -> dict[str, Any]:
    """Start a worker, ask what it sees, stop it."""
    w = Worker(threads=1, **worker)
    try:
        return w.call(Describe())[1]
    finally:
        w.close()


def test_a_worker_freezes_what_it_keeps_when_a_new_model_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two models a worker collects, then freezes what is alive (flows/engine/common/heap.py):
    what it imported after its start-up freeze (here, started on its own: the stage code it imports
    as it starts serving) is never walked by its collections again. Without that freeze the count
    stays as it was, or falls by what the worker freed."""
    monkeypatch.setenv("PT2FLOW_FORK_WORKERS", "0")
    w = Worker(threads=1)
    try:
        before = w.call(Describe())[1]["gc_frozen"]
        assert w.call(NewModel()) == ("ok", None)
        after = w.call(Describe())[1]["gc_frozen"]
    finally:
        w.close()
    assert before > 100_000 and after > before + 10_000, (before, after)


def test_a_forked_worker_sees_what_a_worker_started_on_its_own_sees(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PT2FLOW_TEST_MARK", "first")
    first = _describe()
    monkeypatch.setenv("PT2FLOW_TEST_MARK", "second")  # pt2flow's own variables: set after the fork
    second = _describe()
    server = psutil.Process(first["ppid"])
    assert first["ppid"] != os.getpid() and "pt2flow.flows.engine.worker.forkserver" in " ".join(server.cmdline())
    assert (
        second["ppid"] == first["ppid"] and second["pid"] != first["pid"]
    )  # the second is forked from the same server
    assert first["environ"]["PT2FLOW_TEST_MARK"] == "first" and second["environ"]["PT2FLOW_TEST_MARK"] == "second"
    assert first["warm"] is True  # torch's first export done in the server (stages/warmup.py), not by each worker
    # torch's start-up and the warm-up's caches frozen out of the collector's walks before the fork
    # (flows/engine/common/heap.py): a worker whose server froze nothing reports 0; what a worker
    # frees leaves the frozen generation, so the two counts differ by a few
    assert first["gc_frozen"] > 100_000 and second["gc_frozen"] > 100_000

    monkeypatch.setenv("SOME_LIBRARY_SETTING", "on")  # any other variable may be read by an import: another server
    third = _describe()
    assert third["ppid"] not in (first["ppid"], os.getpid()) and third["environ"]["SOME_LIBRARY_SETTING"] == "on"

    alone = dict(os.environ, PT2FLOW_WORKER="1", PT2FLOW_WORKER_THREADS="1")
    assert third["environ"] == alone  # exactly the variables it would have been started with
    assert third["threads"] == "1" and third["torch_threads"] == 1

    assert first["prefect"] is False  # neither the server nor a worker imports Prefect: its variables are volatile
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # read again by a forked worker
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # read when an S3 store is opened, in the worker
    monkeypatch.setenv("COLUMNS", "173")
    volatile = _describe()
    assert volatile["ppid"] == third["ppid"] and volatile["environ"]["PREFECT_API_URL"] == "http://127.0.0.1:9/api"
    assert volatile["environ"]["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9" and volatile["environ"]["COLUMNS"] == "173"
    assert volatile["compile_threads"] == 1 and third["compile_threads"] == max(
        1, min(32, len(os.sched_getaffinity(0)))
    )

    folder = tmp_path / "models"
    folder.mkdir()
    monkeypatch.chdir(folder)  # another folder: the same server, the worker in that folder, first on its paths
    there = _describe()
    assert there["ppid"] == third["ppid"] and there["cwd"] == str(folder)
    assert there["path0"] == str(folder) and there["import_path"][0] == str(folder)
    assert (
        third["path0"] == str(ROOT) == third["import_path"][0]
    )  # where it was asked from, not the server's own folder

    # a module named like one the server imported (a worker started there imports that one: an
    # empty numpy.py breaks torch's import), or a relative PYTHONPATH: a server started in that folder
    (folder / "numpy.py").write_text("")
    (folder / "numpy.egg-info").mkdir()  # not importable: no reason on its own
    (folder / "notes").mkdir()
    assert launcher._importable(str(folder)) == {"numpy", "notes"}
    env = dict(os.environ)
    shared = launcher._server_for(sys.executable, env, str(ROOT))
    assert shared.process.pid == third["ppid"] and psutil.Process(shared.process.pid).cwd() == shared.folder
    assert "numpy" in shared.modules and shared.shadowed_in(str(folder)) and not shared.shadowed_in(str(ROOT))
    own = launcher._server_for(sys.executable, env, str(folder))
    relative = launcher._server_for(sys.executable, {**env, "PYTHONPATH": "src"}, str(ROOT))
    for server in (own, relative):
        server.stop()  # not used: stopped before it has imported anything (its imports would fail in `folder`)
    assert own is not shared and own.folder is None and own.cwd == str(folder)
    assert relative.folder is None and relative.cwd == str(ROOT)


def test_a_server_warms_up_before_the_first_worker_that_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pt2flow validate`'s and check-compat's workers import models and load artifacts only: a
    new server forks them without torch's first export (about half its start's CPU); the first
    worker that exports comes warm from the same server, and every one after it."""
    monkeypatch.setenv("SOME_LIBRARY_SETTING", "a server of its own")
    inspecting = _describe(exports=False)
    exporting = _describe()
    later = _describe(exports=False)
    assert inspecting["ppid"] == exporting["ppid"] == later["ppid"] != os.getpid()
    assert (inspecting["warm"], exporting["warm"], later["warm"]) == (False, True, True)


def test_a_package_installed_after_the_server_started_gets_a_new_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A folder on the import path changes (pip installs a package into site-packages): the
    server's imports may be stale, so the next worker comes from a fresh server."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    before = _describe()
    assert _describe()["ppid"] == before["ppid"]
    (site / "newly_installed-1.0.dist-info").mkdir()  # what pip does: the folder's mtime changes
    after = _describe()
    assert after["ppid"] != before["ppid"]
    assert _describe()["ppid"] == after["ppid"]  # and that one serves from then on


def test_forking_off_starts_each_worker_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(launcher.FORK_VARIABLE, "0")
    seen = _describe()
    assert seen["ppid"] == os.getpid()
    assert seen["warm"] is False  # a worker started on its own pays torch's first export on its first model
    assert seen["gc_frozen"] > 100_000  # its imports frozen all the same


ORCHESTRATOR = textwrap.dedent("""
    import sys, time
    from pt2flow.flows.engine.common.messages import Describe
    from pt2flow.flows.engine.orchestrator.supervisor import Worker
    worker = Worker(threads=1)  # kept: a worker whose orchestrator lets it go ends by itself
    seen = worker.call(Describe())[1]
    print(seen["ppid"], seen["pid"], flush=True)
    time.sleep(600)
""")


def test_one_server_serves_every_process_of_an_environment_and_a_killed_one_takes_its_workers(tmp_path: Path) -> None:
    """Two orchestrators started at once with one environment (two `pt2flow run`s, a test session
    and its CLI subprocesses) start one server between them and fork from it; killing one stops
    its worker, not the other's; the server leaves its linger after the last one has gone."""
    script = tmp_path / "orchestrator.py"
    script.write_text(ORCHESTRATOR)
    env = cli_env({"SOME_LIBRARY_SETTING": uuid.uuid4().hex, launcher.LINGER_VARIABLE: "2"})  # a server of its own
    procs = [
        subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        for _ in range(2)
    ]
    try:
        seen = []
        for proc in procs:
            assert proc.stdout is not None
            seen.append(tuple(int(x) for x in proc.stdout.readline().split()))
        (server, first), (also, second) = seen
        assert server == also and first != second  # one server, started once (the path's lock), two workers
        assert all(psutil.pid_exists(pid) for pid in (server, first, second))
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        _await_gone(first)
        assert _running(second) and _running(server)  # the other orchestrator's worker and the server go on
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    _await_gone(second)
    path = launcher.socket_path(sys.executable, env, None)
    assert Path(path).is_socket()
    _await_gone(server)  # no process uses it: it leaves after its linger (2 s here)
    assert not Path(path).exists()  # and its socket with it: the next process starts a fresh one


def _await_gone(pid: int, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.1)
    assert not _running(pid)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
