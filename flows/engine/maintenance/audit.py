"""`pt2flow audit`: prove that the cache is honest, as reproducible-build checkers do.

A sample of a run's source and program records (source, trace, functionalize, decompose,
serialize: the records the cache serves to later runs; and the int8 .pte, executorch_int8's,
whose bytes are reproducible) is checked in fresh worker processes, one per model
(docs/architecture.md §5, "Audit"):

- source: the model is built again from the config (`--config`) and its eager digest
  (parameters, buffers, structure) must be the recorded one while the files of its manifest are
  unchanged; a different model from the same files depends on something no tracker sees.

- stored: the record's blob is read (hash verified), its program loaded and fingerprinted; it
  must be the record's fingerprint. A record pointing at another valid program fails here.
- rebuilt: the stage runs again on the record's own inputs (its parent record's program and its
  recorded options; trace from the config's model, when `--config` names it) and the new
  program's fingerprint must be the record's. A key that does not determine its program (a
  dependency the key misses) fails here.

The sample is chosen by hashing each record ID with the seed, so the same fraction and seed pick
the same records on any machine. This process imports no torch.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any
from collections.abc import Mapping, Sequence

from pt2flow.flows import pipeline
from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.common.messages import RebuildRecord
from pt2flow.flows.engine.orchestrator.supervisor import Budget, Worker, WorkerLost
from pt2flow.flows.engine.orchestrator.runner import default_memory_gb
from pt2flow.storage.errors import RecordNotFound, StorageError
from pt2flow.storage.lineage import decode


def audited_stages() -> tuple[str, ...]:
    """The record kinds audit checks: the source, and every stage that declares how it is rebuilt
    (Stage.rebuild: the program stages and the archive, the records later runs are served)."""
    return (pipeline.SOURCE_NAME, *(s.name for s in pipeline.stages() if s.rebuild))


AUDIT_TIMEOUT_S = 900.0  # one record: loading, and the stage run again


def sampled(record_id: str, fraction: float, seed: int) -> bool:
    """Whether the record is in the sample: a uniform draw from its ID and the seed."""
    if fraction >= 1.0:
        return True
    draw = int(hashlib.sha256(f"{seed}:{record_id}".encode()).hexdigest()[:15], 16) / 16**15
    return draw < fraction


def _records(index: Any, run_id: str) -> list[dict[str, Any]]:
    import pyarrow.compute as pc

    audited = audited_stages()
    condition = (pc.field("run_id") == run_id) & (pc.field("status") == "ok") & pc.field("stage").isin(list(audited))
    rows = [decode(row) for row in index.scan(None, filter=condition).to_pylist()]
    order = {stage: i for i, stage in enumerate(audited)}
    # a model's records, then its components' (`M/prefill` ...): together, on one worker
    return sorted(rows, key=lambda r: (_owner(r["model"]), r["model"], order[r["stage"]]))


def _owner(model: str) -> str:
    """The model a record belongs to: a component's (`M/prefill`) is M's."""
    return model.split("/", 1)[0]


class Parents:
    """The ok records the audited records were made from, read in one scan of the index (a scan
    per record cost more than the rebuilds of a small model's records)."""

    def __init__(self, index: Any, records: Sequence[Mapping[str, Any]]) -> None:
        import pyarrow.compute as pc

        keys = sorted({key for record in records for key in (record.get("parent_keys") or [])})
        self.by_key: dict[str, list[dict[str, Any]]] = {}
        if not keys:
            return
        rows = index.scan(None, filter=pc.field("key").isin(keys) & (pc.field("status") == "ok")).to_pylist()
        for row in rows:
            if row.get("sha256"):
                self.by_key.setdefault(row["key"], []).append(row)

    def of(self, record: Mapping[str, Any], stage: str | None = None) -> dict[str, Any] | None:
        """The ok record the stage consumed: its first parent key's newest ok record, or, given
        `stage`, the newest ok record of that stage among all its parent keys (an int8 stage's
        parents are a program and the source)."""
        keys = list(record.get("parent_keys") or [])
        if not keys:
            return None
        if stage is None:
            rows = self.by_key.get(keys[0], [])
        else:
            rows = [row for key in keys for row in self.by_key.get(key, []) if row.get("stage") == stage]
        return decode(max(rows, key=lambda r: r.get("ended_at") or 0)) if rows else None

    def source_weights(self, record: Mapping[str, Any], among: bool = False) -> Mapping[str, Any] | None:
        """The weights the model's source record holds: the record's parent's (trace's), or,
        `among` its parents, the source one's (an int8 stage's parents are a program and the source)."""
        source = self.of(record, pipeline.SOURCE_NAME if among else None)
        return ((source or {}).get("details") or {}).get("weights")


class Auditor:
    """Checks one model's records on a fresh worker of its own (what one model's stages import
    must not help another's); a generative model's components are checked on their model's
    worker, after its source record (they import what the model does: a worker each would cost a
    torch and transformers import per component)."""

    def __init__(
        self,
        store: Any,
        models: Mapping[str, ResolvedModel],
        parents: Parents,
        python: str | None = None,
        threads: int | None = None,
    ) -> None:
        self.store = store
        self.python = python
        self.models = models
        self.parents = parents
        self.threads = threads
        self.worker: Worker | None = None
        self.current: str | None = None
        self.memory_bytes = int(default_memory_gb() * 2**30)

    def _worker_for(self, model: str) -> Worker:
        if self.worker is None or self.current != _owner(model):
            self.close()
            self.worker = Worker(threads=self.threads, python=self.python)
            self.current = _owner(model)
        return self.worker

    def check(self, record: Mapping[str, Any]) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "record_id": record["record_id"],
            "model": record["model"],
            "stage": record["stage"],
            "key": record["key"],
            "sha256": record["sha256"],
            "fingerprint": record["fingerprint"],
            "cached": bool(record.get("cached")),
            "stored": None,
            "rebuilt": None,
            "status": "ok",
            "problem": None,
        }
        entry_stage = pipeline.entry().name  # the stage made from the model itself, not from a parent program
        try:
            data = self.store.get_blob(record["sha256"], record.get("size"))
            parent_record = None if record["stage"] == entry_stage else self.parents.of(record)
            parent = self.store.get_blob(parent_record["sha256"], parent_record.get("size")) if parent_record else None
        except StorageError as exc:
            return {**entry, "status": "failed", "problem": f"storage: {exc}"}
        model = self.models.get(record["model"])
        weights = None
        if record["stage"] == pipeline.SOURCE_NAME:
            weights = (record.get("details") or {}).get("weights")
        elif record["stage"] == entry_stage and model is not None:
            weights = self.parents.source_weights(record)
        elif model is not None and _needs_model(record):  # made from the source too (an int8 stage)
            weights = self.parents.source_weights(record, among=True)
        budget = Budget(
            deadline=time.monotonic() + AUDIT_TIMEOUT_S,
            deadline_reason=f"the audit of one record took over {AUDIT_TIMEOUT_S:g} s",
            memory_bytes=self.memory_bytes,
        )
        # a record whose fingerprint is its blob's sha256 (a deployment artifact: the int8 .pte) is
        # checked by its bytes, any other by the program its blob holds
        identity = "bytes" if record["fingerprint"] == record["sha256"] else "program"
        message = RebuildRecord(
            record["stage"], data, record.get("options") or {}, parent, model, self.store.url, weights, identity
        )
        try:
            status, payload = self._worker_for(record["model"]).call(message, budget)
        except WorkerLost as lost:
            self.close()
            return {**entry, "status": "failed", "problem": f"{lost.error_class}: {lost.message}"}
        if status != "ok":
            self.close()
            return {**entry, "status": "failed", "problem": f"{payload['error_class']}: {payload['error']}"}
        if record["stage"] == pipeline.SOURCE_NAME:
            return _judge_source(entry, record, payload["rebuilt"], payload.get("problem"), model, self._versions())
        entry.update(stored=payload["stored"], rebuilt=payload["rebuilt"])
        problems = []
        what = "artifact" if identity == "bytes" else "program"
        if payload["stored"] != record["fingerprint"]:
            problems.append(f"the stored blob holds another {what} than the record says")
        if payload["rebuilt"] is not None and payload["rebuilt"] != record["fingerprint"]:
            problems.append(f"{record['stage']} run again on the recorded inputs gives another {what}")
        if payload["rebuilt"] is None:
            entry["note"] = (
                f"not rebuilt: pass --config with the model to run {record['stage']} again"
                if record["stage"] == entry_stage or (model is None and _needs_model(record))
                else "not rebuilt: no parent program"
            )
        if problems:
            entry.update(status="failed", problem="; ".join(problems))
        return entry

    def _versions(self) -> Mapping[str, str] | None:
        """The workers' installed versions (None: this interpreter's), for a manifest's check."""
        if self.python is None:
            return None
        from pt2flow.flows.engine.environment.interpreter import describe

        return describe(self.python).distributions

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
            self.current = None


