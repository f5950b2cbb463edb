"""Around the artifacts: `get` copies a verified artifact out of the store, `repro` writes a
torch-only script that reproduces a failed stage, `schema` prints the config's JSON Schema
(docs/architecture.md §4). `get` and `schema` import neither torch nor Prefect; `repro` imports
torch (it builds the model's example inputs), never Prefect."""

from __future__ import annotations

import sys
from typing import Any

import click

from pt2flow.flows.cli.errors import EXIT_FAILED, EXIT_OK, CommandUsageError
from pt2flow.flows.cli.support import (
    Args,
    check_page_path,
    command,
    dump,
    format_size,
    json_option,
    open_store,
    present,
    store_options,
)

from pt2flow.flows import pipeline

ARTIFACT_KINDS = tuple(pipeline.artifact_kinds())
_KIND_HELP = ", ".join(
    f"{kind} ({pipeline.get(stage).description or stage})" for kind, stage in pipeline.artifact_kinds().items()
)


@command(
    "get",
    help="Copy a verified artifact out of the store to PATH: the one ID names, or with --model the newest ok one of that model "
    "(in --run RUN). Only artifacts an ok index record vouches for, re-hashed (and zip-checked) first; exit 1 for a corrupt or missing blob.",
    arguments={"ID": "artifact sha256 or a unique prefix of 8+ characters (or give --model)"},
)
@click.argument("id", metavar="[ID]", required=False)
@click.option("--model", metavar="NAME", help="the newest ok artifact of this model")
@click.option("--run", metavar="RUN", help="with --model: from this run (ID, or a unique prefix or suffix of one)")
@click.option(
    "--artifact",
    type=click.Choice(ARTIFACT_KINDS),
    help=f"which artifact of the model (default serialized): {_KIND_HELP}",
)
@click.option(
    "--component",
    metavar="NAME",
    help="with --model, of a generative model (generate:): that component's artifact (prefill, decode)",
)
@click.option(
    "-o",
    "--output",
    "output",
    metavar="PATH",
    required=True,
    help="file to write (replaced atomically); for a generative model without --component, a folder: every component and manifest.json",
)
@store_options
@json_option("print the artifact's record (with `path`) as JSON")
def get_command(args: Args) -> int:
    from pt2flow.flows.api.store import Store

    if bool(args.id) == bool(args.model):
        raise CommandUsageError("give an artifact ID or --model NAME (one of them)")
    if args.run and not args.model:
        raise CommandUsageError("--run goes with --model")
    if args.component and not args.model:
        raise CommandUsageError("--component goes with --model")
    result = Store.of(open_store(args)).get(
        args.output, args.id, model=args.model, run=args.run, artifact=args.artifact, component=args.component
    )
    if args.json:
        dump(result)
    elif "components" in result:  # a generative model: every component, with a manifest
        for name, part in result["components"].items():
            print(
                f"{result['artifact']} artifact of {result['model']}/{name} ({part['sha256']}, {format_size(part['size'])}, run {part['run_id']}) -> {result['path']}/{part['file']}"
            )
        print(f"manifest -> {result['path']}/manifest.json")
        for warning in result.get("warnings", ()):
            print(f"warning: {warning}", file=sys.stderr)
    else:
        print(
            f"{result['artifact']} artifact of {result['model']} ({result['sha256']}, {format_size(result['size'])}, run {result['run_id']}) -> {result['path']}"
        )
        if calibration := (result.get("details") or {}).get("calibration"):  # an int8 artifact's
            print(f"calibrated on {calibration_text(calibration)}")
    return EXIT_OK


def calibration_text(calibration: dict[str, Any]) -> str:
    """What an int8 artifact's record says it was calibrated on, in words."""
    if "data" in calibration:
        return f"the first {calibration['batches']} batches of data.factory {calibration['data']}"
    if "data_file" in calibration:
        return f"the first {calibration['batches']} batches of data.file {calibration['data_file']}"
    first, last = calibration.get("seeds") or ["?", "?"]
    return f"{calibration['batches']} batches drawn from the model's inputs spec (seeds {first}..{last})"


@command(
    "repro",
    help="Write DIR/repro.py, a script that needs torch alone (no pt2flow) and raises the exception a failed stage raised: "
    "the model's factory call, weights, example inputs, dynamic shapes and the strategy that failed, from the store. "
    "MODEL: its newest failure; ID: the failure report's artifact ID.",
    arguments={"TARGET": "a model name, or the artifact ID (8+ hex characters) of a failed stage's report"},
)
@click.argument("target", metavar="TARGET")
@click.option(
    "-o", "--output", "output", metavar="DIR", required=True, help="folder to write repro.py and its data files into"
)
@store_options
@json_option("print what was written as JSON")
def repro_command(args: Args) -> int:
    from pt2flow.flows.api import Store, repro
    from pt2flow.flows.engine.maintenance.repro import CALL_LIBRARY, OWN_CHECK_EXIT

    written = repro(Store.of(open_store(args)), args.target, args.output)
    if args.json:
        dump(written)
    else:
        print(f"{written['model']}: {written['stage']} failed with {written['error_class']} (run {written['run_id']})")
        if written.get("check"):  # pt2flow refused the program itself: the library was not called
            library = written["check"].get("library") or "the library"
            print(
                f"that failure is pt2flow's own check, made before {library} was called ({library} was not asked): "
                f"the script says so and exits {OWN_CHECK_EXIT}; with {CALL_LIBRARY} it makes {library}'s own call"
            )
        print(
            f"wrote {', '.join(written['files'])} to {written['dir']}; reproduce with: python {written['dir']}/repro.py"
        )
    return EXIT_OK


@command(
    "schema",
    help="Print the JSON Schema of a version-1 config (the shipped configs reference docs/config.schema.json, the same schema).",
)
def schema_command(args: Args) -> int:
    from pt2flow.flows.config.jsonschema import config_json_schema_text

    sys.stdout.write(config_json_schema_text())
    return EXIT_OK


@command(
    "check-compat",
    help="Load every archive and AOTInductor package of RUN (default: the fleet: the newest run, or, when it covered fewer models than an "
    "earlier run that covered all of its, that run's models each from the newest run that built it) with the torch installed now, run them on the "
    "inputs validate stored and compare with the eager outputs recorded then (the run's atol/rtol). Exit 1 if any artifact no longer "
    "loads (class incompatible), raises (runtime) or computes differently (numeric_mismatch).",
    arguments={
        "RUN": "run ID, or a unique prefix or suffix of one (default: the fleet, as above; the output says which runs and why)"
    },
)
@click.argument("run", metavar="[RUN]", required=False)
@store_options
@json_option("one JSON document on stdout")
@click.option("--html", "html", metavar="FILE", help="also write a self-contained HTML page")
def check_compat_command(args: Args) -> int:
    from pt2flow.flows.api import Store, check_compat
    from pt2flow.flows.report.compat import compat_html, render_compat

    if args.html:
        check_page_path(args.html)  # before the work, not after it
    doc = check_compat(Store.of(open_store(args)), args.run)
    present(args, doc, compat_html, render_compat)
    return EXIT_FAILED if doc["summary"]["failed"] else EXIT_OK
