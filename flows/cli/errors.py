"""Exit codes and the one place that turns an exception into one (docs/architecture.md §4).

Commands return EXIT_OK or EXIT_FAILED (a model failed, a blob is corrupt, a regression was
flagged) and raise for everything else; `exit_code` prints the message and picks the code:

    UsageError, CommandUsageError, ConfigError, bad or ambiguous ID,
    click's usage errors (unknown command or option, missing argument, bad value)   2
    no such record, storage error                                                    1
    Ctrl-C (and SIGTERM during `run`): worker processes stopped                      130
    stdout closed by its reader (`pt2flow ls --json | head`): nothing more printed   141

141 is what a shell reports for a tool that SIGPIPE killed (128 + 13), as `ls -R / | head`
does: a pipeline under `set -o pipefail` sees the output was cut short, and no traceback is
printed. stdout is pointed at /dev/null first, so the interpreter's final flush is silent too.

Anything else is a bug and propagates with its traceback. Storage only: no torch, no Prefect.
"""

from __future__ import annotations

import os
import sys

import click

from pt2flow.flows.options import UsageError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_BROKEN_PIPE = 128 + 13  # as if SIGPIPE had ended the process


_interrupted = False


def note_interrupt() -> None:
    """A signal handler is interrupting the command: whatever exception reaches exit_code now is
    the interrupt (a KeyboardInterrupt raised inside, say, pydantic's serializer comes out as
    its PydanticSerializationError), and ends as one with 130."""
    global _interrupted
    _interrupted = True


class CommandUsageError(Exception):
    """A command was given arguments it cannot use (exit 2, the message names the command)."""


def exit_code(exc: BaseException, command: str | None) -> int:
    """Print what went wrong on stderr and return the exit code; re-raise what is not ours."""
    if isinstance(exc, click.exceptions.Exit):  # --help, --version
        return exc.exit_code
    if isinstance(exc, click.ClickException):
        exc.show()
        return exc.exit_code
    if isinstance(exc, BrokenPipeError):
        silence_stdout()
        return EXIT_BROKEN_PIPE
    if isinstance(exc, KeyboardInterrupt) or _interrupted:  # an interrupt a library wrapped in its own error included
        stop_workers()
        print("pt2flow: interrupted; worker processes stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    if isinstance(exc, UsageError):
        print(f"pt2flow: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return _library_error(exc, f"pt2flow {command}" if command else "pt2flow")


def _library_error(exc: BaseException, prefix: str) -> int:
    """Errors of the config and storage layers, imported only once one happened."""
    from pt2flow.storage.errors import IdError, RecordNotFound, StorageError

    # a ConfigError comes from a loaded flows.config (problems.py); looked up rather than imported,
    # because the config package imports pt2flow.stages, which the query commands must not (import-linter)
    problems = sys.modules.get("pt2flow.flows.config.problems")
    if problems is not None and isinstance(exc, problems.ConfigError):
        print(exc.render(), file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, (CommandUsageError, IdError)):
        print(f"{prefix}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, RecordNotFound):
        print(f"{prefix}: {exc}{_which_store(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(exc, StorageError):
        print(f"{prefix}: storage error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    raise exc


def _which_store(message: str) -> str:
    """ " (store URL)" when the command read a store that `message` does not name: "no run in the
    index" means little when it was not the store the user thought (a config's store elsewhere)."""
    support = sys.modules.get("pt2flow.flows.cli.support")
    url = getattr(support, "opened_store", None)
    if not url or url in message:
        return ""
    from pt2flow.storage.urls import redact_url

    return f" (store {redact_url(url)})"


def silence_stdout() -> None:
    """Point fd 1 at /dev/null: what is still buffered for a reader that left goes nowhere,
    instead of failing again (with "Exception ignored ... BrokenPipeError") when Python exits."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no fd 1 to redirect (stdout replaced or closed)
        pass


def stop_workers() -> None:
    """Stop the worker processes (and their compilers) of an interrupted run, if any started."""
    pool = sys.modules.get("pt2flow.flows.engine.orchestrator.pool")
    if pool is not None:
        pool.interrupt_pool()  # first the flag: a model thread that sees its worker die records no crash
        pool.stop_pool()
