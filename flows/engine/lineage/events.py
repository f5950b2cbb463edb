"""OpenLineage run events of every model's stages, sent with the openlineage-python client
(docs/architecture.md, "OpenLineage").

On when the client's standard configuration is there (`OPENLINEAGE_URL`, an
`OPENLINEAGE__TRANSPORT__*` variable, `OPENLINEAGE_CONFIG`, `./openlineage.yml` or
`~/.openlineage/openlineage.yml`), off otherwise and with `OPENLINEAGE_DISABLED=true`.

Each stage of each model is one OpenLineage run: START when the orchestrator takes the stage up,
then COMPLETE or FAIL (ABORT when a transient storage error hands it to a retry). The job is
`MODEL.STAGE` in the fleet's namespace (`OPENLINEAGE_NAMESPACE`, default `pt2flow`); the
datasets are store blobs by URL (namespace: the store's scheme and host, name: the blob's path)
with their sha256 as the dataset version: inputs are the blobs the stage read (its parents'
programs, the source, the weights file), outputs the blob it made or, cached, served. Facets:
processing_engine (torch's version), `pt2flow` (run, model, stage, key, cache decision,
library versions, validation verdict, error class), errorMessage on FAIL, and parent (the fleet
run, a job named `fleet`).

Emitting never fails or slows a run: events go to a queue that one background thread sends from;
the first send that fails (a collector that is down, refuses, or times out) logs one warning for
the run and the run's other events are dropped. At the end of a run `flush` waits for the queue
a bounded time (`PT2FLOW_OPENLINEAGE_FLUSH_S`, default 5 s); events still waiting then are
dropped with that same one warning. Only the orchestrator emits (the process that records the
index), never a worker process.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import uuid
from datetime import datetime, UTC
from typing import Any
from collections.abc import Mapping
from urllib.parse import urlsplit

logger = logging.getLogger("pt2flow.openlineage")


PRODUCER = "https://pypi.org/project/pt2flow/"
FACET_SCHEMA = "pt2flow:docs/openlineage-facets.json#/$defs/"
_THREAD_NAME = "pt2flow-openlineage"
_RUN_NAMESPACE = uuid.UUID("6f0b5e4a-31a2-4c59-9c77-2f1b8b7d0e21")


def configured() -> bool:
    """Whether the client's standard configuration names a transport (module docstring)."""
    if os.environ.get("OPENLINEAGE_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OPENLINEAGE_URL") or any(k.startswith("OPENLINEAGE__TRANSPORT") for k in os.environ):
        return True
    candidates = [
        os.environ.get("OPENLINEAGE_CONFIG"),
        os.path.join(os.getcwd(), "openlineage.yml"),
        os.path.join(os.path.expanduser("~/.openlineage"), "openlineage.yml"),
    ]
    return any(path and os.path.isfile(path) for path in candidates)


def namespace() -> str:
    return os.environ.get("OPENLINEAGE_NAMESPACE") or "pt2flow"


def stage_run_id(run_id: str, model: str, stage: str, attempt: int = 0) -> str:
    """The OpenLineage runId (a UUID) of one stage of one model in one pt2flow run."""
    return str(uuid.uuid5(_RUN_NAMESPACE, f"{run_id}/{model}/{stage}/{attempt}"))


def fleet_run_id(run_id: str) -> str:
    return str(uuid.uuid5(_RUN_NAMESPACE, run_id))


def _now() -> str:
    return datetime.now(UTC).isoformat()


class _Silence(logging.Filter):
    """Drops the HTTP library's own retry warnings from the sending thread: the run gets one
    warning of its own, not one per retry."""

    def filter(self, record: logging.LogRecord) -> bool:
        return threading.current_thread().name != _THREAD_NAME


