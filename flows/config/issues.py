"""How config problems are reported (docs/architecture.md §3): ConfigIssue, ConfigError and
YamlLines (flows/config/problems.py, re-exported here), and pydantic_issues, which turns
pydantic's errors into ConfigIssues (an unknown key with the key it most likely meant).
"""

from __future__ import annotations

import difflib
from typing import Any
from collections.abc import Iterable, Sequence

from pydantic import ValidationError

from pt2flow.flows.config.problems import ConfigError, ConfigIssue, YamlLines, format_path
from pt2flow.stages.options import UNION_TAGS

__all__ = ["ConfigError", "ConfigIssue", "YamlLines", "did_you_mean", "format_path", "pydantic_issues", "unknown_key"]


def pydantic_issues(exc: ValidationError, prefix: tuple[Any, ...], lines: YamlLines) -> list[ConfigIssue]:
    issues = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if p not in UNION_TAGS)
        loc = prefix + loc
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = unknown_key(loc)
        elif err["type"] == "missing":
            message = "required key is missing"
        elif "input" in err and err["type"] not in ("missing",):
            shown = repr(err["input"])
            if len(shown) > 80:
                shown = shown[:77] + "..."
            message = f"{message} (got {shown})"
        issues.append(ConfigIssue(format_path(loc), message, lines.line(loc)))
    return issues


def unknown_key(path: Sequence[Any]) -> str:
    """The message for a key the schema does not know at `path` (the key last): "unknown key",
    with the key valid at that place of the config it most likely meant."""
    from pt2flow.flows.config.jsonschema import keys_at  # the schema imports the config's models

    return "unknown key" + did_you_mean(path[-1], keys_at(path[:-1]))


def did_you_mean(given: Any, choices: Iterable[str]) -> str:
    """ "; did you mean `CHOICE`?" for the choice closest to `given` (difflib, ignoring case), else ""."""
    by_lower = {choice.lower(): choice for choice in choices if choice != str(given)}
    close = difflib.get_close_matches(str(given).lower(), list(by_lower), n=1)
    return f"; did you mean `{by_lower[close[0]]}`?" if close else ""
