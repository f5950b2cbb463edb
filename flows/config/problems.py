"""How config problems are reported (docs/architecture.md §3): every problem at once, each with
the file, the YAML line and the path of the offending key (`models[2].inputs.x.dtype`).

ConfigIssue is one problem, ConfigError all of them; YamlLines finds the line a key path came
from; ConfigLoader is the YAML loader both read a config with. Plain data (no pydantic, no
stages), so that the query commands' `--config` can report a broken config without importing the
schema (flows/config/reading.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any
from collections.abc import Iterable, Sequence

import yaml

# A config is walked recursively (pydantic, ${ENV} expansion, canonical JSON of kwargs): bound it.
MAX_CONFIG_DEPTH = 100
TOO_DEEP = f"nested deeper than {MAX_CONFIG_DEPTH} levels"  # the rule's one message: the scanner's and the walk's


class TooDeep(yaml.YAMLError):
    """A flow collection opened deeper than MAX_CONFIG_DEPTH, refused while scanning."""

    def __init__(self, line: int) -> None:
        super().__init__(TOO_DEEP)
        self.line = line


class ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses `[`/`{` nested deeper than MAX_CONFIG_DEPTH as it scans them.
    PyYAML's scanner keeps a possible simple key per open flow level and looks at all of them at
    every token, so 5,000 opening brackets took over 3 s of CPU (twice: the lines and the data)
    before the composer's RecursionError refused them; a config that deep is refused anyway."""

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:  # noqa: N803 - PyYAML's name
        if self.flow_level >= MAX_CONFIG_DEPTH:
            raise TooDeep(self.get_mark().line + 1)
        super().fetch_flow_collection_start(TokenClass)  # type: ignore[misc]


@dataclass(frozen=True)
class ConfigIssue:
    path: str  # e.g. models[2].inputs.x.dtype
    message: str
    line: int | None = None


class ConfigError(Exception):
    """A config is unusable. Holds every issue found, not just the first."""

    def __init__(self, source: str, issues: Sequence[ConfigIssue]) -> None:
        self.source = source
        self.issues = list(issues)
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"{self.source}: {len(self.issues)} problem{'s' if len(self.issues) != 1 else ''} in the config:"]
        for issue in self.issues:
            where = f"{self.source}:{issue.line}" if issue.line else self.source
            lines.append(f"  {where}: {issue.path or '(top level)'}: {issue.message}")
        return "\n".join(lines)


class YamlLines:
    """Maps a config path (('models', 2, 'inputs')) to the YAML line it came from."""

    def __init__(self, text: str) -> None:
        self.text = text

    @cached_property
    def root(self) -> yaml.Node | None:
        """The document's node tree, composed when a line is first asked for (a config without
        problems never is: composing is as slow as loading, 0.12 s for 100 models)."""
        try:
            return yaml.compose(self.text, Loader=ConfigLoader)
        except (yaml.YAMLError, RecursionError):
            return None

    def line(self, path: Iterable[Any]) -> int | None:
        node = self.root
        best = node.start_mark.line + 1 if node is not None else None
        for part in path:
            if isinstance(node, yaml.MappingNode):
                nxt = None
                for key_node, value_node in node.value:
                    if str(key_node.value) == str(part):
                        best = key_node.start_mark.line + 1
                        nxt = value_node
                        break
                node = nxt
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
                node = node.value[part]
                best = node.start_mark.line + 1
            else:
                break
            if node is None:
                break
        return best

    def issue(self, path: tuple[Any, ...], message: str) -> ConfigIssue:
        """A ConfigIssue at `path`, with the line it came from."""
        return ConfigIssue(format_path(path), message, self.line(path))


def format_path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out
