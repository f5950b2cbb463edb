"""The Jinja2 environment the HTML views share (report.html.j2, compat.html.j2): templates from
this package, autoescaped, strict about undefined names."""

from __future__ import annotations

from typing import Any


def environment(**extra: Any) -> Any:
    """A jinja2.Environment over flows/report/templates; `extra` adds or overrides settings."""
    import jinja2

    settings: dict[str, Any] = {
        "loader": jinja2.PackageLoader("pt2flow.flows.report", "templates"),
        "autoescape": True,
        "trim_blocks": True,
        "lstrip_blocks": True,
        "keep_trailing_newline": True,
        "undefined": jinja2.StrictUndefined,
    }
    return jinja2.Environment(**{**settings, **extra})
