"""The fleet flow: every model of a config through the pipeline; one model's failure never stops the rest.

Runners: `local` (and `process`, its older name) runs the model flows from N threads of this
process, each model's stage work in one of N supervised worker processes (flows/engine/orchestrator/pool.py);
`dask` runs the model flows on prefect-dask's DaskTaskRunner (a LocalCluster of processes or an
existing cluster's address), each Dask worker with a supervised worker process of its own.
torch.export is not thread-safe: torch only ever runs in the worker processes.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any
from collections.abc import Sequence

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed

from pt2flow.flows.engine.common import stores
from pt2flow.flows.engine.services import prefect_runtime  # noqa: F401  (Prefect's quiet, offline defaults)
from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.config.models import Pipeline
from pt2flow.flows.config.limits import DEFAULT_NO_WORKER_TIMEOUT_S
from pt2flow.flows.engine.common.context import RunContext
from pt2flow.flows.engine.common.documents import ModelResult, RunDocument, RunSummary
from pt2flow.stages.vocabulary import ErrorClass
from pt2flow.storage import StorageError
from pt2flow.flows.engine.orchestrator.fleet_plan import (
    RunParameters,
    fleet_context,
    loaded_for,
    plan_fleet,
    resolve_workers,
    run_document,
    settle_from_index,
)
from pt2flow.flows.engine.orchestrator.model_flow import STAGE_TASKS
from pt2flow.flows.engine.orchestrator.planner import Plan
from pt2flow.flows.engine.orchestrator.runner import run_logger, run_model

WATCH_SECONDS = 1.0  # how often the orchestrator looks at a Dask cluster's workers and the models' clocks


def _model_result(state: Any, model: ResolvedModel) -> ModelResult:
    try:
        value = state.result(raise_on_failure=False)
    except Exception as exc:  # the flow crashed before it could report
        value = exc
    if isinstance(value, ModelResult):
        return value
    return ModelResult.crashed(model.name, f"the model flow ended without a result: {value!r}")


@task(name="export-model", task_run_name="{model.name}", cache_policy=NO_CACHE, persist_result=False)
def model_task(model: ResolvedModel, ctx: RunContext, plan: Plan) -> Any:
    """One model, from a thread of the orchestrator (local) or on a Dask worker: its stage tasks
    run nested under this task (named after the model), their work on that process's worker
    pool. The task fails when the model does, naming the stage and the class. (A subflow per
    model costs 0.3-1 s more per model in flow-run bookkeeping: measured, see bench/.)"""
    from pt2flow.flows.engine.services.dask_cluster import announce_start
    from pt2flow.flows.engine.orchestrator.pool import shared_pool

    announce_start(ctx.run_id, model.name)  # on a Dask worker: the orchestrator's clock of this model starts
    pool = shared_pool(python=ctx.python)
    try:
        result = run_model(model, ctx, plan, pool, tasks=STAGE_TASKS)
    finally:
        pool.leave_turn(model.name)  # however the model ended, the next one's turn at a worker comes
    if result.status == "failed":
        return Failed(message=f"{model.name}: {result.error_class} at {result.failed_stage}", data=result)
    return Completed(data=result)


def _task_runner(runner: str, workers: int, dask_address: str | None) -> Any:
    if runner in ("local", "process"):
        from prefect.task_runners import ThreadPoolTaskRunner

        # threads only wait on worker processes; one more than the workers, so that the next
        # model's Prefect task and its stage tasks up to its first stage with work are under way
        # while the models before it finish (Lease: its clock starts once it has a worker)
        return ThreadPoolTaskRunner(max_workers=workers + 1)
    if runner == "dask":
        from prefect_dask import DaskTaskRunner

        if dask_address:
            return DaskTaskRunner(address=dask_address)
        return DaskTaskRunner(
            cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True, "dashboard_address": None}
        )
    raise ValueError(f"unknown runner {runner!r}")


def _run_models(
    models: Sequence[ResolvedModel],
    plans: dict[str, Plan],
    ctx: RunContext,
    runner: str,
    workers: int,
    dask_address: str | None,
    no_worker_timeout_s: float = DEFAULT_NO_WORKER_TIMEOUT_S,
) -> list[ModelResult]:
    results: dict[str, ModelResult] = {}
    if runner != "dask":
        from pt2flow.flows.engine.orchestrator.pool import start_pool

        start_pool(workers, ctx.python).set_order([m.name for m in models])  # the config's order
    with _task_runner(runner, workers, dask_address) as task_runner:
        try:
            futures = {
                m.name: (m, task_runner.submit(model_task, parameters={"model": m, "ctx": ctx, "plan": plans[m.name]}))
                for m in models
            }
            if runner == "dask":
                _wait_on_cluster(futures, results, task_runner.client, ctx, no_worker_timeout_s)
            for model, future in futures.values():
                if model.name not in results:
                    results[model.name] = _settled(model, future)
        except BaseException:
            # Ctrl-C, SIGTERM (Prefect's TerminationSignal), a bug: the task runner's exit joins the
            # model threads, so first make the ones waiting on a worker (a hung model) stop now
            from pt2flow.flows.engine.orchestrator.pool import interrupt_pool

            interrupt_pool()
            raise
    return [results[m.name] for m in models]


def _settled(model: ResolvedModel, future: Any) -> ModelResult:
    """The model's result once its future is done (waiting for it if need be)."""
    try:
        future.wait()
        return _model_result(future.state, model)
    except Exception as exc:  # the runner itself broke (a Dask worker lost, a cluster gone)
        return ModelResult.crashed(model.name, f"worker failed: {type(exc).__name__}: {exc}")


