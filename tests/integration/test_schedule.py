"""`pt2flow serve` on a real Prefect server: a tiny fleet served on a 5 s interval, scheduled runs
that complete and leave their records in the index, each with its own run id and a drift report
against the one before; then everything is shut down. Plus the refusals that need no server.

Everything runs on 127.0.0.1: a `prefect server start` of this venv with its own PREFECT_HOME
(SQLite in tmp), no UI, no telemetry.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

from pt2flow.storage import ArtifactStore
from tests.conftest import BIN, ROOT, cli_env, cli_in_process, run_cli, run_in_process, write_config

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "decompose", "serialize", "validate"]  # no AOTInductor compile: keep it fast
SENTINEL = "SENTINEL-" + uuid.uuid4().hex  # a storage option that must never reach the Prefect API
RUN_DEADLINE_S = 240
# Prefect's runner (the one `pt2flow serve` runs) looks for due runs every 10 s by default
# (PREFECT_RUNNER_POLL_FREQUENCY): with a 5 s interval each scheduled run waited up to 10 s to be
# picked up. Polling every second changes what Prefect's runner does when, not what serve does
PREFECT_RUNNER_POLL = {"PREFECT_RUNNER_POLL_FREQUENCY": "1"}


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _api(url: str, path: str, body: Any = None, timeout: float = 10) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{url}{path}",
        data=data,
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def _healthy(url: str) -> bool:
    try:
        return _api(url, "/health", timeout=2) is True
    except Exception:
        return False


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _stop_group(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace: float = 30) -> int:
    """Signal the process (a session leader), wait, then SIGKILL its whole group; returns its exit code
    and asserts that nothing of the group is left."""
    pgid = process.pid
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            # what is still running, and where each process is stuck (faulthandler on SIGUSR1), for the log
            subprocess.run(["ps", "-o", "pid,ppid,stat,etime,args", "-g", str(pgid), "--forest"], check=False)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGUSR1)
            time.sleep(3)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            process.wait(timeout=30)
    # its children (flow-run processes, multiprocessing's resource tracker) go with it
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        raise AssertionError(f"processes of group {pgid} outlived it (killed now)")
    assert process.returncode is not None
    return process.returncode


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `prefect server start` on a free 127.0.0.1 port (SQLite under its own PREFECT_HOME)."""
    tmp_path = tmp_path_factory.mktemp("prefect-server")
    home = tmp_path / "server-home"
    log_path = tmp_path / "server.log"
    env = cli_env(
        {
            "PREFECT_HOME": str(home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "DO_NOT_TRACK": "1",
        }
    )
    process = None
    url = ""
    for _attempt in range(3):  # a free port can be taken by someone else before the server binds it
        port = _free_port()
        url = f"http://127.0.0.1:{port}/api"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(tmp_path),
                start_new_session=True,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None and not _healthy(url):
            time.sleep(0.5)
        if process.poll() is None and _healthy(url):
            break
        _stop_group(process)
        process = None
    if process is None:
        pytest.fail(f"prefect server start did not come up:\n{_tail(log_path)}")
    try:
        yield url
    finally:
        code = _stop_group(process)
        assert code is not None
        assert "Can't evaluate bulk DML" not in _tail(log_path, 10**7), "the scheduler failed (SQLAlchemy 2.1?)"


def _tiny_config(path: Path) -> Path:
    return write_config(
        path, [{"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [3, 8]}}}], stages=STAGES
    )


def _completed_runs(url: str, deployment_id: str) -> list[dict[str, Any]]:
    runs = _api(
        url,
        "/flow_runs/filter",
        {
            "flow_runs": {"deployment_id": {"any_": [deployment_id]}, "state": {"type": {"any_": ["COMPLETED"]}}},
            "sort": "START_TIME_ASC",
        },
    )
    return list(runs)


def _summary_markdown(url: str, flow_run_id: str) -> str:
    artifacts = _api(
        url,
        "/artifacts/filter",
        {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "type": {"any_": ["markdown"]}}},
    )
    assert artifacts, f"flow run {flow_run_id} published no markdown artifact"
    return str(artifacts[0]["data"])


def _serve_until(
    url: str,
    tmp_path: Path,
    args: list[str],
    name: str,
    runs: int,
    env: dict[str, str] | None = None,
    drop_env: tuple[str, ...] = (),
    flow: str = "pt2flow-fleet",
) -> tuple[subprocess.Popen[bytes], Path, dict[str, Any], list[dict[str, Any]]]:
    """Start `pt2flow serve ARGS --name NAME` in tmp_path/work and wait until RUNS scheduled runs of
    its deployment completed; returns (process, log, deployment, completed runs, oldest first)."""
    serve_env = cli_env(
        {"PREFECT_API_URL": url, "PREFECT_HOME": str(tmp_path / "client-home"), **PREFECT_RUNNER_POLL, **(env or {})}
    )
    for key in drop_env:
        serve_env.pop(key, None)
    serve_log = tmp_path / "serve.log"
    started = time.monotonic()
    with open(serve_log, "ab") as log:
        serve = subprocess.Popen(
            [str(BIN / "pt2flow"), "serve", *args, "--name", name],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(tmp_path / "work"),
            start_new_session=True,
            env=serve_env,
        )
    try:
        deployment: dict[str, Any] | None = None
        completed: list[dict[str, Any]] = []
        while time.monotonic() - started < RUN_DEADLINE_S:
            assert serve.poll() is None, f"pt2flow serve exited with {serve.returncode}:\n{_tail(serve_log)}"
            if deployment is None:
                with contextlib.suppress(urllib.error.HTTPError):
                    deployment = _api(url, f"/deployments/name/{flow}/{name}")
            if deployment is not None:
                completed = _completed_runs(url, deployment["id"])
                if len(completed) >= runs:
                    break
            time.sleep(2)
        assert deployment is not None, f"no deployment {flow}/{name} after {RUN_DEADLINE_S} s:\n{_tail(serve_log)}"
        assert len(completed) >= runs, (
            f"{len(completed)} scheduled run(s) completed in {RUN_DEADLINE_S} s:\n{_tail(serve_log)}"
        )
        print(f"{runs} scheduled run(s) of {name} completed {time.monotonic() - started:.0f} s after serve started")
    except BaseException:
        _stop_group(serve)
        raise
    return serve, serve_log, _api(url, f"/deployments/{deployment['id']}"), completed


def _run_id(url: str, flow_run: dict[str, Any]) -> str:
    """The pt2flow run id of a fleet flow run, from the summary it published."""
    markdown = _summary_markdown(url, flow_run["id"])
    match = re.search(r"# pt2flow run `([^`]+)`", markdown)
    assert match, markdown[:500]
    return match.group(1)


# a stopped serve cancels its in-flight run and waits for it to go (`pt2flow serve --help`): with a
# 5 s interval a run is usually going when the signal comes, and on a loaded 2-core machine its
# process can take a while to stop; a serve that ignores the signal is still caught (SIGKILL, -9)
STOP_GRACE_S = 180


def _assert_stopped_cleanly(
    url: str, serve: subprocess.Popen[bytes], serve_log: Path, deployment: dict[str, Any], sig: int
) -> None:
    code = _stop_group(serve, sig, grace=STOP_GRACE_S)
    log_text = _tail(serve_log, 10**7)
    assert code == 0, f"pt2flow serve exited with {code} on {signal.Signals(sig).name}:\n{log_text[-4000:]}"
    assert "Traceback" not in log_text, log_text[-4000:]
    assert SENTINEL not in log_text
    assert "is paused until the next serve" in log_text
    # nobody serves it any more: its schedule is paused rather than left to pile up late runs
    assert _api(url, f"/deployments/{deployment['id']}")["paused"] is True


def test_serve_runs_the_fleet_on_schedule(tmp_path: Path, real_server: str) -> None:
    url = real_server
    work = tmp_path / "work"
    _tiny_config(work / "fleet.yaml")
    store = work / "store"
    # relative CONFIG and --store: the deployment must hold absolute ones
    serve, serve_log, deployment, completed = _serve_until(
        url,
        tmp_path,
        ["fleet.yaml", "--interval", "5", "--store", "store", "--storage-option", f"sentinel_token={SENTINEL}"],
        name=f"sched-{uuid.uuid4().hex[:8]}",
        runs=2,
    )
    try:
        # the deployment: the schedule asked for, absolute paths, no run id, no storage option
        schedules = deployment["schedules"]
        assert len(schedules) == 1 and schedules[0]["active"] is True
        assert schedules[0]["schedule"]["interval"] == 5.0
        parameters = deployment["parameters"]
        assert parameters["config_path"] == str(work / "fleet.yaml")
        assert parameters["store"] == str(store)
        assert "run_id" not in parameters
        assert SENTINEL not in json.dumps(deployment)

        # every completed run: scheduled (no manual trigger), its own run id, records in the index
        records = ArtifactStore(str(store)).index.read().to_pylist()
        run_ids = []
        for flow_run in completed:
            assert flow_run["auto_scheduled"] is True
            assert SENTINEL not in json.dumps(flow_run)
            run_id = _run_id(url, flow_run)
            run_ids.append(run_id)
            mine = [r for r in records if r["run_id"] == run_id]
            assert {r["stage"] for r in mine} >= set(STAGES), mine
            assert all(r["model"] == "mlp" and r["status"] == "ok" for r in mine), mine
        assert len(set(run_ids)) == len(run_ids), f"scheduled runs share a run id: {run_ids}"

        # the second run's summary compares it with the first one (drift report)
        second = _summary_markdown(url, completed[1]["id"])
        assert f"drift report: `{run_ids[0]}` → `{run_ids[1]}`" in second, second[:1000]
    finally:
        _assert_stopped_cleanly(url, serve, serve_log, deployment, signal.SIGTERM)


def test_serve_on_s3_with_credentials_only_in_storage_options(tmp_path: Path, real_server: str, moto_s3: Any) -> None:
    """The served runs reach an S3 store whose endpoint and credentials exist only as --storage-option
    values of the serve process (its AWS_* environment has no credentials and a dead endpoint): they travel to the flow-run process
    through the environment, never through the deployment, the flow runs or the logs. Ctrl-C stops it."""
    url = real_server
    _tiny_config(tmp_path / "work" / "fleet.yaml")
    store = f"s3://{moto_s3.bucket}/sched-{uuid.uuid4().hex[:8]}"
    options = [f"client_kwargs.endpoint_url={moto_s3.url}", "key=pt2flow-serve-key", f"secret={SENTINEL}"]
    serve, serve_log, deployment, completed = _serve_until(
        url,
        tmp_path,
        ["fleet.yaml", "--interval", "5", "--store", store, *[a for o in options for a in ("--storage-option", o)]],
        name=f"sched-s3-{uuid.uuid4().hex[:8]}",
        runs=1,
        # nothing listens there: without the options a run fails fast, and never leaves the machine
        env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{_free_port()}"},
        drop_env=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    )
    try:
        assert deployment["parameters"]["store"] == store
        assert SENTINEL not in json.dumps(deployment) and moto_s3.url not in json.dumps(deployment)
        run_id = _run_id(url, completed[0])
        assert SENTINEL not in json.dumps(completed[0])
        index = ArtifactStore(store, {"client_kwargs": {"endpoint_url": moto_s3.url}}).index
        mine = [r for r in index.read().to_pylist() if r["run_id"] == run_id]
        assert {r["stage"] for r in mine} >= set(STAGES) and all(r["status"] == "ok" for r in mine), mine
    finally:
        _assert_stopped_cleanly(url, serve, serve_log, deployment, signal.SIGINT)


def test_prefect_yaml_deploys_to_a_process_pool(tmp_path: Path, real_server: str) -> None:
    """The repository's prefect.yaml: the same fleet flow, a process work pool, 03:00 every day."""
    import yaml

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (deployment,) = spec["deployments"]
    assert deployment["entrypoint"] == "flows/fleet.py:fleet_flow"
    assert deployment["work_pool"]["name"] == "pt2flow-process"
    assert deployment["parameters"] == {"config_path": "configs/demo.yaml", "store": "./pt2-store"}
    assert [s["cron"] for s in deployment["schedules"]] == ["0 3 * * *"]

    env = cli_env({"PREFECT_API_URL": real_server, "PREFECT_HOME": str(tmp_path / "client-home")})
    before = (ROOT / "prefect.yaml").read_bytes()
    for command in (
        ["work-pool", "create", "pt2flow-process", "--type", "process"],
        ["--no-prompt", "deploy", "--all"],
    ):
        proc = subprocess.run(
            [str(BIN / "prefect"), *command], cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=180
        )
        assert proc.returncode == 0, (command, proc.stdout[-3000:], proc.stderr[-3000:])
    assert (ROOT / "prefect.yaml").read_bytes() == before  # prefect deploy left the file alone

    registered = _api(real_server, f"/deployments/name/pt2flow-fleet/{deployment['name']}")
    assert registered["entrypoint"] == "flows/fleet.py:fleet_flow"
    assert registered["work_pool_name"] == "pt2flow-process"
    assert registered["parameters"] == {"config_path": "configs/demo.yaml", "store": "./pt2-store"}
    assert [(s["schedule"]["cron"], s["active"]) for s in registered["schedules"]] == [("0 3 * * *", True)]
    # the worker runs the flow in this checkout, where the relative paths above resolve
    assert registered["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]


def test_serve_without_a_server_exits_2(tmp_path: Path) -> None:
    config = _tiny_config(tmp_path / "fleet.yaml")
    proc = run_cli(["serve", str(config), "--interval", "5", "--store", str(tmp_path / "store")], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "PREFECT_API_URL is not set" in proc.stderr and "prefect server start" in proc.stderr
    assert not (tmp_path / "store").exists()  # refused before touching anything

    dead = f"http://127.0.0.1:{_free_port()}/api"
    proc = run_cli(
        ["serve", str(config), "--cron", "0 3 * * *", "--store", str(tmp_path / "store")],
        env={"PREFECT_API_URL": dead},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no Prefect server answers" in proc.stderr and "prefect server start" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_refuses_bad_config_and_usage(tmp_path: Path) -> None:
    """serve's refusals, each before it looks for a server: `main(ARGS)` in this process (cli_in_process,
    the exit code and stderr the binary gives; test_serve_without_a_server_exits_2 runs the binary's
    own exit 2)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nmodels: []\n")
    proc = cli_in_process(["serve", str(bad), "--cron", "0 3 * * *"])
    assert proc.returncode == 2 and "bad.yaml" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr

    config = _tiny_config(tmp_path / "fleet.yaml")
    for args, message in [
        ([], "one of --cron or --interval is required"),
        (["--cron", "0 3 * *"], "Invalid cron string"),
        (["--interval", "0"], "--interval must be a positive"),
        (["--cron", "0 3 * * *", "--timezone", "Mars/Olympus"], "unknown time zone"),
        (["--cron", "0 3 * * *", "--stages", "trace,nonsense"], "--stages"),
        (["--cron", "0 3 * * *", "--store", "s3://user:secret@bucket/x"], "holds credentials"),
    ]:
        proc = cli_in_process(["serve", str(config), *args], env={"PREFECT_API_URL": "http://127.0.0.1:9/api"})
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert "user:secret" not in proc.stderr


def test_serve_schedules_an_upgrade_check(tmp_path: Path, real_server: str) -> None:
    """`serve --upgrade-check CANDIDATE`: each scheduled run checks the fleet against the candidate
    environment (tests/environments.py) and leaves its report in --report-dir and in Prefect."""
    from tests.environments import CANDIDATE_TRANSFORMERS, overlay_env

    candidate = overlay_env("candidate", ["tinyops-2.0", f"transformers=={CANDIDATE_TRANSFORMERS}"])
    url = real_server
    work = tmp_path / "work"
    _tiny_config(work / "fleet.yaml")
    # the baseline, in this environment: the fleet run in this process (serve, under test, stays the binary)
    code, baseline = run_in_process(work / "fleet.yaml", store=str(work / "store"))
    assert code == 0, baseline
    serve, serve_log, deployment, completed = _serve_until(
        url,
        tmp_path,
        ["fleet.yaml", "--interval", "5", "--store", "store", "--upgrade-check", candidate, "--report-dir", "reports"],
        name=f"upgrade-{uuid.uuid4().hex[:8]}",
        runs=1,
        flow="pt2flow-upgrade-check",
    )
    try:
        assert deployment["parameters"]["python"] == candidate and deployment["parameters"]["report_dir"] == str(
            work / "reports"
        )
        reports = sorted((work / "reports").glob("upgrade-check-*.json"))
        assert reports and (work / "reports" / reports[0].name.replace(".json", ".html")).is_file()
        report = json.loads(reports[0].read_text())
        assert report["candidate"]["python"] == candidate and report["regressed"] is False
        assert [(m["model"], m["verdict"]) for m in report["models"]] == [("mlp", "unchanged")]
        # tinyops and transformers differ, but mlp imports neither: they are not the fleet's changes
        assert report["versions"] == [] and {"tinyops", "transformers"} <= {
            v["name"] for v in report["other_version_changes"]
        }
        assert "No regression" in _summary_markdown(url, completed[0]["id"])
    finally:
        _assert_stopped_cleanly(url, serve, serve_log, deployment, signal.SIGTERM)
