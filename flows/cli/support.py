"""What every command shares: the `command` decorator (a click command whose function takes one
namespace of its parameters), the --store/--storage-option options, opening the store named on
the command line, printing (JSON or rich) and the size formatter. Storage only: no torch, no
Prefect; heavy modules are imported inside the functions, so that `--help` stays fast."""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
from types import SimpleNamespace
from typing import Any
from collections.abc import Callable, Mapping

import click

from pt2flow.flows.cli.errors import CommandUsageError
from pt2flow.flows.options import UsageError, parse_storage_options

DEFAULT_STORE = "./pt2-store"

Args = SimpleNamespace  # a command's parameters by name, and `command`: the command's name


class Command(click.Command):
    """A click command whose --help also describes its positional arguments (click's own help
    lists options only), in an "Arguments" section before the options."""

    def __init__(self, *args: Any, arguments: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.argument_help = dict(arguments or {})

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if self.argument_help:
            with formatter.section("Arguments"):
                formatter.write_dl(list(self.argument_help.items()))
        super().format_options(ctx, formatter)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        names = [
            name
            for param in self.get_params(ctx)
            for name in param.opts + param.secondary_opts
            if name.startswith("--")
        ]
        return super().parse_args(ctx, expand_prefixes(args, names))


def expand_prefixes(args: list[str], names: list[str]) -> list[str]:
    """Long options may be abbreviated to a unique prefix (`--desc` for `--descendants`), as
    they could be before click; an ambiguous or unknown one is left for click to refuse."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        name, eq, value = arg.partition("=")
        matches = [n for n in names if n.startswith(name)] if name.startswith("--") and name not in names else []
        out.append(matches[0] + eq + value if len(matches) == 1 else arg)
    return out


def command(name: str, **attrs: Any) -> Callable[[Callable[[Args], int]], click.Command]:
    """A click command named NAME from a function of Args returning its exit code (0 or 1);
    `arguments` (optional) maps each positional argument's metavar to its help."""

    def decorate(fn: Callable[[Args], int]) -> click.Command:
        @functools.wraps(fn)  # carries the click parameters declared on fn
        def callback(**params: Any) -> int:
            return fn(Args(command=name, **params))

        return click.command(name, cls=Command, **attrs)(callback)

    return decorate


def json_option(help: str | None = None) -> Callable[[Any], Any]:
    return click.option("--json", "json", is_flag=True, help=help)


STORE_URL_HELP = "store URL (local path, file://, memory://, s3://bucket/prefix)"
CONFIG_STORE_HELP = "read the store (and storage_options) of this pipeline config, as `run CONFIG` would write it"


def store_options(fn: Any = None, *, config_help: str = CONFIG_STORE_HELP) -> Any:
    """--store URL, --config CONFIG and --storage-option KEY=VALUE (repeatable), for the commands
    that query a store: the store is --store, else --config's store, else $PT2FLOW_STORE, else
    ./pt2-store (open_store). `@store_options(config_help=...)` for a command whose --config
    does more."""

    def decorate(fn: Any) -> Any:
        fn = click.option("--config", "config", metavar="CONFIG", help=config_help)(fn)
        return _store_options(
            fn, f"{STORE_URL_HELP}; default: --config's store, else $PT2FLOW_STORE, else {DEFAULT_STORE}"
        )

    return decorate(fn) if fn is not None else decorate


def config_store_options(fn: Any) -> Any:
    """--store and --storage-option for the commands that read a config (run, serve)."""
    return _store_options(fn, f"{STORE_URL_HELP}; overrides the config's store:")


def _store_options(fn: Any, store_help: str) -> Any:
    fn = click.option(
        "--storage-option",
        "storage_option",
        metavar="KEY=VALUE",
        multiple=True,
        help="fsspec storage option (repeatable; dotted keys nest)",
    )(fn)
    return click.option("--store", metavar="URL", help=store_help)(fn)


def open_store(args: Args) -> Any:
    """The store of `--store`, else `--config`'s, else $PT2FLOW_STORE, else ./pt2-store
    (api.locate_store); a local path must exist."""
    from pt2flow.flows.api.store import locate_store
    from pt2flow.storage import ArtifactStore

    try:
        where = locate_store(
            args.store,
            config=getattr(args, "config", None),
            storage_options=parse_storage_options(args.storage_option or []),
        )
    except UsageError as exc:
        raise CommandUsageError(str(exc)) from None
    problem = where.absent()
    if problem:
        raise CommandUsageError(problem)
    global opened_store
    opened_store = where.url
    return ArtifactStore(where.url, where.storage_options)


# the store this command read (open_store): a "nothing found" answer names it (errors.py)
opened_store: str | None = None


def write_page(path: str, render: Callable[[], str]) -> None:
    """Write `render()` to the file `path` (an --html option), or CommandUsageError naming why not.
    Call check_page_path first, so that a bad path is refused before the work."""
    try:
        with open(path, "w", encoding="utf-8") as out:
            out.write(render())
    except OSError as exc:
        raise CommandUsageError(f"cannot write {path}: {exc.strerror or exc}") from exc
    print(f"wrote {path}", file=sys.stderr)


def present(args: Args, document: Any, page: Callable[[Any], str], terminal: Callable[[Any, Any], None]) -> None:
    """What a report command prints: the --html page of `document` (if asked), then `document`
    as JSON (--json) or its terminal view."""
    if args.html:
        write_page(args.html, lambda: page(document))
    if args.json:
        dump(document)
    else:
        terminal(document, rich_console())


def check_page_path(path: str) -> None:
    """CommandUsageError when `path` cannot be a file to write: a folder, in no folder, or in one
    this user may not write in."""
    from pt2flow.storage.retrieve import ArtifactRequestError, check_destination

    try:
        target = check_destination(path)
    except ArtifactRequestError as exc:
        raise CommandUsageError(str(exc)) from None
    if not os.access(os.path.dirname(target), os.W_OK):
        raise CommandUsageError(f"cannot write {path}: no permission to write in {os.path.dirname(target)}")


def rich_console() -> Any:
    """The console commands print on: the terminal's width, else $COLUMNS, else 160 columns (a
    pipe or a file). A reader that closes the pipe ends the command as errors.exit_code says
    (rich's own handling would exit 1)."""
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, "stdout was closed by its reader")

    columns = os.environ.get("COLUMNS", "")
    return PipeConsole(
        width=None if sys.stdout.isatty() else int(columns) if columns.isdigit() and int(columns) > 0 else 160
    )


def dump(value: Any) -> None:
    print(json.dumps(value, indent=1, default=str))


def format_size(value: Any) -> str:
    """Sizes read the same in every view (the report's formatter)."""
    from pt2flow.flows.report.text import format_size as report_size

    return report_size(value)
