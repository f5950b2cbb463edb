"""The pt2flow command line (docs/architecture.md §4): the root `pt2flow` group and `main`.

Built on click. Of the three frameworks at hand, measured with `python -X importtime -c
"import X"` (median of 10 on the 2-core dev box): click 21 ms, typer 41 ms (click plus its own
layer), cyclopts 47 ms (attrs, rich-rst); argparse is 2 ms but hand-rolled. click is also the
one whose lazy subcommands are plain documented API (Group.get_command / list_commands).
With it, `pt2flow --help` and `pt2flow ls --help` spend 43 ms importing (the argparse version:
280-290 ms, as building its parser imported every command's module and with it pyarrow).

Thin by design: each command lives in its own module, imported only when that command runs (or
its --help is asked for); `pt2flow --help` imports none of them, and only `run` and `serve`
import torch and Prefect, inside the function that needs them. Every exception becomes an exit
code in one place, errors.exit_code.
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys
import threading
from typing import Any, NoReturn
from collections.abc import Mapping, Sequence

import click

from pt2flow.flows.cli.errors import exit_code

DESCRIPTION = """\
\b
pt2flow turns PyTorch models into verified deployable artifacts. A YAML config names the models;
each goes through trace -> functionalize -> decompose -> serialize -> aot_compile -> validate,
orchestrated by Prefect, with every artifact stored by sha256 and every stage run in a Parquet
index you can query (ls, show, lineage, diff).
"""

# name -> ("module:attribute" of its click command, the one line `pt2flow --help` shows)
COMMANDS: Mapping[str, tuple[str, str]] = {
    "run": ("pt2flow.flows.cli.run:run_command", "export every model of a config"),
    "validate": ("pt2flow.flows.cli.validate:validate_command", "check a config without running anything"),
    "serve": (
        "pt2flow.flows.cli.serve:serve_command",
        "serve the fleet as a scheduled Prefect deployment (needs `prefect server start`)",
    ),
    "ls": ("pt2flow.flows.cli.queries:ls_command", "list index records"),
    "show": ("pt2flow.flows.cli.queries:show_command", "every field of one record"),
    "lineage": ("pt2flow.flows.cli.queries:lineage_command", "where an artifact came from (or what was built from it)"),
    "diff": ("pt2flow.flows.cli.queries:diff_command", "compare two artifacts' records"),
    "verify": ("pt2flow.flows.cli.maintenance:verify_command", "re-hash every blob"),
    "gc": ("pt2flow.flows.cli.maintenance:gc_command", "delete unreferenced blobs"),
    "report": (
        "pt2flow.flows.cli.report:report_command",
        "drift between two runs (default: the newest and the earlier one that covered its models)",
    ),
    "failures": (
        "pt2flow.flows.cli.report:failures_command",
        "a run's failures grouped by root cause, against the run before",
    ),
    "get": ("pt2flow.flows.cli.artifacts:get_command", "copy a verified artifact out of the store"),
    "repro": ("pt2flow.flows.cli.artifacts:repro_command", "a torch-only script that reproduces a failed stage"),
    "schema": ("pt2flow.flows.cli.artifacts:schema_command", "print the config's JSON Schema"),
    "check-compat": (
        "pt2flow.flows.cli.artifacts:check_compat_command",
        "do a run's artifacts still load and match under this torch?",
    ),
    "upgrade-check": (
        "pt2flow.flows.cli.upgrade:upgrade_check_command",
        "what would a candidate torch / transformers environment do to the fleet?",
    ),
    "audit": (
        "pt2flow.flows.cli.audit:audit_command",
        "rebuild a sample of a run's program records: is the cache honest?",
    ),
}


class LazyGroup(click.Group):
    """A group whose subcommands (COMMANDS) are imported only when one is invoked or asked for
    its help; the group's own help lists them from COMMANDS without importing any."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context | None, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attribute = COMMANDS[cmd_name][0].split(":")
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command) and command.name == cmd_name, (cmd_name, command)
        if _console:  # the console script's own process: pyarrow is told pandas is not needed
            from pt2flow.storage.index import skip_pandas_probe

            skip_pandas_probe()
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, short) for name, (_, short) in COMMANDS.items()])


def print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """`pt2flow X (torch Y)`, from the installed distributions' metadata: torch is not imported."""
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch = f"torch {version('torch')}"
    except PackageNotFoundError:
        torch = "torch not installed"
    click.echo(f"pt2flow {version('pt2flow')} ({torch})")
    ctx.exit(0)


@click.group(
    "pt2flow",
    cls=LazyGroup,
    help=DESCRIPTION,
    context_settings={"help_option_names": ["-h", "--help"]},
    options_metavar="[OPTIONS]",
    subcommand_metavar="COMMAND [ARGS]...",
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=print_version,
    help="print pt2flow's and torch's versions and exit",
)
def cli() -> None:
    pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code (0 ok, 1 failed, 2 usage, 130 interrupted, 141 stdout closed)."""
    args = sys.argv[1:] if argv is None else list(argv)
    # `kill -USR1 PID` prints every thread's stack on stderr: what a long run or serve is doing now
    if hasattr(signal, "SIGUSR1"):
        import faulthandler

        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (OSError, ValueError):  # a stderr with no file descriptor (main called in-process, output captured)
            pass
    root: click.Context | None = None
    try:
        with cli.make_context("pt2flow", args) as root:
            result: Any = cli.invoke(root)
        sys.stdout.flush()  # a reader that closed the pipe is met here, not at interpreter exit
        return int(result or 0)
    except BaseException as exc:  # noqa: BLE001 - exit_code re-raises what it does not map
        return exit_code(exc, root.invoked_subcommand if root is not None else None)


_console = False  # set by console(): this process is the console script's, not a program's that called main()


def console() -> NoReturn:
    """The `pt2flow` console script (and `python -m pt2flow.flows.cli.main`): `main`, then `leave`."""
    global _console
    _console = True
    leave(main())


def leave(code: int) -> NoReturn:
    """End the process with `code` once its work is done, as the interpreter would up to the point
    where it starts tearing itself down: wait for the threads that are not daemons, run the atexit
    callbacks (the private Prefect server's and the worker pool's stop, logging's flush), flush
    stdout and stderr; then `os._exit`, which skips what comes after, the C-level exit handlers
    and C++ static destructors. One of those, in a library pt2flow does not own, now and then
    found a thread it had started still running and called std::terminate: a finished command,
    its answer printed, died with SIGABRT ("terminate called without an active exception"), a
    query on S3 about once in a hundred and, on CI, a `run` on S3 (tests/flows/
    test_query_cli.py test_a_command_exits_with_its_code_whatever_a_c_exit_handler_would_do)."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that closed the pipe, or a stream already closed
            pass
    os._exit(code)


if __name__ == "__main__":
    console()
