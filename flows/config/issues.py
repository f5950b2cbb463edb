"""How config problems are reported (docs/architecture.md §3): ConfigIssue, ConfigError and
YamlLines (flows/config/problems.py, re-exported here), and pydantic_issues, which turns
pydantic's errors into ConfigIssues.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pt2flow.flows.config.problems import ConfigError, ConfigIssue, YamlLines, format_path
from pt2flow.stages.options import UNION_TAGS

__all__ = ["ConfigError", "ConfigIssue", "YamlLines", "format_path", "pydantic_issues"]


def pydantic_issues(exc: ValidationError, prefix: tuple[Any, ...], lines: YamlLines) -> list[ConfigIssue]:
    issues = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if p not in UNION_TAGS)
        loc = prefix + loc
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "missing":
            message = "required key is missing"
        elif "input" in err and err["type"] not in ("missing",):
            shown = repr(err["input"])
            if len(shown) > 80:
                shown = shown[:77] + "..."
            message = f"{message} (got {shown})"
        issues.append(ConfigIssue(format_path(loc), message, lines.line(loc)))
    return issues