def _wait_on_cluster(
    futures: dict[str, tuple[ResolvedModel, Any]],
    results: dict[str, ModelResult],
    client: Any,
    ctx: RunContext,
    no_worker_timeout_s: float,
) -> None:
    """Wait for the models given to a Dask cluster, enforcing here what their Dask workers
    enforce while they exist: each model's time limit, and a cluster with no worker for
    `no_worker_timeout_s` fails every model not done (flows/engine/services/dask_cluster.py)."""
    from pt2flow.flows.engine.services.dask_cluster import ClusterWatch

    watch = ClusterWatch(
        client, ctx.run_id, {name: m.limits.timeout_s for name, (m, _) in futures.items()}, no_worker_timeout_s
    )
    try:
        with client.as_current():  # distributed.wait finds its client as the current one
            _watch(futures, results, watch)
    finally:
        watch.close()


def _watch(futures: dict[str, tuple[ResolvedModel, Any]], results: dict[str, ModelResult], watch: Any) -> None:
    import distributed

    pending = dict(futures)
    while pending:
        try:
            distributed.wait(
                [f.wrapped_future for _, f in pending.values()], timeout=WATCH_SECONDS, return_when="FIRST_COMPLETED"
            )
        except distributed.TimeoutError:  # none done in this while: look at the clocks
            pass
        for name, (model, future) in list(pending.items()):
            if future.wrapped_future.done():
                results[name] = _settled(model, future)
                del pending[name]
        for name, gave_up in watch.check(list(pending)).items():
            model, future = pending.pop(name)
            future.wrapped_future.cancel()
            results[name] = ModelResult(
                name=name, status="failed", error_class=gave_up.error_class, error=gave_up.message
            )
            run_logger().warning("%s: %s", name, gave_up.message)


def _fleet_rows(document: RunDocument) -> list[dict[str, Any]]:
    rows = []
    for m in document.models:
        stages = m.stages.values()
        rows.append(
            {
                "model": m.name,
                "status": m.status,
                "failed_stage": m.failed_stage or "",
                "error_class": m.error_class or "",
                "stages_run": sum(1 for s in stages if not s.cached),
                "stages_cached": sum(1 for s in stages if s.cached),
                "seconds": round(sum(float(s.seconds or 0) for s in stages), 2),
                "max_abs_err": m.validation.max_abs_err if m.validation else None,
                "compiled": m.artifacts.compiled or "",
            }
        )
    return rows


