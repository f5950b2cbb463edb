"""The pt2flow command line (docs/architecture.md §4).

Thin by design: torch and Prefect are imported only inside the commands that run pipelines,
so that ls / show / lineage / diff / verify / gc answer fast on a large index.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from typing import Any, Iterator, Sequence

from pt2flow.flows.cli.options import UsageError, merge_options, parse_storage_options

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

DESCRIPTION = """\
pt2flow turns PyTorch models into verified deployable artifacts. A YAML config names the models;
each goes through trace -> functionalize -> decompose -> serialize -> aot_compile -> validate,
orchestrated by Prefect, with every artifact stored by sha256 and every stage run in a Parquet
index you can query (ls, show, lineage, diff).
"""


def _usage_error(message: str) -> int:
    print(f"pt2flow: error: {message}", file=sys.stderr)
    return EXIT_USAGE


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[Any]:
    """Send fd 1 to stderr (also for child processes) and yield a writer to the real stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = os.fdopen(os.dup(saved), "w")
    try:
        yield real
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


# ---------------------------------------------------------------------------------------------
# run / validate


def cmd_validate(args: argparse.Namespace) -> int:
    from pt2flow.flows.config import ConfigError, load_config

    try:
        pipeline = load_config(args.config)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({"config": args.config, "valid": True, "models": [m.name for m in pipeline.models], "stages": list(pipeline.stages)}))
    else:
        print(f"{args.config}: ok — {len(pipeline.models)} model(s), stages {', '.join(pipeline.stages)}")
    return EXIT_OK


CREDENTIALS_IN_URL = (
    "the store URL holds credentials, which would be saved in Prefect's flow parameters; "
    "pass them with --storage-option, the config's storage_options or the environment"
)


def _holds_credentials(url: str) -> bool:
    from pt2flow.storage.urls import redact_url

    return redact_url(url) != url


def _load_for_run(args: argparse.Namespace) -> Any:
    """The config with --only/--stages applied, or the exit code of a usage error (printed)."""
    from pt2flow.flows.config import ConfigError, apply_overrides, load_config

    try:
        pipeline = load_config(args.config)
        stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages else None
        pipeline = apply_overrides(pipeline, only=args.only or (), stages=stages)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_USAGE
    if args.workers is not None and args.workers < 1:
        return _usage_error("--workers must be at least 1")
    if args.dask_address and args.runner != "dask":
        return _usage_error("--dask-address needs --runner dask")
    return pipeline


def _runner(args: argparse.Namespace) -> str:
    return args.runner or "local"


def _open_checked_store(store_url: str, pipeline: Any, args: argparse.Namespace) -> Any:
    """Set the run's storage options (config, then --storage-option) in this process'
    environment and open the store; the exit code of a usage error (printed) if it is unreachable."""
    from pt2flow.flows.engine import runtime
    from pt2flow.storage.urls import redact_url

    options = merge_options(dict(pipeline.storage_options), parse_storage_options(args.storage_option or []))
    runtime.set_storage_options(store_url, options)
    try:
        store = runtime.open_store(store_url)
        store.index.files()  # fail fast on an unreachable store
    except Exception as exc:
        return _usage_error(f"store {redact_url(store_url)}: {exc}")
    return store


def cmd_run(args: argparse.Namespace) -> int:
    from pt2flow.flows.config import resolve_store_url

    pipeline = _load_for_run(args)
    if isinstance(pipeline, int):
        return pipeline
    runner = _runner(args)
    store_url = resolve_store_url(args.store or pipeline.store)
    if _holds_credentials(store_url):
        return _usage_error(CREDENTIALS_IN_URL)
    store = _open_checked_store(store_url, pipeline, args)
    if isinstance(store, int):
        return store

    if args.verbose:  # before Prefect is imported: it reads its logging settings once, at import
        os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] = "INFO"
    from pt2flow.flows.engine.context import new_run_id

    run_id = new_run_id()
    parameters = dict(
        config_path=os.path.abspath(args.config),
        store=store_url,
        only=list(args.only or []) or None,
        stages=list(pipeline.stages),
        force=args.force,
        runner=runner,
        workers=args.workers,
        dask_address=args.dask_address,
        run_id=run_id,
        retry_failed=args.retry_failed,
    )
    if args.json:
        with _stdout_to_stderr() as real_stdout:
            document = _execute(parameters, store, pipeline, show_progress=False)
            real_stdout.write(json.dumps(document, default=str) + "\n")
            real_stdout.flush()
    else:
        from rich.console import Console

        document = _execute(parameters, store, pipeline, show_progress=sys.stderr.isatty() or args.progress)
        from pt2flow.flows.cli.summary import render_run

        render_run(document, Console(width=None if sys.stdout.isatty() else 160))
    return EXIT_OK if document["summary"]["failed"] == 0 else EXIT_FAILED