def _needs_model(record: Mapping[str, Any]) -> bool:
    """Whether its stage is made from the model as well as a program (an int8 stage calibrates on
    the model's inputs or data: its parents are the program and the source)."""
    return len(record.get("parent_keys") or []) > 1


def _judge_source(
    entry: dict[str, Any],
    record: Mapping[str, Any],
    rebuilt: str | None,
    problem: str | None,
    model: ResolvedModel | None,
    versions: Mapping[str, str] | None,
) -> dict[str, Any]:
    """A source record against the model built again now: the same eager model (parameters,
    buffers, structure), unless a file of its manifest changed (a re-run would rebuild it then,
    so the cache is honest). A different model from unchanged files is what no tracker saw."""
    from pt2flow.stages.deps import changed_entries

    details = record.get("details") or {}
    deps = (details.get("manifest") or {}).get("deps") or {}
    recorded = deps.get("eager")
    entry.update(stored=recorded, rebuilt=rebuilt)
    if model is None:
        entry["note"] = "not rebuilt: pass --config with the model to build it again"
        return entry
    changed = changed_entries(
        deps, model.search_path, versions=versions, stats=details.get("stats"), taken_ns=details.get("stats_at")
    )
    if recorded is None and details.get("deps_problem"):  # it did not build when recorded (its trace failed for it)
        entry["note"] = f"the model did not build when recorded ({details['deps_problem'][:200]})" + (
            f" and does not now ({problem[:200]})" if problem else " but builds now"
        )
        return entry
    if recorded is None:
        entry["note"] = "not compared: the record has no eager digest (made by an older pt2flow)"
        return entry
    if changed:
        entry["note"] = f"its files changed since (a re-run rebuilds it): {'; '.join(changed[:5])}"
    elif rebuilt is None:
        entry.update(
            status="failed",
            problem=f"the model no longer builds while every file it was recorded with is unchanged: {problem}",
        )
    elif rebuilt != recorded:
        entry.update(
            status="failed",
            problem=(
                "the eager model built now differs from the recorded one (parameters, buffers or structure) while every file "
                "it was recorded with is unchanged: its construction depends on something pt2flow cannot see (an environment "
                "variable, a subprocess, the network); declare it with depends_on, or run with --verify-sources"
            ),
        )
    return entry


