"""Torch-free import helpers shared by the config checker (flows) and the source stage."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def search_path_first(path: str | None) -> Iterator[None]:
    """Put `path` (a config's folder) first on sys.path for the block, unless it is there already."""
    added = bool(path) and path not in sys.path
    if added:
        sys.path.insert(0, path)  # type: ignore[arg-type]
    try:
        yield
    finally:
        if added:
            try:
                sys.path.remove(path)  # type: ignore[arg-type]
            except ValueError:
                pass