def _execute(parameters: dict[str, Any], store: Any, pipeline: Any, *, show_progress: bool) -> dict[str, Any]:
    from pt2flow.flows.engine import runtime

    if not parameters["force"] and not os.environ.get("PT2FLOW_ALWAYS_PREFECT"):
        document = _nothing_to_build(parameters)
        if document is not None:
            return document
    starting = None
    if parameters["runner"] != "dask":  # the workers import torch while the Prefect server starts
        starting = lambda: _start_workers(parameters["workers"], len(pipeline.models))  # noqa: E731
    with runtime.prefect_api(while_starting=starting):
        from pt2flow.flows.fleet import fleet_flow

        progress: Any = contextlib.nullcontext()
        if show_progress:
            from rich.console import Console

            from pt2flow.flows.cli.progress import FleetProgress

            progress = FleetProgress(store, parameters["run_id"], [m.name for m in pipeline.models], pipeline.stages, Console(stderr=True))
        with progress:
            state = fleet_flow(**parameters, return_state=True)
        document = state.result(raise_on_failure=False)
    if not isinstance(document, dict):
        raise RuntimeError(f"the fleet flow ended without a result: {document!r}")
    return document


def _start_workers(workers: int | None, models: int) -> None:
    from pt2flow.flows.engine.pool import default_workers, start_pool

    start_pool(workers or default_workers(models))


def _nothing_to_build(parameters: dict[str, Any]) -> dict[str, Any] | None:
    """When every model is already built (each stage's key has an ok record whose blob verifies),
    settle the run from the index without starting Prefect: the cached records are written under
    this run's id, as a flow would. None when there is work to do."""
    from pt2flow.flows.engine.fleet import NeedsFlow, fleet_context, settle_fleet

    pipeline, ctx = fleet_context(
        parameters["config_path"], parameters["store"], parameters["only"], parameters["stages"], False, parameters["run_id"], parameters["retry_failed"]
    )
    try:
        return settle_fleet(pipeline, ctx)
    except NeedsFlow:
        return None


# ---------------------------------------------------------------------------------------------
# serve: the fleet flow as a scheduled Prefect deployment


SERVER_HINT = (
    "start one with `prefect server start` (SQLite by default; PostgreSQL via "
    "PREFECT_API_DATABASE_CONNECTION_URL) and point pt2flow at it: "
    "export PREFECT_API_URL=http://127.0.0.1:4200/api"
)