class Emitter:
    """The process's event queue and its sending thread (module docstring)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._lock = threading.Condition()
        self._pending: dict[str, int] = {}
        self._down: set[str] = set()
        self._warned: set[str] = set()
        self._client: Any = None
        self._thread: threading.Thread | None = None
        self.sent: dict[str, int] = {}

    def submit(self, run_id: str, event: Any) -> None:
        with self._lock:
            if run_id in self._down:
                return
            self._pending[run_id] = self._pending.get(run_id, 0) + 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._send_all, name=_THREAD_NAME, daemon=True)
                self._thread.start()
        self._queue.put((run_id, event))

    def flush(self, run_id: str, timeout: float | None = None) -> None:
        """Wait (at most `timeout`, default PT2FLOW_OPENLINEAGE_FLUSH_S or 5 s) for the run's
        events to be sent; what is still waiting then is dropped with the run's one warning."""
        if timeout is None:
            timeout = float(os.environ.get("PT2FLOW_OPENLINEAGE_FLUSH_S", "5"))
        stall = min(timeout, 1.0)  # a collector that takes nothing for this long is not waited for
        deadline = time.monotonic() + timeout
        with self._lock:
            sent, progress = self.sent.get(run_id, 0), time.monotonic()
            while self._pending.get(run_id, 0) > 0 and run_id not in self._down:
                now = time.monotonic()
                if self.sent.get(run_id, 0) != sent:
                    sent, progress = self.sent.get(run_id, 0), now
                if now >= deadline or now - progress >= stall:
                    waited = min(timeout, now - progress)
                    self._give_up(
                        run_id,
                        f"the collector took no event within {waited:.1f} s at the end of the run "
                        f"({self._pending[run_id]} waiting)",
                    )
                    break
                self._lock.wait(min(deadline, progress + stall) - now)
            self._pending.pop(run_id, None)

    def _give_up(self, run_id: str, why: str) -> None:
        """Called with the lock held: drop the run's events, say so once."""
        self._down.add(run_id)
        if run_id not in self._warned:
            self._warned.add(run_id)
            # straight to stderr, not through logging: whatever configured logging in this process
            # (a logger disabled, a level raised) must not swallow the run's one warning
            print(
                f"pt2flow: warning: OpenLineage: {why}; the lineage events of run {run_id} are dropped (the run goes on)",
                file=sys.stderr,
                flush=True,
            )

    def _send_all(self) -> None:
        while True:
            run_id, event = self._queue.get()
            with self._lock:
                skip = run_id in self._down
            error = None
            if not skip:
                try:
                    event = (
                        event() if callable(event) else event
                    )  # built here: the client's import and attrs off the run's path
                except Exception as exc:  # noqa: BLE001 - a pt2flow bug, said once; the run goes on
                    error = f"an event could not be built ({type(exc).__name__}: {_short(exc)})"
            if not skip and error is None:
                try:
                    self.client().emit(event)
                except Exception as exc:  # noqa: BLE001 - a collector's problem never reaches the run
                    error = f"cannot send events to the collector ({type(exc).__name__}: {_short(exc)})"
            with self._lock:
                if error is not None:
                    self._give_up(run_id, error)
                elif not skip:
                    self.sent[run_id] = self.sent.get(run_id, 0) + 1
                if self._pending.get(run_id, 0) > 0:
                    self._pending[run_id] -= 1
                self._lock.notify_all()

    def client(self) -> Any:
        if self._client is None:
            from openlineage.client import OpenLineageClient

            for name in ("urllib3.connectionpool", "urllib3.util.retry", "openlineage.client.transport.http"):
                logging.getLogger(name).addFilter(_Silence())
            self._client = OpenLineageClient()
        return self._client


_EMITTER: Emitter | None = None
_EMITTER_LOCK = threading.Lock()


def emitter() -> Emitter:
    global _EMITTER
    with _EMITTER_LOCK:
        if _EMITTER is None:
            _EMITTER = Emitter()
        return _EMITTER


def _short(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------------------------
# building events (the client's classes)


def dataset(store_url: str, digest: str, kind: str, size: int | None = None, *, output: bool = False) -> Any:
    """A store blob as an OpenLineage dataset: namespace scheme://host of the store, name the
    blob's path, version its sha256, and a `pt2flow` facet (kind, sha256, size, uri)."""
    from openlineage.client.event_v2 import InputDataset, OutputDataset
    from openlineage.client.facet_v2 import dataset_version_dataset

    uri = f"{store_url.rstrip('/')}/blobs/sha256/{digest[:2]}/{digest}"
    parts = urlsplit(uri if "://" in uri else "file://" + os.path.abspath(uri))
    ns = f"{parts.scheme}://{parts.netloc}" if parts.netloc else parts.scheme
    facets = {
        "version": dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=digest, producer=PRODUCER),
        "pt2flow": BlobFacet(kind=kind, sha256=digest, size=size, uri=uri, producer=PRODUCER),
    }
    cls = OutputDataset if output else InputDataset
    return cls(namespace=ns, name=parts.path, facets=facets)