def fleet_markdown(
    document: RunDocument, comparison: str | None = None, groups: list[dict[str, Any]] | None = None
) -> str:
    """The fleet run as markdown: totals, the failures grouped by root cause (new, persisting,
    gone against the previous run), failed models with their class and stage, then the drift
    against the previous run when there is one."""
    summary = document.summary
    rows = _fleet_rows(document)
    cached = sum(1 for r in rows if r["status"] == "ok" and r["stages_run"] == 0)
    lines = [
        f"# pt2flow run `{document.run_id}`",
        "",
        f"**{summary.ok} ok**, "
        + (f"**{summary.partial} partial**, " if summary.partial else "")
        + f"**{summary.failed} failed**, {cached} fully cached, {summary.seconds:.1f} s; store `{document.store}`",
        "",
    ]
    if groups:
        from pt2flow.flows.report.failure_views import groups_markdown

        lines += groups_markdown(
            groups, title=f"## Failure groups ({sum(1 for g in groups if g['status'] != 'gone')} by root cause)"
        )
    failed = [m for m in document.models if m.status == "failed"]
    if failed:
        lines += ["## Failed models", "", "| model | stage | error class | error |", "|---|---|---|---|"]
        for m in failed:
            error = (m.error or "").replace("|", "\\|").replace("\n", " ")[:200]
            lines.append(f"| {m.name} | {m.failed_stage or '-'} | {m.error_class or '-'} | {error} |")
        lines.append("")
    if comparison:
        lines += [comparison, ""]
    return "\n".join(lines)


def _drift_markdown(store_obj: Any, run_id: str) -> str | None:
    """This run against the store's previous one (regressions flagged), or None for a first run."""
    from pt2flow.flows.report import compare_with_previous
    from pt2flow.flows.report import to_markdown

    try:
        comparison = compare_with_previous(store_obj.index, run_id)
    except Exception as exc:  # a report problem must not fail a finished fleet
        run_logger().warning("could not compare with the previous run: %s", exc)
        return None
    if comparison is None:
        return None
    for regression in comparison.get("regressions", []):
        run_logger().warning("regression: %s: %s", regression["model"], regression["message"])
    return to_markdown(comparison)


def _failure_groups(store_obj: Any, run_id: str) -> list[dict[str, Any]] | None:
    """This run's failures grouped by root cause against the previous run, or None (a grouping
    problem must not fail a finished fleet)."""
    from pt2flow.flows.report.failures import run_groups

    try:
        return run_groups(store_obj.index, run_id, store_url=store_obj.url) or None
    except Exception as exc:  # noqa: BLE001
        run_logger().warning("could not group the run's failures: %s: %s", type(exc).__name__, exc)
        return None


def _publish_artifacts(document: RunDocument, comparison: str | None = None) -> None:
    """A table and a markdown summary of the fleet in the Prefect UI (its failure groups the
    document's). Best effort: the run's result does not depend on the UI."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    try:
        create_table_artifact(
            table=_fleet_rows(document),
            key="pt2flow-fleet-models",
            description=f"pt2flow run {document.run_id}: one row per model",
        )
        create_markdown_artifact(
            markdown=fleet_markdown(document, comparison, document.failure_groups),
            key="pt2flow-fleet-summary",
            description=f"pt2flow run {document.run_id}",
        )
    except Exception as exc:  # the API being unreachable must not fail an otherwise finished fleet
        run_logger().warning("could not publish the fleet artifacts: %s", exc)


def run_fleet(
    config: Pipeline,
    ctx: RunContext,
    runner: str = "local",
    workers: int | None = None,
    dask_address: str | None = None,
    no_worker_timeout_s: float | None = None,
) -> RunDocument:
    """The run document of docs/architecture.md §4. Models the planner settles from the index need
    no worker and no Prefect task run; the rest go to the runner's supervised worker processes."""
    started = time.perf_counter()
    models = list(config.models)
    plans = plan_fleet(models, ctx)
    results = settle_from_index(models, plans, ctx)
    to_run = [m for m in models if m.name not in results]
    used = 0
    if to_run:
        used = resolve_workers(workers, len(to_run))
        run_logger().info("%d model(s) to build on %d worker process(es) (%s runner)", len(to_run), used, runner)
        no_worker = no_worker_timeout_s if no_worker_timeout_s is not None else config.dask.no_worker_timeout_s
        for m, r in zip(to_run, _run_models(to_run, plans, ctx, runner, used, dask_address, no_worker)):
            results[m.name] = r
    document = run_document(ctx, [results[m.name] for m in models], started, used)
    store_obj = stores.open_store(ctx.store_url)
    groups = _failure_groups(store_obj, ctx.run_id)  # once: the document's and the UI's
    if groups:  # an optional field: given (even as None) it is dumped
        document.failure_groups = groups
    _publish_artifacts(document, _drift_markdown(store_obj, ctx.run_id))
    return document