def _prefect_api_url() -> str | None:
    """PREFECT_API_URL from the environment, else from the active Prefect profile."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        return url
    try:
        from prefect.settings import get_current_settings

        return get_current_settings().api.url or None
    except Exception:
        return None


def cmd_serve(args: argparse.Namespace) -> int:
    """Register the fleet flow as a deployment with a cron or interval schedule on a running Prefect
    server and execute its scheduled runs in this process' children until Ctrl-C or SIGTERM (exit 0).
    Exit 2, before anything is registered: a bad config or option, no server, an unreachable store."""
    user_log_level = os.environ.get("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL")
    from pt2flow.flows.config import resolve_store_url

    # A served deployment is a service: show Prefect's INFO lines (runs submitted, finished)
    # unless the user chose a level. Set before Prefect is imported.
    os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] = user_log_level or "INFO"
    pipeline = _load_for_run(args)
    if isinstance(pipeline, int):
        return pipeline
    if args.interval is not None and not args.interval > 0:
        return _usage_error("--interval must be a positive number of seconds")
    if args.timezone:
        import zoneinfo

        try:
            zoneinfo.ZoneInfo(args.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            return _usage_error(f"--timezone: unknown time zone {args.timezone!r} (IANA names, e.g. Europe/Berlin)")
    runner = _runner(args)

    timezone = args.timezone or "UTC"
    from prefect.schedules import Cron, Interval

    from pt2flow.storage.urls import redact_url

    try:
        if args.cron is not None:
            schedule = Cron(args.cron, timezone=timezone)
            when = f"cron {args.cron!r} ({timezone})"
        else:
            schedule = Interval(args.interval, timezone=timezone)
            when = f"every {args.interval:g} s"
    except ValueError as exc:
        return _usage_error(f"--cron: {exc}")

    store_url = resolve_store_url(args.store or pipeline.store)
    if _holds_credentials(store_url):
        return _usage_error(CREDENTIALS_IN_URL)
    if store_url.startswith("memory://"):
        return _usage_error("a memory:// store lives in one process; scheduled runs need a store that outlives them")

    api_url = _prefect_api_url()
    if not api_url:
        return _usage_error(
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
        return _usage_error(f"no Prefect server answers at PREFECT_API_URL={redact_url(api_url)} ({type(problem).__name__}: {problem}); {SERVER_HINT}")

    # Storage options (credentials included) travel only in this process' environment, which
    # the flow-run subprocesses inherit; never in the deployment's parameters.
    checked = _open_checked_store(store_url, pipeline, args)
    if isinstance(checked, int):
        return checked

    from pt2flow.flows.fleet import fleet_flow

    # JSON-only parameters; no run_id, so that every scheduled run gets a new one.
    parameters: dict[str, Any] = {
        "config_path": os.path.abspath(args.config),
        "store": store_url,
        "force": args.force,
        "runner": runner,
        "workers": args.workers,
    }
    if args.only:
        parameters["only"] = list(args.only)
    if args.stages:  # only when asked: otherwise each run follows the config's own list
        parameters["stages"] = list(pipeline.stages)
    if args.dask_address:
        parameters["dask_address"] = args.dask_address
    name = args.name or os.path.splitext(os.path.basename(args.config))[0]
    full_name = f"{fleet_flow.name}/{name}"
    _serve_forever(fleet_flow, name, schedule, parameters, f"{when}, on the Prefect server at {redact_url(api_url)}")
    print(f"pt2flow serve: stopped; the schedule of {full_name} is paused until the next serve", file=sys.stderr)
    return EXIT_OK


def _serve_forever(flow: Any, name: str, schedule: Any, parameters: dict[str, Any], where: str) -> None:
    """Register the deployment and run its scheduled runs here until Ctrl-C or SIGTERM, both of
    which stop the same way: in-flight runs end, the schedule is paused."""
    import asyncio

    from prefect.runner import Runner
    from prefect.types.entrypoint import EntrypointType

    serving: list[asyncio.Task[Any]] = []
    # the flow runs' log lines are copied to our stdout: a log file should get them as they come
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    class ServeRunner(Runner):
        def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
            # prefect 3.8.8 calls stop() without awaiting it and exits halfway through the
            # shutdown (the schedule stays active); stop as Ctrl-C does: cancel the serving task.
            self._logger.info("SIGTERM received, shutting down...")
            if serving and not serving[0].done():
                serving[0].get_loop().call_soon_threadsafe(serving[0].cancel)

    # one fleet run at a time: a run that is due while one is still going waits for it; when
    # serving stops nobody runs the schedule, so it is paused rather than left to pile up late runs
    runner = ServeRunner(name=name, pause_on_shutdown=True, limit=1)
    deployment_id = runner.add_flow(
        flow, name=name, schedule=schedule, parameters=parameters, tags=["pt2flow"], entrypoint_type=EntrypointType.MODULE_PATH
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
        await runner.start()

    try:
        asyncio.run(serve())
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass


# ---------------------------------------------------------------------------------------------
# parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pt2flow", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def store_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--store", metavar="URL", help="store URL (local path, file://, memory://, s3://bucket/prefix); overrides the config's")
        p.add_argument("--storage-option", metavar="KEY=VALUE", action="append", help="fsspec storage option (repeatable; dotted keys nest)")

    def fleet_args(p: argparse.ArgumentParser) -> None:
        """What to run and where: the options `run` and `serve` share."""
        store_arg(p)
        p.add_argument("--only", metavar="NAME", action="append", help="run only this model (repeatable)")
        p.add_argument("--stages", metavar="a,b,...", help="run these stages instead of the config's (pipeline order; trace required)")
        p.add_argument(
            "--workers", type=int, default=None, metavar="N",
            help="models in parallel, each in a supervised worker process (default: one per core, at most one per model "
            "and per 3 GiB of free memory; the run says how many it used)",
        )
        p.add_argument(
            "--runner", choices=["local", "process", "dask"],
            help="local (default; `process` is the same): N supervised worker processes on this machine; "
            "dask: a Dask cluster, each Dask worker with a supervised worker process of its own",
        )
        p.add_argument("--dask-address", metavar="ADDR", help="scheduler address of an existing Dask cluster (tcp://host:8786); default: a LocalCluster")

    p = sub.add_parser("run", help="export every model of a config", description="Run the pipeline on every model of CONFIG. Exit 0: all ok; 1: a model failed (the others still ran); 2: bad config or usage.")
    p.add_argument("config", metavar="CONFIG", help="pipeline config (YAML, schema version 1)")
    fleet_args(p)
    p.add_argument("--force", action="store_true", help="ignore cached results and re-run every stage")
    p.add_argument(
        "--retry-failed", action="store_true",
        help="re-run stages whose cached outcome is a deterministic failure (data_dependent, decomposition, ...); "
        "without it, an unchanged model that failed that way is reported again from the index",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout (logs go to stderr)")
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    p.add_argument("--verbose", "-v", action="store_true", help="show Prefect's log lines")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("validate", help="check a config without running anything", description="Check CONFIG: every problem is reported with its file, line and key path. Exit 0 if valid, 2 if not.")
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "serve",
        help="serve the fleet as a scheduled Prefect deployment (needs `prefect server start`)",
        description="Register CONFIG's fleet as a Prefect deployment with a cron or interval schedule and serve it: "
        "scheduled runs execute here, one at a time, until Ctrl-C (exit 0; the schedule is paused). Needs PREFECT_API_URL "
        "pointing at a running Prefect server (`prefect server start`). The config is read again at every run; "
        "storage options stay in this process' environment, never in the deployment. Exit 2: bad config, usage or no server.",
    )
    p.add_argument("config", metavar="CONFIG", help="pipeline config (YAML, schema version 1)")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", metavar="EXPR", help='cron schedule, e.g. "0 3 * * *" (03:00 every day)')
    when.add_argument("--interval", type=float, metavar="SECONDS", help="run every SECONDS seconds")
    p.add_argument("--timezone", metavar="TZ", help="IANA time zone of the schedule (default UTC)")
    fleet_args(p)
    p.add_argument("--force", action="store_true", help="re-run every stage at every scheduled run (default: cached stages are reused)")
    p.add_argument("--name", metavar="DEPLOYMENT", help="deployment name (default: the config file's stem); the full name is pt2flow-fleet/NAME")
    p.set_defaults(func=cmd_serve)

    from pt2flow.flows.cli import queries, report

    queries.add_commands(sub, store_arg)
    report.add_command(sub, store_arg)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    # `kill -USR1 PID` prints every thread's stack on stderr: what a long run or serve is doing now
    if hasattr(signal, "SIGUSR1"):
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)
    # `run`: SIGTERM stops it as Ctrl-C does (serve keeps Prefect's own handling of both)
    previous = signal.signal(signal.SIGTERM, _interrupt) if args.func is cmd_run else None
    try:
        return int(args.func(args))
    except UsageError as exc:
        return _usage_error(str(exc))
    except KeyboardInterrupt:
        _stop_workers()
        print("pt2flow: interrupted; worker processes stopped", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stop_workers() -> None:
    """Stop the worker processes (and their compilers) of an interrupted run, if any started."""
    pool = sys.modules.get("pt2flow.flows.engine.pool")
    if pool is not None:
        pool.stop_pool()


if __name__ == "__main__":
    sys.exit(main())
