"""`pt2flow upgrade-check`: the fleet under a candidate environment, against a baseline run
(flows/api/upgrade.py). Exit 1 when any model regresses, 0 otherwise, 2 on bad usage."""

from __future__ import annotations

import json
import os
from typing import Any

import click

from pt2flow.flows.cli.errors import EXIT_FAILED, EXIT_OK
from pt2flow.flows.cli.launch import CONFIG_HELP, comma_list, stage_list
from pt2flow.flows.cli.support import Args, check_page_path, command, json_option, write_page


@command(
    "upgrade-check",
    help="Run CONFIG's fleet with its workers under a candidate Python environment (--python: a virtualenv with pt2flow and "
    "another torch / transformers / library set) into the same store, check the baseline run's artifacts under it, and say "
    "per model what the upgrade changes: unchanged, program changed, newly failing (with a repro made in the candidate), "
    "fixed, numerics, compile time or latency beyond tolerance, artifacts that no longer load. The versions that differ come "
    "first. Exit 1 when any model regresses, 0 otherwise, 2 on bad config or usage.",
    arguments=CONFIG_HELP,
)
@click.argument("config", metavar="CONFIG")
@click.option(
    "--python",
    "python",
    metavar="PATH",
    help="the candidate interpreter (or virtualenv folder); pt2flow must be installed there",
)
@click.option(
    "--with",
    "requirements",
    metavar="REQ",
    multiple=True,
    help="instead of --python: the candidate is this environment with REQ pip-installed over it (repeatable, e.g. "
    "--with transformers==5.24.0; without dependencies: name each that must change); made once, cached in ~/.cache/pt2flow",
)
@click.option(
    "--baseline",
    metavar="RUN",
    help="the run to compare with (ID or prefix; default: the newest run that covered the config's models)",
)
@click.option(
    "--baseline-python",
    metavar="PATH",
    help="the environment the baseline run ran in (default: this one); --attribute builds on it",
)
@click.option(
    "--attribute",
    is_flag=True,
    help="when several distributions differ, run the regressed models in the baseline with one candidate "
    "distribution at a time and say which change breaks each",
)
@click.option(
    "--only",
    metavar="NAME[,NAME...]",
    multiple=True,
    callback=comma_list,
    help="check only these models (as run's --only)",
)
@click.option("--stages", metavar="a,b,...", help="run these stages instead of the config's (as run's --stages)")
@click.option("--workers", type=int, default=None, metavar="N", help="models in parallel (default: as run)")
@click.option(
    "--repro-dir",
    metavar="DIR",
    help="where the candidate writes repro scripts (default: ./pt2flow-upgrade-<candidate run>)",
)
@click.option("--store", metavar="URL", help="store URL; overrides the config's store")
@json_option("print the report as one JSON document (logs go to stderr)")
@click.option("--html", metavar="FILE", help="also write the report as a self-contained HTML page")
def upgrade_check_command(args: Args) -> int:
    from pt2flow.flows.report.upgrade import render_html, render_text

    if args.html:
        check_page_path(args.html)
    if args.json:  # the runs' logs and progress go to stderr; stdout holds the report alone
        from pt2flow.flows.cli.run import stdout_to_stderr

        with stdout_to_stderr() as real_stdout:
            report = _check(args)
            real_stdout.write(json.dumps(report.model_dump(mode="json"), indent=1, default=str) + "\n")  # type: ignore[attr-defined]
            real_stdout.flush()
    else:
        report = _check(args)
        print(render_text(report))
    if args.html:
        write_page(args.html, lambda: render_html(report))
    return EXIT_FAILED if report.regressed else EXIT_OK


def _check(args: Args) -> Any:
    from pt2flow.flows.api.upgrade import upgrade_check

    return upgrade_check(
        os.path.abspath(args.config),
        python=args.python,
        requirements=list(args.requirements),
        baseline=args.baseline,
        baseline_python=args.baseline_python,
        only=list(args.only),
        stages=stage_list(args),
        store=args.store,
        attribute=args.attribute,
        workers=args.workers,
        repro_dir=args.repro_dir,
    )
