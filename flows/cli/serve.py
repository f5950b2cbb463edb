"""`pt2flow serve`: the fleet flow as a scheduled Prefect deployment, served from this process.

Every check (config, options, schedule, server, store) raises before anything is registered
(exit 2); Prefect is imported once the config and the options have been checked."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

import click

from pt2flow.flows.cli.errors import EXIT_OK
from pt2flow.flows.cli.launch import (
    CONFIG_HELP,
    fleet_options,
    load_for_run,
    open_checked_store,
    refuse_credentials,
    runner_of,
)
from pt2flow.flows.options import UsageError
from pt2flow.flows.cli.support import Args, command

if TYPE_CHECKING:
    from pt2flow.flows.config.models import Pipeline

SERVER_HINT = (
    "start one with `prefect server start` (SQLite by default; PostgreSQL via "
    "PREFECT_API_DATABASE_CONNECTION_URL) and point pt2flow at it: "
    "export PREFECT_API_URL=http://127.0.0.1:4200/api"
)


@command(
    "serve",
    help="Register CONFIG's fleet as a Prefect deployment with a cron or interval schedule and serve it: "
    "scheduled runs execute here, one at a time, until Ctrl-C or SIGTERM (exit 0: a run in flight is cancelled, its finished models stay cached, and the schedule is paused); after each, the config's "
    "`retention:` (if any) frees what older runs left. Needs PREFECT_API_URL "
    "pointing at a running Prefect server (`prefect server start`). The config is read again at every run; "
    "storage options stay in this process' environment, never in the deployment. Exit 2: bad config, usage or no server.",
    arguments=CONFIG_HELP,
    options_metavar="(--cron EXPR | --interval SECONDS) [OPTIONS]",
)
@click.argument("config", metavar="CONFIG")
@click.option("--cron", metavar="EXPR", help='cron schedule, e.g. "0 3 * * *" (03:00 every day)')
@click.option("--interval", type=float, metavar="SECONDS", help="run every SECONDS seconds")
@click.option("--timezone", metavar="TZ", help="IANA time zone of the schedule (default UTC)")
@fleet_options
@click.option(
    "--force", is_flag=True, help="re-run every stage at every scheduled run (default: cached stages are reused)"
)
@click.option(
    "--name",
    metavar="DEPLOYMENT",
    help="deployment name (default: the config file's stem); the full name is pt2flow-fleet/NAME "
    "(pt2flow-upgrade-check/NAME with --upgrade-check)",
)
@click.option(
    "--upgrade-check",
    "upgrade_python",
    metavar="PYTHON",
    help="serve `pt2flow upgrade-check CONFIG --python PYTHON` on the schedule instead of the fleet: each run checks the fleet "
    "against that candidate environment (e.g. a venv a CI job refreshes), writes its report into --report-dir and fails when a model regresses",
)
@click.option(
    "--baseline-python",
    metavar="PATH",
    help="with --upgrade-check: the environment the baseline runs ran in (default: this one)",
)
@click.option(
    "--attribute", is_flag=True, help="with --upgrade-check: say which distribution breaks each regressed model"
)
@click.option(
    "--report-dir",
    metavar="DIR",
    help="with --upgrade-check: where each run's report goes (default: ./upgrade-reports)",
)
def serve_command(args: Args) -> int:
    """Register the fleet flow as a deployment with a cron or interval schedule on a running Prefect
    server and execute its scheduled runs in this process' children until Ctrl-C or SIGTERM (exit 0).
    Exit 2, before anything is registered: a bad config or option, no server, an unreachable store."""
    if (args.cron is None) == (args.interval is None):
        problem = (
            "one of --cron or --interval is required"
            if args.cron is None
            else "--cron and --interval exclude each other: give one"
        )
        raise click.UsageError(problem, ctx=click.get_current_context())
    # A served deployment is a service: show Prefect's INFO lines (runs submitted, finished)
    # unless the user chose a level. Set before Prefect is imported.
    os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] = (
        os.environ.get("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL") or "INFO"
    )
    from pt2flow.flows.config import resolve_store_url
    from pt2flow.storage.urls import redact_url

    config = load_for_run(args)
    if not args.upgrade_python and (args.baseline_python or args.attribute or args.report_dir):
        raise UsageError("--baseline-python, --attribute and --report-dir go with --upgrade-check")
    schedule, when = schedule_of(args)
    store_url = resolve_store_url(args.store or config.store)
    refuse_credentials(store_url)
    if store_url.startswith("memory://"):
        raise UsageError("a memory:// store lives in one process; scheduled runs need a store that outlives them")
    api_url = require_server()
    # Storage options (credentials included) travel only in this process' environment, which
    # the flow-run subprocesses inherit; never in the deployment's parameters.
    open_checked_store(store_url, config, args)

    name = args.name or os.path.splitext(os.path.basename(args.config))[0]
    if args.upgrade_python:
        from pt2flow.flows.api.scheduled import upgrade_check_flow as served

        parameters = upgrade_parameters(args, store_url)
    else:
        from pt2flow.flows.fleet import fleet_flow as served

        parameters = deployment_parameters(args, config, store_url)
    unpaused = serve_forever(
        served, name, schedule, parameters, f"{when}, on the Prefect server at {redact_url(api_url)}"
    )
    if unpaused:
        print(
            f"pt2flow serve: stopped; the schedule of {served.name}/{name} could not be paused ({unpaused}): "
            "pause it in the Prefect UI",
            file=sys.stderr,
        )
    else:
        print(
            f"pt2flow serve: stopped; the schedule of {served.name}/{name} is paused until the next serve",
            file=sys.stderr,
        )
    return EXIT_OK


def upgrade_parameters(args: Args, store_url: str) -> dict[str, Any]:
    """The upgrade-check deployment's parameters, the interpreters checked now (pt2flow installed there)."""
    from pt2flow.flows.api.running import check_python

    if args.python or args.only or args.stages or args.dask_address or (args.runner or "local") != "local":
        raise UsageError(
            "--upgrade-check runs the whole config on this machine: --python, --only, --stages and --runner do not apply"
        )
    return {
        "config_path": os.path.abspath(args.config),
        "python": check_python(args.upgrade_python),
        "baseline_python": check_python(args.baseline_python),
        "store": store_url,
        "attribute": bool(args.attribute),
        "workers": args.workers,
        "report_dir": os.path.abspath(args.report_dir or "upgrade-reports"),
    }


