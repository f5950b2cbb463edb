"""What every query command shares: exit codes, opening the store named on the command line,
printing (JSON or rich), the error guard that maps storage and ID errors to exit codes, and the
size formatter. Storage only: no torch, no Prefect."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from pt2flow.flows.report.text import format_size  # noqa: F401  (sizes read the same in every view)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_STORE = "./pt2-store"


class CommandUsageError(Exception):
    """A query command was given arguments it cannot use (exit 2)."""


def open_store(args: argparse.Namespace) -> Any:
    """The store of `--store`, else $PT2FLOW_STORE, else ./pt2-store; a local path must exist."""
    from pt2flow.flows.cli.options import UsageError, parse_storage_options
    from pt2flow.storage import ArtifactStore

    url = args.store or os.environ.get("PT2FLOW_STORE") or DEFAULT_STORE
    if "://" not in url:
        url = os.path.abspath(url)
        if not os.path.isdir(url):
            raise CommandUsageError(f"no store at {url} (give --store URL or set PT2FLOW_STORE)")
    try:
        options = parse_storage_options(args.storage_option or [])
    except UsageError as exc:
        raise CommandUsageError(str(exc)) from None
    return ArtifactStore(url, options)


def rich_console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def dump(value: Any) -> None:
    print(json.dumps(value, indent=1, default=str))


def guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Storage and ID errors become a clear one-line message and a non-zero exit."""

    def run(args: argparse.Namespace) -> int:
        from pt2flow.storage.errors import AmbiguousId, InvalidId, RecordNotFound, StorageError

        try:
            return fn(args)
        except (CommandUsageError, InvalidId, AmbiguousId) as exc:
            print(f"pt2flow {args.command}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except RecordNotFound as exc:
            print(f"pt2flow {args.command}: {exc}", file=sys.stderr)
            return EXIT_FAILED
        except StorageError as exc:
            print(f"pt2flow {args.command}: storage error: {exc}", file=sys.stderr)
            return EXIT_FAILED

    return run