def retain(store_obj: Any, retention: Any, run_id: str) -> dict[str, Any] | None:
    """The config's retention applied after a served run (storage/retention.py), said in the
    run's log. Best effort: a storage problem is logged, never fails the finished fleet."""
    from pt2flow.storage.retention import RetentionRule, apply_retention

    rule = RetentionRule(keep_runs=retention.keep_runs, keep_days=retention.keep_days)
    try:
        result = apply_retention(
            store_obj, rule, dry_run=False, grace_seconds=retention.grace_seconds, exclude_runs={run_id}
        )
    except Exception as exc:  # noqa: BLE001 - the fleet is done; the next run tries again
        run_logger().warning("retention (%s) failed: %s: %s", rule.describe(), type(exc).__name__, exc)
        return None
    if result["deferred"] and not result["records_dropped"]:
        run_logger().info(
            "retention (%s) deferred: run(s) in progress: %s", rule.describe(), ", ".join(result["deferred"])
        )
    else:
        run_logger().info(
            "retention (%s): dropped %d record(s) of %d run(s), freed %d blob(s) (%d bytes)%s",
            rule.describe(),
            result["records_dropped"],
            len(result["dropped_runs"]),
            len(result["deleted"]),
            result["deleted_bytes"],
            f"; {len(result['kept_within_grace'])} blob(s) within the grace period stay"
            if result["kept_within_grace"]
            else "",
        )
    return result


def unwritable_store(config: Pipeline, ctx: RunContext, message: str) -> RunDocument:
    """The run document of a run whose store cannot be written (its lease could not be put):
    every model failed with class storage and the store's own words."""
    error = f"the store cannot be written, so nothing ran: {message}"
    run_logger().error("%s", error)
    results = [
        ModelResult(name=m.name, status="failed", error_class=ErrorClass.STORAGE, error=error) for m in config.models
    ]
    return RunDocument(
        run_id=ctx.run_id,
        store=ctx.store_url,
        summary=RunSummary(ok=0, failed=len(results), seconds=0.0),
        models=results,
        workers=0,
    )


@flow(name="pt2flow-fleet", validate_parameters=False, persist_result=False)
def fleet_flow(
    config_path: str,
    store: str | None = None,
    only: list[str] | None = None,
    stages: list[str] | None = None,
    force: bool = False,
    runner: str = "local",
    workers: int | None = None,
    dask_address: str | None = None,
    run_id: str | None = None,
    retry_failed: bool = False,
    apply_retention: bool = False,
    no_worker_timeout_s: float | None = None,
    python: str | None = None,
    verify_sources: bool = False,
) -> Any:
    """Export every model of the config (or `only` those); returns the run document of
    docs/architecture.md §4 as its JSON dict. The run holds its lease on the store throughout
    (storage/leases.py). apply_retention (`pt2flow serve`): then apply the config's `retention:`.
    python: the interpreter the workers run in (flows/engine/environment/interpreter.py), else the config's.
    verify_sources: build every model again instead of trusting its recorded manifest (a model
    whose eager digest or files changed gets a new source key, so it is re-exported)."""
    from pt2flow.storage.leases import RunLease

    parameters = RunParameters(
        config_path=config_path,
        store=store,
        only=tuple(only) if only is not None else None,
        stages=tuple(stages) if stages is not None else None,
        force=force,
        runner=runner,
        workers=workers,
        dask_address=dask_address,
        no_worker_timeout_s=no_worker_timeout_s,
        run_id=run_id,
        retry_failed=retry_failed,
        apply_retention=apply_retention,
        python=python,
        verify_sources=verify_sources,
    )
    loaded = loaded_for(run_id) if run_id else None
    config, ctx = fleet_context(parameters, loaded)
    try:
        with contextlib.ExitStack() as lease:
            try:
                lease.enter_context(RunLease(stores.open_store(ctx.store_url), ctx.run_id))
            except StorageError as exc:  # the store cannot be written: nothing can run, every model says why
                document = unwritable_store(config, ctx, str(exc))
            else:
                document = run_fleet(config, ctx, runner, workers, dask_address, no_worker_timeout_s)
    finally:
        from pt2flow.flows.engine.orchestrator.pool import stop_pool

        stop_pool()  # a served deployment runs many fleets in one process: free the workers
    if apply_retention and config.retention is not None:
        retain(stores.open_store(ctx.store_url), config.retention, ctx.run_id)
    ok, total = document.summary.ok, len(document.models)
    if ok != total:
        noun = "model" if total == 1 else "models"
        return Failed(message=f"{total - ok} of {total} {noun} failed", data=document.model_dump(mode="json"))
    return Completed(data=document.model_dump(mode="json"))
