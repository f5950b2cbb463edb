"""`pt2flow validate`: check a config without running anything: its own checks, then its files
and, in a worker process, its code (flows/engine/orchestrator/preflight.py). No torch here, no Prefect."""

from __future__ import annotations

import json
import sys

import click

from pt2flow.flows.cli.errors import EXIT_OK
from pt2flow.flows.cli.support import Args, command, json_option


@command(
    "validate",
    help="Check CONFIG without running a stage: the schema and its semantics, that weights and inputs files exist, and (in a worker "
    "process, isolated as a run's stages are) that the factory modules import and the input names match the model's forward(). "
    "Every problem is reported with its file, line and key path. Exit 0 if valid, 2 if not.",
    arguments={"CONFIG": "pipeline config (YAML, schema version 1)"},
)
@click.argument("config", metavar="CONFIG")
@click.option(
    "--no-import",
    "no_import",
    is_flag=True,
    help="skip the checks that import the models' code (no worker process is started)",
)
@json_option()
def validate_command(args: Args) -> int:
    from pt2flow.flows.api import validate

    doc = validate(args.config, imports=not args.no_import)  # ConfigError: exit 2, every problem printed
    if args.json:
        print(json.dumps(doc))
        return EXIT_OK
    for note in doc["notes"]:
        where = f"{args.config}:{note['line']}" if note["line"] else args.config
        print(f"  {where}: {note['path']}: {note['message']}", file=sys.stderr)
    checked = (
        "files checked, modules not imported (--no-import)"
        if args.no_import
        else f"files checked, {doc['imported']} model(s) imported in a worker"
    )
    print(f"{args.config}: ok — {len(doc['models'])} model(s), stages {', '.join(doc['stages'])}; {checked}")
    return EXIT_OK
