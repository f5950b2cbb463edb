"""Storage options given as KEY=VALUE pairs (`--storage-option`, dotted keys nest) and merged over a
config's; and UsageError, the error of an option or argument that cannot be used (exit 2)."""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence


class UsageError(ValueError):
    """A command-line option is malformed (exit 2)."""


def parse_storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option expects KEY=VALUE, got {pair!r}")
        parsed: Any = value
        if value.lower() in ("true", "false"):
            parsed = value.lower() == "true"
        else:
            try:
                parsed = int(value)
            except ValueError:
                pass
        # nested keys: client_kwargs.endpoint_url=...
        target = options
        parts = key.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = parsed
    return options


def merge_options(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_options(out[key], value)
        else:
            out[key] = value
    return out
