"""A store from Python: the index queries `pt2flow ls`, `show`, `lineage`, `diff`, `verify`,
`report` and `get` answer, as values (`pt2flow.flows.api.open_store`). No torch, no Prefect.

Errors are the CLI's: InvalidId / AmbiguousId / UsageError for arguments that cannot be used
(the CLI's exit 2), RecordNotFound and StorageError for what the store does not hold or cannot
give (exit 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, UTC
from typing import TYPE_CHECKING, Any, cast
from collections.abc import Mapping

from pt2flow.flows import pipeline
from pt2flow.flows.api.documents import BuiltFromWeights, Lineage, Record, RecordDiff, RunEntry, VerifyReport
from pt2flow.flows.options import UsageError, merge_options


@dataclass(frozen=True)
class StoreLocation:
    """Which store a query reads, with its storage options and why that one (`origin`)."""

    url: str
    storage_options: Mapping[str, Any] = field(repr=False)  # may hold credentials
    origin: str  # --store | the store of CONFIG | $PT2FLOW_STORE | the default

    def absent(self) -> str | None:
        """Why there is no store here (a local path that is not a folder), else None: a typo
        would otherwise answer every query with nothing."""
        if "://" in self.url or os.path.isdir(self.url):
            return None
        hint = (
            ""
            if self.origin == "--store"
            else f" ({self.origin}; give --store URL, --config CONFIG or set PT2FLOW_STORE)"
        )
        return f"no store at {self.url}{hint}"


def locate_store(
    store: str | None = None,
    *,
    config: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> StoreLocation:
    """The store a query command reads (README "Which store"): `store`, else `config`'s `store:`
    (resolved against the config's folder, as `run` resolves it), else $PT2FLOW_STORE, else
    ./pt2-store. A config's storage_options apply (as in `run`), `storage_options` over them.
    ConfigError when the config's store or storage options are broken."""
    from pt2flow.flows.config.reading import DEFAULT_STORE, read_store_settings, resolve_store_url

    config_store, options = read_store_settings(config) if config else (None, {})
    if store:
        url, origin = store, "--store"
    elif config_store:
        url, origin = config_store, f"the store of {config}"
    elif os.environ.get("PT2FLOW_STORE"):
        url, origin = os.environ["PT2FLOW_STORE"], "$PT2FLOW_STORE"
    else:
        url, origin = DEFAULT_STORE, "the default"
    return StoreLocation(resolve_store_url(url), merge_options(options, dict(storage_options or {})), origin)


if TYPE_CHECKING:
    import pyarrow.compute as pc

    from pt2flow.storage import ArtifactStore
    from pt2flow.storage.retrieve import ArtifactKinds


def parse_time(text: str, what: str) -> datetime:
    """An ISO date or time (UTC unless it says otherwise)."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError as exc:
        raise UsageError(f"{what}: {text!r} is not an ISO date or time (e.g. 2026-11-01 or 2026-11-01T03:00)") from exc
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def record_filter(
    *,
    model: str | None = None,
    stage: str | None = None,
    status: str | None = None,
    torch: str | None = None,
    archive_version: str | None = None,
    run: str | None = None,
    since: str | None = None,
    until: str | None = None,
) -> pc.Expression | None:
    """The pyarrow filter of `ls`'s filters (all must hold); None without any. `run` is a full run
    ID (Store.run_id resolves a prefix); `torch` without a local part (`2.13.0`) matches every
    local build of that version (`2.13.0+cpu`, `2.13.0+cu126`), with one (`2.13.0+cpu`) only it."""
    import pyarrow.compute as pc

    equal = {"model": model, "stage": stage, "status": status, "archive_version": archive_version, "run_id": run}
    conditions = [pc.field(column) == value for column, value in equal.items() if value]
    if torch:
        same = pc.field("torch_version") == torch
        conditions.append(
            same if "+" in torch else same | pc.starts_with(pc.field("torch_version"), pattern=torch + "+")
        )
    if since:
        conditions.append(pc.field("ended_at") >= parse_time(since, "--since"))
    if until:
        conditions.append(pc.field("ended_at") <= parse_time(until, "--until"))
    expression = None
    for condition in conditions:
        expression = condition if expression is None else expression & condition
    return expression


def histogram_diff(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, Any]:
    from pt2flow.flows.report.text import op_changes

    added, removed, changed = op_changes(a, b)
    return {
        "added": added,
        "removed": removed,
        "changed": changed,
        "counts": {"added": len(added), "removed": len(removed), "changed": len(changed)},
    }


def diff_records(a: Mapping[str, Any], b: Mapping[str, Any]) -> RecordDiff:
    """What differs between two decoded records (the fields `pt2flow diff` compares)."""

    def pair(key: str) -> dict[str, Any]:
        return {"a": a.get(key), "b": b.get(key), "same": a.get(key) == b.get(key)}

    def timing() -> dict[str, Any]:
        """A cached record's seconds time the index lookup, not the stage: not compared (same: None)."""
        cached = {"a": bool(a.get("cached")), "b": bool(b.get("cached"))}
        return {
            **pair("seconds"),
            "same": None if any(cached.values()) else a.get("seconds") == b.get("seconds"),
            "cached": cached,
        }

    va, vb = a.get("validation") or {}, b.get("validation") or {}
    return {
        "a": {k: a.get(k) for k in ("sha256", "model", "stage", "run_id", "torch_version")},
        "b": {k: b.get(k) for k in ("sha256", "model", "stage", "run_id", "torch_version")},
        "signature": pair("signature"),
        "op_histogram": histogram_diff(a.get("op_histogram") or {}, b.get("op_histogram") or {}),
        "node_count": pair("node_count"),
        "range_constraints": pair("range_constraints"),
        "size": pair("size"),
        "fingerprint": pair("fingerprint"),
        "validation": {
            "a": va.get("max_abs_err"),
            "b": vb.get("max_abs_err"),
            "a_passed": va.get("passed"),
            "b_passed": vb.get("passed"),
        },
        "seconds": timing(),
    }


def report_of(store: ArtifactStore, record: Mapping[str, Any]) -> dict[str, Any] | None:
    """A validate or benchmark record's stored report (verified by digest), or None."""
    import json

    from pt2flow.flows.pipeline.stage import TIMINGS

    if record.get("stage") not in {pipeline.publisher_name("report"), pipeline.publisher_name(TIMINGS)} - {
        None
    } or not record.get("sha256"):
        return None
    try:
        return json.loads(store.get_blob(record["sha256"], record.get("size")))
    except Exception as exc:  # noqa: BLE001 - shown to the user as part of the record
        return {"error": f"report unavailable: {exc}"}


class Store:
    """An artifact store and its index, queried as the CLI does. `artifacts` is the underlying
    pt2flow.storage.ArtifactStore."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        from pt2flow.storage import ArtifactStore

        self.artifacts = ArtifactStore(url, storage_options)
        self.url = self.artifacts.url

    @classmethod
    def of(cls, artifacts: ArtifactStore) -> Store:
        """A Store around an open pt2flow.storage.ArtifactStore."""
        store = cls.__new__(cls)
        store.artifacts, store.url = artifacts, artifacts.url
        return store

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def ls(
        self, *, limit: int | None = 100, columns: tuple[str, ...] | None = None, **filters: str | None
    ) -> list[Record]:
        """Records, newest first, filtered like `pt2flow ls` (model, stage, status, torch,
        archive_version, run: an ID or unique prefix, since, until); `limit` None or 0 for all."""
        from pt2flow.storage.lineage import decode

        table = self.artifacts.index.scan(list(columns) if columns else None, filter=self.filter(**filters))
        table = table.sort_by([("ended_at", "descending")])
        if limit:
            table = table.slice(0, limit)
        return [cast(Record, decode(r)) for r in table.to_pylist()]

    def count(self, **filters: str | None) -> int:
        return int(self.artifacts.index.scan(["record_id"], filter=self.filter(**filters)).num_rows)

    def filter(self, *, run: str | None = None, **filters: str | None) -> pc.Expression | None:
        """record_filter of `ls`'s filters, `run` resolved from a prefix: RecordNotFound for a run
        the index does not hold, AmbiguousId for a prefix of several (never an empty answer)."""
        return record_filter(run=self.run_id(run) if run else None, **filters)

    def show(self, id: str) -> Record:
        """The newest record of artifact `id` (sha256 or unique prefix), with the runs that
        recorded it and, for validate, its report."""
        from pt2flow.storage.lineage import decode, records_for_id

        records = records_for_id(self.artifacts.index, id)
        record = cast(Record, decode(records[0]))
        record["recorded_in_runs"] = sorted({r["run_id"] for r in records if r.get("run_id")})
        report = report_of(self.artifacts, records[0])
        if report is not None:
            record["report"] = report
        return record

    def lineage(self, id: str, *, descendants: bool = False) -> Lineage:
        """{id, ancestors (source first), record, descendants}: where `id` came from."""
        from pt2flow.storage import lineage

        record = lineage.resolve(self.artifacts.index, id)
        chain = lineage.ancestors(self.artifacts.index, record, pipeline.lineage_order())
        below = lineage.descendants(self.artifacts.index, record, pipeline.lineage_order()) if descendants else []
        return cast(
            Lineage,
            {
                "id": record["sha256"],
                "ancestors": [lineage.decode(r) for r in chain[:-1]],
                "record": lineage.decode(record),
                "descendants": [lineage.decode(r) for r in below],
            },
        )

    def built_from_weights(self, digest: str) -> BuiltFromWeights:
        """{weights, sources, descendants}: everything built from a checkpoint."""
        from pt2flow.storage import lineage

        result = lineage.by_weights(self.artifacts.index, digest, pipeline.lineage_order())
        return cast(
            BuiltFromWeights,
            {
                "weights": result["weights"],
                "sources": [lineage.decode(r) for r in result["sources"]],
                "descendants": [lineage.decode(r) for r in result["descendants"]],
            },
        )

    def diff(self, id_a: str, id_b: str) -> RecordDiff:
        from pt2flow.storage import lineage

        a = lineage.decode(lineage.resolve(self.artifacts.index, id_a))
        b = lineage.decode(lineage.resolve(self.artifacts.index, id_b))
        return diff_records(a, b)

    def runs(self) -> list[RunEntry]:
        """Every run in the index, oldest first (run_id, started_at, ended_at, records)."""
        from pt2flow.flows.report.runs import list_runs

        return cast("list[RunEntry]", list_runs(self.artifacts.index))

    def run_id(self, prefix: str | None = None) -> str:
        """The run a full ID or unique prefix names; without one, the newest run."""
        from pt2flow.flows.report.runs import resolve_run
        from pt2flow.storage.errors import RecordNotFound

        if prefix:
            return resolve_run(self.artifacts.index, prefix)
        runs = self.runs()
        if not runs:
            raise RecordNotFound(f"the index of {self.url} holds no run")
        return str(runs[-1]["run_id"])

    def compare(self, run_a: str | None = None, run_b: str | None = None) -> dict[str, Any]:
        """The drift report between two runs, as `pt2flow report --json`: default, the newest run
        against the newest earlier run that covered its models (its `selection` says which and why)."""
        from pt2flow.flows.report.compare import compare_default, compare_runs

        if run_a and run_b:
            return dict(compare_runs(self.artifacts.index, self.run_id(run_a), self.run_id(run_b)))
        if run_a or run_b:
            raise UsageError(
                "give both runs, or neither for the newest run and the earlier one that covered its models"
            )
        return dict(compare_default(self.artifacts.index))

    def failures(self, run: str | None = None, *, against: str | None = None) -> dict[str, Any]:
        """`pt2flow failures --json`: `run`'s failures (default: the newest run) grouped by root
        cause, largest first, each new or persisting against `against` (default: the run
        `report` pairs it with), then the groups only `against` had (gone)."""
        from pt2flow.flows.report.failures import failures_of

        return failures_of(self.artifacts, run, against)

    def get(
        self,
        output: str,
        id: str | None = None,
        *,
        model: str | None = None,
        run: str | None = None,
        artifact: str | None = None,
        component: str | None = None,
    ) -> Record:
        """Copy a verified artifact to the file `output`, as `pt2flow get`; returns its record with
        `path`. `component`: of a generative model, that component's artifact (model `M/component`)."""
        from pt2flow.storage.retrieve import (
            ArtifactRequestError,
            GenerativeModel,
            component_set,
            copy_out,
            find_by_id,
            find_for_model,
        )

        kinds = artifact_kinds()
        if bool(id) == bool(model):
            raise UsageError("give an artifact ID or a model (one of them)")
        if run and not model:
            raise UsageError("a run goes with a model")
        if component and not model:
            raise UsageError("a component goes with a model")
        if component:
            model = f"{model}/{component}"
        try:
            if id:
                record = find_by_id(self.artifacts.index, id, artifact, kinds=kinds)
            else:
                try:
                    record = find_for_model(
                        self.artifacts.index,
                        str(model),
                        artifact or "serialized",
                        self.run_id(run) if run else None,
                        kinds=kinds,
                    )
                except GenerativeModel as generative:  # every component into the folder `output`, with a manifest
                    from pt2flow.flows.config.models import (
                        ENCODER_DECODER_COMPONENTS as COMPONENTS,
                    )  # call order, when the source names none

                    kind = artifact or "serialized"
                    return cast(
                        Record,
                        component_set(
                            self.artifacts,
                            generative.model,
                            generative.components,
                            kind,
                            output,
                            self.run_id(run) if run else None,
                            kinds=kinds,
                            suffix=pipeline.get(kinds.stages[kind]).suffix or "",
                            entry=pipeline.entry().name,
                            source=pipeline.SOURCE_NAME,
                            order=COMPONENTS,
                        ),
                    )
            return cast(Record, copy_out(self.artifacts, record, output, kinds=kinds))
        except ArtifactRequestError as exc:
            raise UsageError(str(exc)) from None

    def verify(self) -> VerifyReport:
        """Re-hash every blob: {checked, missing, corrupt}, as `pt2flow verify --json`."""
        from pt2flow.flows.api.upkeep import verify_store

        return verify_store(self.artifacts)


def artifact_kinds() -> ArtifactKinds:
    """What `get` hands out, from the stages (flows/pipeline): each stage's `artifact` kind, and
    which of them are zip archives."""
    from pt2flow.storage.retrieve import ArtifactKinds

    return ArtifactKinds(
        pipeline.artifact_kinds(),
        frozenset(s.name for s in pipeline.stages() if s.publishes in ("archive", "package", "program")),
        judge=pipeline.publisher_name("report"),
    )
