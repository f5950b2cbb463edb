"""`pt2flow run`: export every model of a config. torch and Prefect are imported only once the
config and the store have been checked (a usage error answers fast and runs nothing)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator, Sequence

import click

from pt2flow.flows.api.running import execute
from pt2flow.flows.cli.errors import EXIT_FAILED, EXIT_OK, note_interrupt
from pt2flow.flows.cli.launch import CONFIG_HELP, fleet_options, runner_of, stage_list
from pt2flow.flows.cli.support import Args, command, json_option, rich_console
from pt2flow.flows.options import parse_storage_options

if TYPE_CHECKING:
    from pt2flow.storage import ArtifactStore


@command(
    "run",
    help="Run the pipeline on every model of CONFIG. Exit 0: all ok; 1: a model failed (the others still ran); 2: bad config or usage.",
    arguments=CONFIG_HELP,
)
@click.argument("config", metavar="CONFIG")
@fleet_options
@click.option("--force", is_flag=True, help="ignore cached results and re-run every stage")
@click.option(
    "--verify-sources",
    is_flag=True,
    help="build every model again (no export) instead of trusting the files its construction read; re-export exactly "
    "those whose eager model (parameters, buffers, structure) or files changed. Costs one model build per model",
)
@click.option(
    "--retry-failed",
    is_flag=True,
    help="re-run stages whose cached outcome is a deterministic failure (data_dependent, decomposition, ...); "
    "without it, an unchanged model that failed that way is reported again from the index",
)
@json_option("print one JSON document on stdout (logs go to stderr)")
@click.option("--progress", is_flag=True, help="show the progress bar even when stderr is not a terminal")
@click.option("--verbose", "-v", is_flag=True, help="show Prefect's log lines")
def run_command(args: Args) -> int:
    # SIGTERM stops a run as Ctrl-C does (serve keeps Prefect's own handling of both)
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        return run_fleet(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupt(signum: int, frame: Any) -> None:
    """SIGTERM: stop the workers now, lock-free (the main thread may hold any lock, or be about
    to join a model thread that waits on a hung worker), then unwind as Ctrl-C does."""
    note_interrupt()
    pool = sys.modules.get("pt2flow.flows.engine.orchestrator.pool")
    if pool is not None:
        pool.interrupt_pool()
    raise KeyboardInterrupt


def run_fleet(args: Args) -> int:
    from pt2flow.flows.api.running import prepare_run

    prepared = prepare_run(
        args.config,
        store=args.store,
        storage_options=parse_storage_options(args.storage_option or []),
        only=args.only or (),
        stages=stage_list(args),
        workers=args.workers,
        runner=runner_of(args),
        dask_address=args.dask_address,
        no_worker_timeout_s=args.no_worker_timeout,
        force=args.force,
        verify_sources=args.verify_sources,
        retry_failed=args.retry_failed,
        python=args.python,
    )
    if args.verbose:  # before Prefect is imported: it reads its logging settings once, at import
        os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] = "INFO"
    if args.json:
        with stdout_to_stderr() as real_stdout:
            document = command_wall_time(execute(prepared))
            real_stdout.write(json.dumps(document, default=str) + "\n")
            real_stdout.flush()
    else:
        document = command_wall_time(
            execute(prepared, progress=terminal_progress if sys.stderr.isatty() or args.progress else None)
        )
        from pt2flow.flows.cli.summary import render_run

        render_run(document, rich_console(), config=args.config, store=args.store, stages=tuple(prepared.config.stages))
    return EXIT_OK if document["summary"]["failed"] == 0 else EXIT_FAILED


def command_wall_time(document: dict[str, Any]) -> dict[str, Any]:
    """The summary's seconds as the user waited for them: from this process's start (interpreter,
    imports, Prefect's server and the workers starting included), not from the flow's."""
    elapsed = seconds_since_process_start()
    if elapsed is not None:
        document["summary"]["seconds"] = round(max(float(document["summary"]["seconds"]), elapsed), 3)
    return document


def seconds_since_process_start() -> float | None:
    """From the kernel's start time of this process (clock ticks since boot, /proc/self/stat
    field 22) to now on the same clock; None where there is no /proc. (psutil's create_time adds
    the boot time, which /proc gives in whole seconds: up to a second off.)"""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[Any]:
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


def terminal_progress(
    store: ArtifactStore, run_id: str, models: list[str], stages: Sequence[str]
) -> contextlib.AbstractContextManager[Any]:
    """The live progress bar of a fleet run, on stderr."""
    from rich.console import Console

    from pt2flow.flows.cli.progress import FleetProgress

    return FleetProgress(store, run_id, models, stages, Console(stderr=True))
