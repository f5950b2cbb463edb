"""The upgrade check as a Prefect flow, for `pt2flow serve CONFIG --upgrade-check CANDIDATE`: a
nightly (or any schedule) check of the fleet against a candidate environment that a CI job keeps
fresh. Each run writes its report (JSON and HTML) into the report folder, publishes the text
report as a markdown artifact, and ends Failed when a model regresses (so Prefect's automations
and notifications fire), Completed otherwise."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Completed, Failed, State


@flow(name="pt2flow-upgrade-check", validate_parameters=False, persist_result=False)
def upgrade_check_flow(
    config_path: str,
    python: str,
    report_dir: str,
    store: str | None = None,
    baseline_python: str | None = None,
    attribute: bool = False,
    workers: int | None = None,
) -> State[Any]:
    """`pt2flow upgrade-check` of the config against the candidate `python`, the baseline being
    the newest run that covered the fleet; the report lands in `report_dir`."""
    from prefect.artifacts import create_markdown_artifact

    from pt2flow.flows.api.upgrade import upgrade_check
    from pt2flow.flows.report.upgrade import render_html, render_text

    report = upgrade_check(
        config_path,
        python=python,
        baseline_python=baseline_python,
        store=store,
        attribute=attribute,
        workers=workers,
        repro_dir=os.path.join(report_dir, "repro"),
    )
    name = f"upgrade-check-{report.candidate.run_id}"
    folder = Path(report_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(report.model_dump(mode="json"), indent=1, default=str) + "\n")
    (folder / f"{name}.html").write_text(render_html(report))
    text = render_text(report)
    logger = get_run_logger()
    logger.info(
        "upgrade check: %s; report %s", "REGRESSED" if report.regressed else "no regression", folder / f"{name}.json"
    )
    try:
        create_markdown_artifact(
            markdown=f"# pt2flow upgrade check `{report.candidate.run_id}`\n\n```\n{text}\n```\n",
            key="pt2flow-upgrade-check",
            description=f"candidate {report.candidate.python}",
        )
    except Exception as exc:  # the UI being unreachable must not fail a finished check
        logger.warning("could not publish the upgrade report: %s", exc)
    data = report.model_dump(mode="json")
    if report.regressed:
        regressed = [m.model for m in report.models if m.verdict in ("newly_failing", "regressed") or m.regressions]
        return Failed(message=f"the candidate regresses {len(regressed)} model(s): {', '.join(regressed)}", data=data)
    return Completed(data=data)
