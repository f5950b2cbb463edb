"""`pt2flow report`: the command-line command. The report package is imported when it runs."""

from __future__ import annotations

import click

from pt2flow.flows.cli.errors import EXIT_FAILED, EXIT_OK, CommandUsageError
from pt2flow.flows.cli.support import Args, check_page_path, command, json_option, open_store, present, store_options


@command(
    "report",
    help="Compare each model, by name, between two runs: status, op histogram after decompose, node count, "
    "signature, range constraints, archive and package sizes, compile time, validation error, latency, torch version. "
    "Flags regressions (stopped exporting, validation error x10, compile time or size +25 %).",
    arguments={
        "[RUN]...": "RUN_A RUN_B (run IDs, or unique prefixes or suffixes of them); default: the newest run against the newest earlier run that "
        "covered all of its models, on its models (after `run --only m`: m's drift); the report says which runs and why"
    },
)
@click.argument("runs", metavar="[RUN]...", nargs=-1)
@store_options
@json_option("print the comparison as one JSON document")
@click.option("--html", metavar="FILE", help="also write a self-contained HTML page with plots")
@click.option("--fail-on-regression", is_flag=True, help="exit 1 when a regression is flagged")
def report_command(args: Args) -> int:
    from pt2flow.flows.report.compare import compare_default, compare_runs
    from pt2flow.flows.report.runs import resolve_run
    from pt2flow.flows.report.terminal import render_terminal

    if len(args.runs) not in (0, 2):
        raise CommandUsageError(
            "give two runs (RUN_A RUN_B), or none for the newest run and the earlier one that covered its models"
        )
    if args.html:
        check_page_path(args.html)  # before the work, not after it
    store = open_store(args)
    if args.runs:
        run_a, run_b = (resolve_run(store.index, r) for r in args.runs)
        comparison = compare_runs(store.index, run_a, run_b)
    else:
        comparison = compare_default(store.index)
    from pt2flow.flows.report.html import to_html

    present(args, comparison, to_html, render_terminal)
    return EXIT_FAILED if args.fail_on_regression and comparison["regressions"] else EXIT_OK


@command(
    "failures",
    help="A run's failures grouped by root cause (class, stage, the op/guard/symbol the error names, the first frame in the "
    "model's own code), largest first: the models in each group, one message, a repro command, and whether the group is "
    "new, persisting or gone against another run.",
    arguments={"[RUN]": "the run (ID, or a unique prefix or suffix of one); default: the newest"},
)
@click.argument("run", metavar="[RUN]", required=False)
@click.option(
    "--against",
    metavar="RUN",
    help="the run to compare with; default: the run `report` pairs RUN with (the newest earlier run that covered its models)",
)
@store_options
@json_option("print the groups as one JSON document")
@click.option("--html", metavar="FILE", help="also write a self-contained HTML page")
def failures_command(args: Args) -> int:
    from pt2flow.flows.report.failure_views import failures_html, render_failures
    from pt2flow.flows.report.failures import failures_of

    if args.html:
        check_page_path(args.html)
    present(args, failures_of(open_store(args), args.run, args.against), failures_html, render_failures)
    return EXIT_OK
