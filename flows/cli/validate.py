"""`pt2flow validate`: check a config without running anything (no torch, no Prefect)."""

from __future__ import annotations

import json

import click

from pt2flow.flows.cli.errors import EXIT_OK
from pt2flow.flows.cli.support import Args, command, json_option


@command("validate", help="Check CONFIG: every problem is reported with its file, line and key path. Exit 0 if valid, 2 if not.")
@click.argument("config", metavar="CONFIG")
@json_option()
def validate_command(args: Args) -> int:
    from pt2flow.flows.config import load_config

    pipeline = load_config(args.config)  # ConfigError: exit 2, every problem printed
    if args.json:
        print(json.dumps({"config": args.config, "valid": True, "models": [m.name for m in pipeline.models], "stages": list(pipeline.stages)}))
    else:
        print(f"{args.config}: ok — {len(pipeline.models)} model(s), stages {', '.join(pipeline.stages)}")
    return EXIT_OK
