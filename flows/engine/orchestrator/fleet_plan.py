"""A fleet's plan and the parts of a run that need neither torch nor Prefect: the run context
from a config, every model's plan, the models the index settles (their records appended in one
index file), and the run document. `pt2flow run` settles a fleet with nothing to build here,
without starting Prefect (docs/architecture.md, "Caching").
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator, Sequence

from pt2flow.flows.engine.common import stores
from pt2flow.flows.config import ResolvedModel, apply_overrides, load_config, resolve_store_url
from pt2flow.flows.config.models import Pipeline
from pt2flow.flows.engine.common.context import RunContext, new_run_id
from pt2flow.flows.engine.common.documents import ModelResult, RunDocument, RunSummary
from pt2flow.flows.engine.orchestrator.planner import Plan, plan_model
from pt2flow.flows.engine.orchestrator.runner import run_model
from pt2flow.storage.records import IndexRecord

# Compact the index at the end of a run once it holds this many files.
AUTO_COMPACT_FILES = 256


class NeedsFlow(RuntimeError):
    """A fleet was to be settled from the index, but some model has work to do."""


@dataclass(frozen=True)
class RunParameters:
    """What one run is asked to do: the fleet flow's parameters (flows/fleet.py fleet_flow), built
    once by whoever starts the run (api/running.py) and passed down. JSON-ready by design: a
    Prefect flow run records its parameters, and a deployment (serve, prefect.yaml) gives them as
    JSON; the loaded config never travels here (its storage_options may hold credentials)."""

    config_path: str
    store: str | None = None
    only: tuple[str, ...] | None = None
    stages: tuple[str, ...] | None = None
    force: bool = False
    runner: str = "local"
    workers: int | None = None
    dask_address: str | None = None
    no_worker_timeout_s: float | None = None
    run_id: str | None = None
    retry_failed: bool = False
    apply_retention: bool = False
    python: str | None = None
    verify_sources: bool = False

    def flow_parameters(self) -> dict[str, Any]:
        """As fleet_flow's keyword arguments (lists where it takes lists)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["only"] = list(self.only) if self.only is not None else None
        values["stages"] = list(self.stages) if self.stages is not None else None
        return values


# The configs callers in this process loaded for a run (by run ID), so that the fleet flow does not
# read the file again. Not a flow parameter: Prefect records parameters, and storage_options may
# hold credentials. Kept here, not in flows/fleet.py: Prefect and Dask may pickle the flow and
# task functions by value, with the module globals they reference, and a lock does not pickle.
_LOADED: dict[str, Pipeline] = {}
_LOADED_LOCK = threading.Lock()


@contextlib.contextmanager
def loaded_config(run_id: str, config: Pipeline) -> Iterator[None]:
    """While inside, fleet_flow(run_id=run_id, ...) called in this process uses `config` (already
    loaded with the run's overrides) instead of reading config_path again."""
    with _LOADED_LOCK:
        _LOADED[run_id] = config
    try:
        yield
    finally:
        with _LOADED_LOCK:
            _LOADED.pop(run_id, None)


def loaded_for(run_id: str) -> Pipeline | None:
    """The config loaded for `run_id` in this process (loaded_config), else None."""
    with _LOADED_LOCK:
        return _LOADED.get(run_id)


def fleet_context(parameters: RunParameters, config: Pipeline | None = None) -> tuple[Pipeline, RunContext]:
    """The config with the run's overrides, and the run's context. `config`: the config its caller
    already loaded with those overrides (read once per run), else it is read from
    `parameters.config_path`. Makes the workers' interpreter (`python`, else the config's, else
    this one) the active one: keys are planned with its versions."""
    from pt2flow.flows.engine.environment import interpreter

    if config is None:
        config = apply_overrides(
            load_config(parameters.config_path),
            only=parameters.only or (),
            stages=list(parameters.stages) if parameters.stages is not None else None,
        )
    store_url = resolve_store_url(parameters.store or config.store)
    if not stores.storage_options(store_url) and config.storage_options:
        stores.set_storage_options(store_url, config.storage_options)
    chosen = interpreter.activate(parameters.python or config.python)
    return config, RunContext(
        run_id=parameters.run_id or new_run_id(),
        store_url=store_url,
        stages=tuple(config.stages),
        force=parameters.force,
        retry_failed=parameters.retry_failed,
        python=None if chosen.local else chosen.python,
        verify_sources=parameters.verify_sources,
    )


def plan_fleet(models: Sequence[ResolvedModel], ctx: RunContext, *, stop_at_work: bool = False) -> dict[str, Plan]:
    """Every model's plan (stop_at_work: raise NeedsFlow at the first model with work)."""
    plans = {}
    with stores.open_store(ctx.store_url).index.snapshot():  # one listing of the index for the whole plan
        for m in models:
            plans[m.name] = plan_model(m, ctx)
            if stop_at_work and not plans[m.name].fully_cached:
                raise NeedsFlow(f"model {m.name} has stages to build")
    return plans


def settle_from_index(
    models: Sequence[ResolvedModel], plans: dict[str, Plan], ctx: RunContext
) -> dict[str, ModelResult]:
    """Results of the models whose plan the index settles; their records in one index file."""
    records: list[IndexRecord] = []
    results = {m.name: run_model(m, ctx, plans[m.name], records=records) for m in models if plans[m.name].fully_cached}
    if records:
        stores.open_store(ctx.store_url).index.append(records)
    return results


def resolve_workers(workers: int | None, models_with_work: int) -> int:
    from pt2flow.flows.engine.orchestrator.pool import default_workers

    return max(1, workers) if workers else default_workers(max(1, models_with_work))


def run_document(ctx: RunContext, results: list[ModelResult], started: float, workers: int) -> RunDocument:
    """The run document (docs/architecture.md §4); compacts the index once it has many files."""
    from pt2flow.flows.engine.lineage.events import flush

    flush(ctx.run_id)  # the run's OpenLineage events sent, or dropped with one warning (bounded wait)
    store = stores.open_store(ctx.store_url)
    if len(store.index.files()) >= AUTO_COMPACT_FILES:
        store.index.compact()
    ok, partial = (sum(1 for r in results if r.status == status) for status in ("ok", "partial"))
    summary = RunSummary(
        ok=ok, failed=len(results) - ok - partial, seconds=round(time.perf_counter() - started, 3), partial=partial
    )
    return RunDocument(
        run_id=ctx.run_id, store=store.url, summary=summary, models=results, workers=workers, python=ctx.python
    )


def settle_fleet(config: Pipeline, ctx: RunContext) -> dict[str, Any]:
    """The run document (as its JSON dict) of a fleet the index settles entirely; NeedsFlow at
    the first model with work."""
    started = time.perf_counter()
    models = list(config.models)
    plans = plan_fleet(models, ctx, stop_at_work=True)
    results = settle_from_index(models, plans, ctx)
    return run_document(ctx, [results[m.name] for m in models], started, 0).model_dump(mode="json")
