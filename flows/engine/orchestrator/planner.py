"""The planner: a model's key chain and cache decisions, computed once, without torch.

`plan_model` walks the configured stages from the source, computing each key from the cached
outcomes before it (flows/pipeline: each Stage's key) and looking it up in the index, until the first
stage with no usable record. A plan whose every stage hits is settled without a worker and
without Prefect; otherwise the model flow starts from the plan and looks up only the keys that
depend on what it builds (docs/architecture.md, "Caching").
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, UTC
from typing import Any
from collections.abc import Mapping

from pt2flow.flows.engine.common import stores
from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.common.context import Outcome, RunContext
from pt2flow.flows import pipeline
from pt2flow.flows.engine.orchestrator.stage_keys import blocked, gather, stage_key
from pt2flow.flows.engine.common.keys import derivation_key, request_key
from pt2flow.flows.engine.common.source_manifest import read_weights, source_manifest
from pt2flow.stages.vocabulary import DETERMINISTIC_FAILURES


def source_key(manifest: Mapping[str, Any]) -> str:
    """The source key: the full manifest, the dependency manifest of the model's code included."""
    return derivation_key("source", [], manifest, {})


def recorded_source(store: Any, model: ResolvedModel, request: str) -> dict[str, Any] | None:
    """The newest ok source record of `model` made for `request` whose dependency manifest
    still holds: every local file with the same content, every distribution at the same
    version. Checked without importing torch or the model's code."""
    import pyarrow.compute as pc

    from pt2flow.stages.deps import changed_entries

    condition = (pc.field("model") == model.name) & (pc.field("stage") == "source") & (pc.field("status") == "ok")
    rows = store.index.read(["key", "details", "ended_at"], filter=condition).to_pylist()
    for row in sorted(rows, key=lambda r: r["ended_at"] or datetime.min.replace(tzinfo=UTC), reverse=True):
        details = json.loads(row["details"] or "{}")
        if details.get("request") != request:
            continue
        if getattr(model, "generate", None) is not None and "components" not in details:
            continue  # recorded before the source named a generative model's components: built again (same key)
        deps = (details.get("manifest") or {}).get("deps")
        if deps is None or changed_entries(
            deps,
            model.search_path,
            versions=_worker_versions(),
            stats=details.get("stats"),
            taken_ns=details.get("stats_at"),
        ):
            return None  # the newest build of this request depends on code or files that have changed since
        return row
    return None


def _worker_versions() -> Mapping[str, str] | None:
    """The distributions the workers' interpreter has (None: this process's, read from sys.path)."""
    from pt2flow.flows.engine.environment import interpreter

    python = interpreter.current()
    return None if python.local else python.distributions


def find_cached(
    store: Any, key: str, run_id: str | None = None, *, failures: bool = False, model: str | None = None
) -> dict[str, Any] | None:
    """The newest record for `key` (of run `run_id`, if given) that settles the stage: an ok
    record whose blob exists and verifies, or (failures=True) a failure of a deterministic
    class. Transient failures never settle a key. None if there is none.

    `model`: that model's own records come first. Two models whose programs are one (a key
    follows from the program's fingerprint) share a key; an archive also holds its lineage, so
    their artifacts differ in bytes, and a model served the other's would see its artifact, and
    every key after it, change from run to run."""
    import pyarrow.compute as pc

    from pt2flow.storage.index import filtered

    table = store.index.with_key(key)
    if run_id is not None:
        table = filtered(table, pc.field("run_id") == run_id)
    if table.num_rows == 0:
        return None
    rows = sorted(
        table.to_pylist(),
        key=lambda r: (r["model"] == model, r["ended_at"] or datetime.min.replace(tzinfo=UTC)),
        reverse=True,
    )
    for row in rows:
        if row["status"] == "ok":
            if not row["sha256"]:
                continue
            # the blob's stat signature as it was last verified: unchanged, it is not re-read
            # (a cache hit costs no I/O proportional to the artifact); changed, it is re-hashed
            status, signature = store.blob_status_trusting(row["sha256"], row["size"], row.get("blob_stat"))
            if status == "ok":
                return {**row, "blob_stat": signature}
        elif failures and row["error_class"] in DETERMINISTIC_FAILURES:
            return row
    return None


def cached_outcome(row: Mapping[str, Any], key: str, *, own: bool, clock: float) -> Outcome:
    """The outcome a stage reports for an index hit (`own`: this run's earlier attempt made it),
    a cached failure included: its class and original message."""
    failed = row["status"] != "ok"
    return Outcome(
        status=row["status"],
        cached=bool(row["cached"]) if own else True,
        seconds=round(time.perf_counter() - clock, 6),
        artifact=row["sha256"],
        size=row["size"],
        uri=row["uri"],
        key=key,
        fingerprint=row["fingerprint"],
        details=json.loads(row["details"] or "{}"),
        error_class=row["error_class"] if failed else None,
        error=row["error_message"] if failed else None,
    )