def external_file(url: str, digest: str | None, kind: str) -> Any:
    """A file outside the store (the weights a config names) as an input dataset."""
    from openlineage.client.event_v2 import InputDataset
    from openlineage.client.facet_v2 import dataset_version_dataset

    parts = urlsplit(url if "://" in url else "file://" + os.path.abspath(url))
    ns = f"{parts.scheme}://{parts.netloc}" if parts.netloc else parts.scheme
    facets: dict[str, Any] = {}
    if digest:
        facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=digest, producer=PRODUCER)
        facets["pt2flow"] = BlobFacet(kind=kind, sha256=digest, size=None, uri=url, producer=PRODUCER)
    return InputDataset(namespace=ns, name=parts.path, facets=facets)


def _facet_classes() -> tuple[type, type]:
    import attr
    from openlineage.client.generated.base import DatasetFacet, RunFacet

    @attr.define
    class Pt2flowRunFacet(RunFacet):
        """pt2flow's facts of a stage run (docs/openlineage-facets.json)."""

        run: str
        model: str
        stage: str
        key: str | None = attr.field(default=None)
        cache: str = attr.field(default="miss")  # miss | hit | cached_failure
        versions: dict[str, str] = attr.field(factory=dict)
        validation: dict[str, Any] | None = attr.field(default=None)
        error_class: str | None = attr.field(default=None)
        error: str | None = attr.field(default=None)

        @staticmethod
        def _get_schema() -> str:
            return FACET_SCHEMA + "Pt2flowRunFacet"

    @attr.define
    class Pt2flowBlobFacet(DatasetFacet):
        """A dataset that is a pt2flow store blob: what it holds and its digest."""

        kind: str
        sha256: str
        size: int | None = attr.field(default=None)
        uri: str | None = attr.field(default=None)

        @staticmethod
        def _get_schema() -> str:
            return FACET_SCHEMA + "Pt2flowBlobFacet"

    return Pt2flowRunFacet, Pt2flowBlobFacet


_CLASSES: tuple[type, type] | None = None


def _classes() -> tuple[type, type]:
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _facet_classes()
    return _CLASSES


def BlobFacet(**fields: Any) -> Any:  # noqa: N802 - a facet class built on first use (attrs, the client's base)
    return _classes()[1](**fields)


def RunFacts(**fields: Any) -> Any:  # noqa: N802
    return _classes()[0](**fields)


def run_event(
    event_type: str,
    *,
    run_id: str,
    model: str,
    stage: str,
    attempt: int,
    inputs: list[Any],
    outputs: list[Any],
    facts: Mapping[str, Any],
    torch_version: str,
    error: str | None = None,
    when: str | None = None,
) -> Any:
    """One OpenLineage RunEvent of a stage run."""
    from openlineage.client.event_v2 import Job, Run, RunEvent, RunState
    from openlineage.client.facet_v2 import error_message_run, parent_run, processing_engine_run

    facets: dict[str, Any] = {
        "processing_engine": processing_engine_run.ProcessingEngineRunFacet(
            version=torch_version,
            name="torch",
            openlineageAdapterVersion=facts.get("versions", {}).get("pt2flow", "unknown"),
            producer=PRODUCER,
        ),
        "pt2flow": RunFacts(run=run_id, model=model, stage=stage, **facts, producer=PRODUCER),
        "parent": parent_run.ParentRunFacet(
            run=parent_run.Run(runId=fleet_run_id(run_id)),
            job=parent_run.Job(namespace=namespace(), name="fleet"),
            producer=PRODUCER,
        ),
    }
    if error is not None:
        facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(
            message=error, programmingLanguage="python", producer=PRODUCER
        )
    return RunEvent(
        eventType=getattr(RunState, event_type),
        eventTime=when or _now(),
        run=Run(runId=stage_run_id(run_id, model, stage, attempt), facets=facets),
        job=Job(namespace=namespace(), name=f"{model}.{stage}"),
        producer=PRODUCER,
        inputs=inputs,
        outputs=outputs,
    )


