"""Reading a config file's text before the schema sees it (docs/architecture.md §3), and the
store it names: plain YAML and data, no pydantic schema, no stages (the query commands' `--config`
reads a config's store through here without importing the schema).

- `read_config_file`: the text and the folder every relative path of the config resolves against;
- `safe_yaml`: the document as a mapping, refused when it is too deep or too large once YAML
  aliases are expanded;
- `expand_env`: ${ENV} references in storage_options;
- `resolve_store_url`: a store path made absolute (a config's against its folder, a command
  line's against the current one);
- `read_store_settings`: a config's store and storage options alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from pt2flow.flows.config.problems import (
    MAX_CONFIG_DEPTH,
    TOO_DEEP,
    ConfigError,
    ConfigIssue,
    ConfigLoader,
    TooDeep,
    YamlLines,
)

MAX_CONFIG_NODES = 1_000_000
DEFAULT_STORE = "./pt2-store"  # a config without `store:` (beside the config, as any relative path)
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def read_config_file(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(text, absolute folder) of a config file; ConfigError when it cannot be read."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), [ConfigIssue("", f"cannot read the config file: {exc.strerror or exc}")]) from exc
    return text, str(p.resolve().parent)


def resolve_store_url(store: str, base_dir: str | None = None) -> str:
    """A store URL as it is: a local path made absolute, a relative one taken from `base_dir` (a
    config's folder, for a config's `store:`) or else from the current folder (a command-line
    `--store`, like any path typed there); `~` expanded."""
    if "://" in store:
        return store
    path = os.path.expanduser(store)
    return os.path.abspath(os.path.join(base_dir, path) if base_dir else path)


def read_store_settings(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """(store URL, storage options) of a config file, for the commands that only query its store
    (`ls --config CONFIG`): the store resolved as `run` resolves it, ${ENV} expanded. Only these
    two keys are checked, so a model the querying machine cannot import does not stop a query;
    ConfigError when they (or the YAML) are broken."""
    text, folder = read_config_file(path)
    source = str(path)
    data = safe_yaml(text, source)
    lines = YamlLines(text)
    store = data.get("store", DEFAULT_STORE)
    options = data.get("storage_options") or {}
    issues: list[ConfigIssue] = []
    if not isinstance(store, str) or not store:
        issues.append(lines.issue(("store",), f"expected a store URL or path, got {store!r}"))
    if not isinstance(options, dict):
        issues.append(
            lines.issue(("storage_options",), f"expected a mapping of fsspec options, got {type(options).__name__}")
        )
    else:
        options = expand_env(options, ("storage_options",), issues, lines)
    if issues:
        raise ConfigError(source, issues)
    return resolve_store_url(store, folder), options


def safe_yaml(text: str, source: str) -> dict[str, Any]:
    """The YAML document as a mapping that is safe to walk; raises ConfigError otherwise."""
    try:
        data = yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - ConfigLoader is a SafeLoader
    except TooDeep as exc:
        raise ConfigError(source, [ConfigIssue("", f"config rejected: {exc}", exc.line)]) from None
    except RecursionError:
        raise ConfigError(source, [ConfigIssue("", "YAML error: nested too deeply to parse", None)]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        message = f"YAML error: {problem}" + (f" ({context})" if context else "")
        raise ConfigError(source, [ConfigIssue("", message, line)]) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            source, [ConfigIssue("", f"expected a mapping at the top level, got {type(data).__name__}", 1)]
        )
    shape_problem = _shape_problem(data)
    if shape_problem:
        raise ConfigError(source, [ConfigIssue("", shape_problem, None)])
    return data


class _TooLarge(Exception):
    pass


def _shape_problem(data: Any) -> str | None:
    """Why the loaded YAML is unsafe to walk, or None: an alias that contains itself, nesting
    deeper than MAX_CONFIG_DEPTH, or more than MAX_CONFIG_NODES values once aliases are expanded
    (a "billion laughs" document is a few lines that expand to 10**9 values)."""
    seen: dict[int, tuple[int, int]] = {}  # id -> (expanded size, height), for nodes shared by aliases
    active: set[int] = set()

    def walk(node: Any, depth: int) -> tuple[int, int]:
        if not isinstance(node, (dict, list)):
            return 1, 0
        key = id(node)
        if key in active:
            raise _TooLarge("a YAML alias contains itself (a recursive structure)")
        if key in seen:
            size, height = seen[key]
        else:
            if depth > MAX_CONFIG_DEPTH:
                raise _TooLarge(TOO_DEEP)
            active.add(key)
            size, height = 1, 0
            for child in (*node.keys(), *node.values()) if isinstance(node, dict) else node:
                child_size, child_height = walk(child, depth + 1)
                size, height = size + child_size, max(height, child_height + 1)
                if size > MAX_CONFIG_NODES:
                    raise _TooLarge(f"more than {MAX_CONFIG_NODES} values once YAML aliases are expanded")
            active.discard(key)
            seen[key] = (size, height)
        if depth + height > MAX_CONFIG_DEPTH:
            raise _TooLarge(TOO_DEEP)
        return size, height

    try:
        walk(data, 0)
    except _TooLarge as exc:
        return f"config rejected: {exc}"
    return None


def expand_env(value: Any, path: tuple[Any, ...], issues: list[ConfigIssue], lines: YamlLines) -> Any:
    if isinstance(value, str):

        def repl(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in os.environ:
                issues.append(lines.issue(path, f"environment variable ${{{name}}} is not set"))
                return ""
            return os.environ[name]

        return _ENV_REF.sub(repl, value)
    if isinstance(value, dict):
        return {k: expand_env(v, path + (k,), issues, lines) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, path + (i,), issues, lines) for i, v in enumerate(value)]
    return value