@dataclass
class Plan:
    """A model's source description and the cached prefix of its stage chain.

    hits: stage -> (key, index row) for the stages settled by the index, in order (the last
    one may be a cached failure, which settles the model);
    first_miss: the first stage with work to do (None: the model is settled by the index).
    """

    model: ResolvedModel
    manifest: dict[str, Any] | None = None  # the static part (config and weights); see request_key
    module_file: str | None = None
    source_key: str | None = None  # of the recorded source whose dependencies still hold
    hits: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    first_miss: str | None = "source"
    problem: str | None = None  # why planning stopped early (the model flow reports it properly)

    @property
    def fully_cached(self) -> bool:
        return self.first_miss is None

    def hit(self, stage: str, key: str) -> dict[str, Any] | None:
        found = self.hits.get(stage)
        return found[1] if found is not None and found[0] == key else None


def plan_model(model: ResolvedModel, ctx: RunContext) -> Plan:
    """Key chain and cache decisions for `model`. Never raises: a model that cannot be planned
    (weights missing, module gone) has work to do, and its model flow reports why."""
    plan = Plan(model)
    if ctx.force or ctx.verify_sources:  # --verify-sources: the source is built again, the rest looked up
        return plan
    failures = not ctx.retry_failed
    try:
        digest = hashlib.sha256(read_weights(model)[0]).hexdigest() if model.weights else None
        plan.manifest, plan.module_file = source_manifest(model, digest)
        store = stores.open_store(ctx.store_url)
        recorded = recorded_source(store, model, request_key(plan.manifest))
        if recorded is None:
            return plan
        plan.source_key = recorded["key"]
        row = find_cached(store, plan.source_key, model=model.name)
        if row is None:
            return plan
        plan.hits["source"] = (plan.source_key, row)
        # the source's details name a generative model's components (flows.config.models.components_of)
        outcomes: dict[str, Outcome] = {
            "source": _facts(plan.source_key, row).model_copy(update={"details": json.loads(row["details"] or "{}")})
        }
        if model.generate is not None:
            if not _plan_components(plan, model, ctx, store, outcomes, failures):
                return plan
            plan.first_miss = None
            return plan
        for stage in ctx.stages:
            spec = pipeline.get(stage)
            if blocked(spec, outcomes):  # what it needs failed, and the model went on without it
                continue
            key = stage_key(spec, model, gather(spec, outcomes))
            row = find_cached(store, key, failures=failures, model=model.name)
            if row is None:
                plan.first_miss = stage
                return plan
            plan.hits[stage] = (key, row)
            if (
                row["status"] != "ok"
            ):  # a known failure: the model ends here, as it did before, unless it may do without the stage
                if model.tolerates_failure(stage):
                    continue
                break
            outcomes[stage] = _facts(key, row)
    except Exception as exc:  # weights missing, an unreadable index: the model flow meets it again and reports it
        plan.problem = f"{type(exc).__name__}: {exc}"
        return plan
    plan.first_miss = None
    return plan


def plan_slot(stage: str, model: ResolvedModel) -> str:
    """Where a plan keeps a stage's hit: `component/stage` for a component of a generative model."""
    return f"{model.component}/{stage}" if getattr(model, "component", None) else stage


def chain_stages(stages: tuple[str, ...] | list[str]) -> tuple[list[str], list[str]]:
    """A generative model's stages split: the export chain each component goes through, and the
    stages after it that judge the model as a whole (validate, which publishes the report, and
    what follows it)."""
    judging = next((i for i, s in enumerate(stages) if pipeline.get(s).publishes == "report"), len(stages))
    return list(stages[:judging]), list(stages[judging:])


def _plan_components(
    plan: Plan, model: ResolvedModel, ctx: RunContext, store: Any, outcomes: dict[str, Outcome], failures: bool
) -> bool:
    """The component chains and the model's validate looked up as run_model walks them; False at
    the first miss (plan.first_miss names it), True when the index settles them all."""
    from pt2flow.flows.config.models import components_of

    chain, after = chain_stages(ctx.stages)
    tolerated: set[str] = set()  # stages a component failed that the model does without (runner._run_components)
    for component in components_of(outcomes["source"].details):
        scoped = model.of_component(component)
        got: dict[str, Outcome] = {"source": outcomes["source"]}
        for stage in chain:
            spec = pipeline.get(stage)
            if stage in tolerated or blocked(spec, got):
                continue
            key = stage_key(spec, scoped, gather(spec, got))
            row = find_cached(store, key, failures=failures, model=scoped.name)
            if row is None:
                plan.first_miss = f"{component}/{stage}"
                return False
            plan.hits[f"{component}/{stage}"] = (key, row)
            if row["status"] != "ok":
                if model.tolerates_failure(stage):  # the model goes on without that artifact kind
                    tolerated.add(stage)
                    continue
                return True  # a known failure settles the model
            got[stage] = outcomes[f"{component}/{stage}"] = _facts(key, row)
    for stage in after[:1]:
        inputs = {name: o for name, o in outcomes.items() if name == "source" or "/" in name}
        key = stage_key(pipeline.get(stage), model, inputs)
        row = find_cached(store, key, failures=failures, model=model.name)
        if row is None:
            plan.first_miss = stage
            return False
        plan.hits[stage] = (key, row)
    return True


def _facts(key: str, row: Mapping[str, Any]) -> Outcome:
    """What the next keys need of a stage the index settles (the stage runs later, as a hit)."""
    return Outcome(key=key, artifact=row["sha256"], fingerprint=row["fingerprint"], size=row["size"])