def schedule_of(args: Args) -> tuple[Any, str]:
    """The Prefect schedule of --cron or --interval (in --timezone) and how to say it."""
    if args.interval is not None and not args.interval > 0:
        raise UsageError("--interval must be a positive number of seconds")
    if args.timezone:
        import zoneinfo

        try:
            zoneinfo.ZoneInfo(args.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise UsageError(
                f"--timezone: unknown time zone {args.timezone!r} (IANA names, e.g. Europe/Berlin)"
            ) from None
    timezone = args.timezone or "UTC"
    from prefect.schedules import Cron, Interval

    try:
        if args.cron is not None:
            return Cron(args.cron, timezone=timezone), f"cron {args.cron!r} ({timezone})"
        return Interval(args.interval, timezone=timezone), f"every {args.interval:g} s"
    except ValueError as exc:
        raise UsageError(f"--cron: {exc}") from None


def require_server() -> str:
    """The URL of the running Prefect server this process and its flow runs will use."""
    from pt2flow.storage.urls import redact_url

    api_url = prefect_api_url()
    if not api_url:
        raise UsageError(
            "pt2flow serve needs a running Prefect server (schedules do not run on an ephemeral one) "
            f"and PREFECT_API_URL is not set; {SERVER_HINT}"
        )
    # Never fall back to a temporary server, in this process or in the flow runs it starts.
    os.environ["PREFECT_API_URL"] = api_url
    os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = "false"
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        problem = client.api_healthcheck()
    if problem is not None:
        raise UsageError(
            f"no Prefect server answers at PREFECT_API_URL={redact_url(api_url)} ({type(problem).__name__}: {problem}); {SERVER_HINT}"
        )
    return api_url


def prefect_api_url() -> str | None:
    """PREFECT_API_URL from the environment, else from the active Prefect profile."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        return url
    try:
        from prefect.settings import get_current_settings

        return get_current_settings().api.url or None
    except Exception:
        return None


def deployment_parameters(args: Args, config: Pipeline, store_url: str) -> dict[str, Any]:
    """JSON-only parameters; no run_id, so that every scheduled run gets a new one."""
    parameters: dict[str, Any] = {
        "config_path": os.path.abspath(args.config),
        "store": store_url,
        "force": args.force,
        "runner": runner_of(args),
        "workers": args.workers,
        "apply_retention": True,  # the config's `retention:` (read again at every run), if any
    }
    if args.only:
        parameters["only"] = list(args.only)
    if args.stages:  # only when asked: otherwise each run follows the config's own list
        parameters["stages"] = list(config.stages)
    if args.dask_address:
        parameters["dask_address"] = args.dask_address
    if args.no_worker_timeout is not None:
        parameters["no_worker_timeout_s"] = args.no_worker_timeout
    if args.python:  # checked now (pt2flow installed there); otherwise the config's python:, read at every run
        from pt2flow.flows.api.running import check_python

        parameters["python"] = check_python(args.python, runner_of(args))
    return parameters


def serve_forever(flow: Any, name: str, schedule: Any, parameters: dict[str, Any], where: str) -> str | None:
    """Register the deployment and run its scheduled runs here until Ctrl-C or SIGTERM, both of
    which stop the same way: no new run starts, a run in flight is cancelled (Prefect's runner
    stop: the flow-run process gets SIGTERM, so the models it finished stay cached), the schedule
    is paused (None; else why it could not be)."""
    import asyncio
    import signal
    import threading

    from prefect.runner import Runner
    from prefect.types.entrypoint import EntrypointType

    serving: list[asyncio.Task[Any]] = []
    stop_requested = threading.Event()
    # the flow runs' log lines are copied to our stdout: a log file should get them as they come
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    async def stop() -> None:
        # Prefect's own stop: the poller stops, runs in flight are cancelled, start() returns
        # through the runner's exit (which pauses the schedule)
        with contextlib.suppress(Exception):
            await runner.astop()
        # a single Task.cancel() can be swallowed by a shielded scope inside the runner (CI saw
        # serve keep starting runs for minutes after Ctrl-C): cancel until serving has ended
        while serving and not serving[0].done():
            serving[0].cancel()
            await asyncio.sleep(0.5)

    def request_stop(signum: int, frame: Any) -> None:
        """SIGINT and SIGTERM (in the main thread): stop once, whatever the runner is doing."""
        if stop_requested.is_set():
            return
        stop_requested.set()
        print(f"pt2flow serve: {signal.Signals(signum).name} received: stopping", file=sys.stderr, flush=True)
        if serving and not serving[0].done():
            loop = serving[0].get_loop()
            loop.call_soon_threadsafe(lambda: loop.create_task(stop()))

    class ServeRunner(Runner):
        def handle_sigterm(self, signum: int = signal.SIGTERM, frame: Any = None, *args: Any, **kwargs: Any) -> None:
            # prefect 3.8.8 installs this for SIGTERM in start() and calls stop() without awaiting
            # it (it exits halfway through the shutdown, the schedule stays active)
            request_stop(signal.SIGTERM, frame)

    # one fleet run at a time: a run that is due while one is still going waits for it; when
    # serving stops nobody runs the schedule, so it is paused rather than left to pile up late runs
    runner = ServeRunner(name=name, pause_on_shutdown=True, limit=1)
    deployment_id = runner.add_flow(
        flow,
        name=name,
        schedule=schedule,
        parameters=parameters,
        tags=["pt2flow"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    print(
        f"pt2flow serve: serving deployment {flow.name}/{name} ({deployment_id}), {where}; Ctrl-C stops.\n"
        f"  run it now: prefect deployment run '{flow.name}/{name}'",
        file=sys.stderr,
        flush=True,
    )

    async def serve() -> None:
        task = asyncio.current_task()
        assert task is not None
        serving.append(task)
        if stop_requested.is_set():  # a signal came while the deployment was registered
            return
        await runner.start()

    # our handler, not asyncio.run's (which cancels the task once) nor Python's KeyboardInterrupt
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        asyncio.run(serve())
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    return pause_schedule(deployment_id)


def pause_schedule(deployment_id: Any) -> str | None:
    """Pause the served deployment's schedule once serving has ended; None when paused, else why
    not. The runner's own pause on shutdown is an API call in its exit, which the cancellation
    that ends a slow shutdown can cut short (a full test run saw a stopped serve whose schedule stayed active):
    pausing is idempotent, so it is always done here too."""
    import asyncio

    from prefect.client.orchestration import get_client

    async def pause() -> None:
        async with get_client() as client:
            await client.pause_deployment(deployment_id)

    try:
        asyncio.run(pause())
    except Exception as exc:  # noqa: BLE001 - the server may be gone: say so, do not claim it
        return f"{type(exc).__name__}: {exc}"
    return None
