"""mkdocs hooks (mkdocs.yml `hooks:`): the reference pages the site generates from the code.

- reference/config.md: every field of the config's JSON Schema (flows/config/jsonschema.py, the
  same schema `pt2flow schema` prints), per object, with its type, default and description, and
  an example of each object in YAML;
- reference/cli.md: every `pt2flow` command's own `--help`, as click renders it.

Both are built when the site is, so neither can fall behind the code; tests/test_docs.py checks
that the config reference names every field the schema has. Not a page: mkdocs.yml excludes it.
"""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Iterator, Mapping

import yaml

CONFIG_PAGE = "reference/config.md"
CLI_PAGE = "reference/cli.md"


# --- the config reference -----------------------------------------------------------------------


def _ref_name(node: Mapping[str, Any]) -> str | None:
    ref = node.get("$ref")
    return ref.rsplit("/", 1)[-1] if isinstance(ref, str) else None


def _type_text(node: Mapping[str, Any]) -> str:
    """A field's type in words: `object` names (links) the object, unions are joined with `|`."""
    ref = _ref_name(node)
    if ref:
        return f"[{ref}](#{ref.lower()})"
    if "enum" in node:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    for union in ("anyOf", "oneOf"):
        if union in node:
            return " \\| ".join(_type_text(option) for option in node[union])
    kind = node.get("type")
    if isinstance(kind, list):
        return " \\| ".join(_type_text({**node, "type": k}) for k in kind)
    if kind == "array":
        items = node.get("items")
        return f"list of {_type_text(items)}" if isinstance(items, Mapping) and items else "list"
    if kind == "object":
        extra = node.get("additionalProperties")
        if isinstance(extra, Mapping) and extra:
            return f"map of {_type_text(extra)}"
        return "object"
    return str(kind) if kind else "any"


def _example_value(node: Mapping[str, Any], defs: Mapping[str, Any]) -> Any:
    """A value an example may show: the default, else the first enum or const, else a placeholder
    of the field's type."""
    if "default" in node:
        return node["default"]
    if "enum" in node:
        return node["enum"][0]
    if "const" in node:
        return node["const"]
    ref = _ref_name(node)
    if ref:
        return {}
    for union in ("anyOf", "oneOf"):
        if union in node:
            return _example_value(next(o for o in node[union] if o.get("type") != "null"), defs)
    kind = node.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    return {"string": "...", "integer": 0, "number": 0.0, "boolean": False, "array": [], "object": {}}.get(
        str(kind), None
    )


def objects(schema: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(name, schema) for the config itself, then every object written inline under it (named by
    its path: `defaults`, `model` for an item of `models`, `model.stages`), then every $defs
    entry: the sections of the reference, in that order."""
    yield "config", schema
    yield from _inline(schema, "")
    for name, node in schema.get("$defs", {}).items():
        yield name, node
        yield from _inline(node, name)
        for option in node.get("anyOf", ()):  # a union's object forms: `input_tree: tuple`
            if "properties" in option:
                form = f"{name}: {', '.join(option['properties'])}"
                yield form, option
                yield from _inline(option, form)


def _inline(node: Mapping[str, Any], path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for field, spec in node.get("properties", {}).items():
        name = "model" if field == "models" and not path else f"{path}.{field}" if path else field
        for candidate in (spec, spec.get("items"), *spec.get("anyOf", ())):
            if isinstance(candidate, Mapping) and "properties" in candidate:
                yield name, candidate
                yield from _inline(candidate, name)
                break


def fields(schema: Mapping[str, Any]) -> dict[str, set[str]]:
    """Every field the schema has, per object (`objects`): what the reference must list."""
    return {name: set(node.get("properties", {})) for name, node in objects(schema)}


def config_reference(schema: Mapping[str, Any]) -> str:
    defs = schema.get("$defs", {})
    out = [
        "# Config reference",
        "",
        "Every field of a config, generated from the config's JSON Schema when this site is built",
        "(`pt2flow schema` prints the same schema; docs/config.schema.json is a copy that editors",
        "read). An object's fields are in a table, then an example of that object in YAML that shows",
        "every field at its default (or, for a field without one, a value of its type).",
        "[A config](../config.md) explains how the parts fit together.",
        "",
    ]
    for name, node in objects(schema):
        out += [f"## {name}", ""]
        if node.get("description"):
            out += [" ".join(str(node["description"]).split()), ""]
        if "properties" not in node:  # a tree or a union: its shape, no fields of its own
            out += [f"Type: {_type_text(node)}", ""]
            continue
        if not node["properties"]:
            out += ["No fields: `{}`.", ""]
            continue
        required = set(node.get("required", ()))
        out += ["| field | type | default | description |", "|---|---|---|---|"]
        example: dict[str, Any] = {}
        for field, spec in node.get("properties", {}).items():
            default = (
                f"`{json.dumps(spec['default'])}`" if "default" in spec else ("required" if field in required else "")
            )
            description = " ".join(str(spec.get("description", "")).split()).replace("|", "\\|")
            out.append(f"| `{field}` | {_type_text(spec)} | {default} | {description} |")
            example[field] = _example_value(spec, defs)
        out += ["", "```yaml", yaml.safe_dump(example, sort_keys=False, default_flow_style=None).rstrip(), "```", ""]
    return "\n".join(out)


def schema() -> dict[str, Any]:
    from pt2flow.flows.config.jsonschema import config_json_schema

    return config_json_schema()


# --- the CLI reference --------------------------------------------------------------------------


def cli_reference() -> str:
    import click

    from pt2flow.flows.cli.main import COMMANDS, cli

    out = [
        "# CLI reference",
        "",
        "Every `pt2flow` command's own `--help`, generated when this site is built.",
        "[Commands](../using.md) shows them at work.",
        "",
        "## pt2flow",
        "",
        "```text",
        cli.get_help(click.Context(cli, info_name="pt2flow")).rstrip(),
        "```",
        "",
    ]
    root = click.Context(cli, info_name="pt2flow")
    for name in COMMANDS:
        command = cli.get_command(root, name)  # type: ignore[attr-defined]
        if command is None:
            continue
        context = click.Context(command, info_name=name, parent=root)
        out += [f"## pt2flow {name}", "", "```text", command.get_help(context).rstrip(), "```", ""]
    return "\n".join(out)


# --- mkdocs -------------------------------------------------------------------------------------


def on_startup(command: str, dirty: bool) -> None:
    """The package as mkdocstrings reads it: .cache/docs-src/pt2flow/ with links to this checkout's
    packages (mkdocs.yml `paths`), since the checkout's own folder is not named pt2flow. At start-up,
    before any plugin's configuration: mkdocstrings resolves its `paths` then."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    package = root / ".cache" / "docs-src" / "pt2flow"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("flows", "stages", "storage"):
        link = package / name
        if not link.is_symlink() or link.resolve() != root / name:
            link.unlink(missing_ok=True)
            link.symlink_to(root / name, target_is_directory=True)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, CONFIG_PAGE, content=config_reference(schema())))
    files.append(File.generated(config, CLI_PAGE, content=cli_reference()))
    return files
