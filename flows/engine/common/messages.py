"""The messages between the orchestrator and a worker process (flows/engine/worker/process.py):
each request is a frozen dataclass naming the type of its reply, so `Worker.call` returns what
the request says. They are pickled over the worker's connection: a change of shape is a new
WORKER_PROTOCOL (protocol.py). Both sides import this module; it imports neither side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from collections.abc import Mapping

from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.common.context import Outcome, RunContext
from pt2flow.stages.vocabulary import ErrorClass

ReplyT = TypeVar("ReplyT")


@dataclass(frozen=True)
class Produced:
    """What a stage published: its blob (digest, size, uri, the stat signature it was verified
    with), its fingerprint (a program's; else the blob's digest), details and warnings."""

    artifact: str
    size: int
    uri: str
    blob_stat: str | None = None
    fingerprint: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Failure:
    """Why a stage failed: its class and message, details for the record, a report blob's
    bytes, and whether it is a transient storage error worth a retry."""

    error_class: ErrorClass
    error: str
    details: dict[str, Any] = field(default_factory=dict)
    report: bytes | None = None
    transient: bool = False


# a reply: ("ok", payload) or ("failed", why); its payload's type is the request's to say
StageReply = tuple[str, Produced | Failure]
Reply = tuple[str, dict[str, Any]]


class Request(Generic[ReplyT]):
    """A request a worker answers with a ReplyT (a typing marker: no fields, no behaviour)."""


@dataclass(frozen=True)
class StageRequest(Request[StageReply]):
    """Run one stage of one model (flows/engine/worker/compute.py run_stage)."""

    stage: str
    compute: str  # "module:function" (Stage.compute)
    model: ResolvedModel
    ctx: RunContext
    inputs: dict[str, Outcome]
    key: str


@dataclass(frozen=True)
class CheckArtifact(Request[Reply]):
    """check-compat: one artifact loaded and run on its stored samples `io` (compute.check_artifact).
    stage: the candidate stage that made it; modules: the pytree modules to import first."""

    kind: str
    data: bytes
    io: bytes | None
    atol: float
    rtol: float
    device: str
    stage: str | None = None
    modules: list[str] | None = None
    # the accuracy budgets an artifact not meant to be exact (Stage.exact false) is held to, instead of atol/rtol
    accuracy: dict[str, Any] | None = None


@dataclass(frozen=True)
class RebuildRecord(Request[Reply]):
    """pt2flow audit: one program record's blob fingerprinted and built again from its parent
    (flows/engine/worker/rebuild.py)."""

    stage: str
    stored: bytes
    options: Mapping[str, Any]
    parent: bytes | None
    model: ResolvedModel | None
    store_url: str
    weights: Mapping[str, Any] | None
    # what the record's fingerprint is of: "program" (a program the blob holds, loaded), "bytes"
    # (the blob's sha256: a deployment artifact's, the int8 .pte's)
    identity: str = "program"


@dataclass(frozen=True)
class InspectModel(Request[Reply]):
    """pt2flow validate: one model's modules imported and forward() read (worker/model_check.py)."""

    model: ResolvedModel


@dataclass(frozen=True)
class NewModel(Request[tuple[str, None]]):
    """A new model starts on this worker: forget the programs kept from the last one."""


@dataclass(frozen=True)
class Describe(Request[Reply]):
    """What the worker sees (its pid and parent's, its folder, its environment, its thread
    settings): for tests and benchmarks."""


@dataclass(frozen=True)
class Stop:
    """Exit the message loop (sent without waiting for a reply)."""