# ---------------------------------------------------------------------------------------------
# one stage of one model, as the orchestrator runs it


class StageLineage:
    """START when made (`start`), COMPLETE / FAIL / ABORT when `end`ed: the events of one stage
    of one model. Does nothing when OpenLineage is not configured."""

    def __init__(self, ctx: Any, model: Any, stage: str, inputs: Mapping[str, Any]) -> None:
        self.on = configured()
        self.ctx, self.model, self.stage, self.inputs = ctx, model, stage, dict(inputs)
        self.attempt = 0

    def start(self) -> None:
        if self.on:
            self._emit("START", None)

    def end(self, outcome: Any, *, aborted: bool = False) -> None:
        if self.on:
            self._emit("ABORT" if aborted else ("COMPLETE" if outcome is not None and outcome.ok else "FAIL"), outcome)

    def _emit(self, event_type: str, outcome: Any) -> None:
        """Queue the event; the sending thread builds it (with the time and versions taken now)."""
        when = _now()
        try:
            versions = self._versions()
        except Exception as exc:  # noqa: BLE001 - an event without versions is still an event
            logger.debug("OpenLineage: no versions for %s/%s: %s", self.model.name, self.stage, exc)
            versions = {}
        emitter().submit(self.ctx.run_id, lambda: self._event(event_type, outcome, when, versions))

    def _versions(self) -> dict[str, str]:
        """torch, python, pt2flow and the stage's libraries, as the workers' interpreter has them
        (flows/engine/environment/interpreter.py: this one unless the fleet runs under another)."""
        from pt2flow.flows.engine.environment import interpreter
        from pt2flow.flows.engine.environment.interpreter import current_environment
        from pt2flow.flows.pipeline import get as get_stage

        env = current_environment()
        python = interpreter.current()
        return {
            "torch": env.torch_version,
            "python": env.python_version,
            "pt2flow": env.pt2flow_version,
            **{lib: str(python.version(lib, "unknown")) for lib in get_stage(self.stage).libraries},
        }

    def _event(self, event_type: str, outcome: Any, when: str, versions: dict[str, str]) -> Any:
        from pt2flow.flows.pipeline import get as get_stage

        spec = get_stage(self.stage)
        store = self.ctx.store_url
        inputs = [
            dataset(store, o.artifact, name, o.size) for name, o in self.inputs.items() if getattr(o, "artifact", None)
        ]
        outputs: list[Any] = []
        if self.stage == "source" and self.model.weights:
            weights = (outcome.details.get("weights") or {}) if outcome is not None else {}
            inputs.append(external_file(str(self.model.weights), weights.get("sha256"), "weights"))
        facts: dict[str, Any] = {"versions": versions}
        error = None
        if outcome is not None:
            facts["key"] = outcome.key
            facts["cache"] = ("hit" if outcome.ok else "cached_failure") if outcome.cached else "miss"
            if outcome.artifact:
                outputs.append(
                    dataset(
                        store, outcome.artifact, spec.publishes if outcome.ok else "report", outcome.size, output=True
                    )
                )
            weights = outcome.details.get("weights") if self.stage == "source" and outcome.ok else None
            if weights and weights.get("sha256"):
                outputs.append(dataset(store, weights["sha256"], "weights", weights.get("size"), output=True))
            validation = outcome.details.get("validation")
            if isinstance(validation, dict):
                facts["validation"] = {
                    k: validation.get(k) for k in ("passed", "max_abs_err", "max_rel_err", "samples") if k in validation
                }
            if not outcome.ok:
                facts["error_class"] = outcome.error_class
                facts["error"] = (outcome.error or "")[:2000]
                error = f"[{outcome.error_class}] {outcome.error or ''}"[:4000]
        return run_event(
            event_type,
            run_id=self.ctx.run_id,
            model=self.model.name,
            stage=self.stage,
            attempt=self.attempt,
            inputs=inputs,
            outputs=outputs,
            facts=facts,
            torch_version=versions.get("torch", "unknown"),
            error=error,
            when=when,
        )


def flush(run_id: str) -> None:
    """The end of a run: its events sent, or dropped with one warning (Emitter.flush)."""
    if _EMITTER is not None:
        _EMITTER.flush(run_id)
