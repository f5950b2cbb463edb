"""Index queries for the CLI: ls, show, lineage, diff, verify, gc (no torch, no Prefect)."""

from __future__ import annotations

import argparse
from typing import Any, Callable


def add_commands(sub: Any, store_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    return None