def audit(
    store: Any,
    run_id: str,
    *,
    fraction: float = 1.0,
    seed: int = 0,
    models: Sequence[ResolvedModel] = (),
    python: str | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """The audit document of a run: every sampled record with its stored and rebuilt fingerprints.

    Models are checked `workers` at a time (default: as many as a run would use), each on a fresh
    worker of its own; the document lists the records in the same order whatever the count."""
    from concurrent.futures import ThreadPoolExecutor

    from pt2flow.flows.engine.orchestrator.pool import default_workers, worker_threads

    records = _records(store.index, run_id)
    if not records:
        raise RecordNotFound(f"run {run_id!r} has no ok source or program records to audit")
    chosen = [r for r in records if sampled(r["record_id"], fraction, seed)]
    by_name = {m.name: m for m in models}
    for m in models:  # a generative model's components are recorded as the models `M/prefill`, `M/decode`
        if getattr(m, "generate", None) is not None:
            from pt2flow.flows.config.models import ENCODER_DECODER_COMPONENTS as COMPONENTS  # every component name

            by_name.update({f"{m.name}/{c}": m.of_component(c) for c in COMPONENTS})
    groups: dict[str, list[dict[str, Any]]] = {}  # a model's records, its components' included, in order
    for record in chosen:
        groups.setdefault(_owner(record["model"]), []).append(record)
    parents = Parents(store.index, chosen)
    size = max(1, min(workers or default_workers(len(groups)), len(groups) or 1))
    threads = worker_threads(size) if size > 1 else None

    def check_model(group: list[dict[str, Any]]) -> list[dict[str, Any]]:
        auditor = Auditor(store, by_name, parents, python, threads)
        try:
            return [auditor.check(record) for record in group]
        finally:
            auditor.close()

    with ThreadPoolExecutor(size, thread_name_prefix="pt2flow-audit") as pool:
        checked = [entry for done in pool.map(check_model, groups.values()) for entry in done]
    failed = [c for c in checked if c["status"] != "ok"]
    return {
        "run_id": run_id,
        "store": store.url,
        "sample": {"fraction": fraction, "seed": seed, "records": len(records), "checked": len(checked)},
        "summary": {
            "ok": len(checked) - len(failed),
            "failed": len(failed),
            "rebuilt": sum(1 for c in checked if c["rebuilt"] is not None),
        },
        "records": checked,
    }
