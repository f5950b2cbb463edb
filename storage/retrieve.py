"""Taking a verified artifact out of the store (`pt2flow get`): only what an ok index record vouches
for, re-hashed (and, for archives, zip-checked) before a byte reaches the destination, which is
written atomically: a refused or interrupted copy leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

import pyarrow.compute as pc

from pt2flow.storage.errors import IntegrityError, RecordNotFound, StorageError
from pt2flow.storage.index import MetadataIndex
from pt2flow.storage.lineage import decode, newest_first, records_for_id
from pt2flow.storage.safety import check_archive


@dataclass(frozen=True)
class ArtifactKinds:
    """What `get` can hand out: kind (what a user asks for) -> the stage whose record holds it,
    and the stages whose blobs are zip archives (checked like every archive pt2flow loads). The
    flows layer derives them from its stages (flows/pipeline); the storage layer knows no stage."""

    stages: Mapping[str, str]
    zipped: frozenset[str] = field(default_factory=frozenset)
    judge: str | None = None  # the stage whose record holds each artifact's own verdict (`validation.verdicts`)

    def of(self, stage: str) -> str | None:
        """The artifact kind a stage's record holds, if any."""
        return next((kind for kind, owner in self.stages.items() if owner == stage), None)


class ArtifactRequestError(StorageError, ValueError):
    """The request names no artifact `get` can hand out (a stage without one, a kind that does not
    match the ID)."""


def find_by_id(index: MetadataIndex, prefix: str, kind: str | None = None, *, kinds: ArtifactKinds) -> dict[str, Any]:
    """The newest ok record of the artifact an ID (prefix) names. Refuses an ID the index does not
    vouch for: unknown (RecordNotFound), ambiguous, only failed records, or not a `kind` artifact."""
    rows = records_for_id(index, prefix)
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        raise RecordNotFound(
            f"the index vouches for no artifact with ID {prefix!r}: its only records are failures (see `pt2flow show {prefix}`)"
        )
    record = newest_first(ok)[0]
    have = kinds.of(record["stage"])
    if have is None:
        raise ArtifactRequestError(
            f"ID {prefix!r} is the {record['stage']} record of {record['model']}, which has no artifact to get ({', '.join(kinds.stages)})"
        )
    if kind is not None and kind != have:
        raise ArtifactRequestError(
            f"ID {prefix!r} is the {have} artifact of {record['model']}, not its {kind} artifact"
        )
    refuse_failed_verdict(index, record, have, kinds)
    return record


def find_for_model(
    index: MetadataIndex, model: str, kind: str, run_id: str | None = None, *, kinds: ArtifactKinds
) -> dict[str, Any]:
    """The newest ok `kind` artifact of `model` (in run `run_id` if given)."""
    if kind not in kinds.stages:
        raise ArtifactRequestError(f"unknown artifact {kind!r}: choose from {', '.join(kinds.stages)}")
    condition = (pc.field("model") == model) & (pc.field("stage") == kinds.stages[kind]) & (pc.field("status") == "ok")
    if run_id is not None:
        condition = condition & (pc.field("run_id") == run_id)
    rows = [r for r in index.scan(None, filter=condition).to_pylist() if r.get("sha256")]
    if not rows:
        where = f" in run {run_id}" if run_id else ""
        if (
            "/" in model
        ):  # a generative model's component: its stage, or a sibling's, failed and the model did without the kind
            _refuse_failed_component(
                index, model.split("/", 1)[0], kinds.stages[kind], run_id, f"the {kind} artifact of {model}"
            )
        components = _components_of(index, model, kinds.stages[kind])
        if components:  # a generative model: its artifacts are its components'
            raise GenerativeModel(
                model,
                components,
                f"{model!r} is a generative model whose {kind} artifacts are its components' "
                f"({', '.join(components)}): give --component NAME, or a folder to write them all into",
            )
        raise RecordNotFound(f"the index holds no ok {kind} artifact of model {model!r}{where}")
    record = newest_first(rows)[0]
    refuse_failed_verdict(index, record, kind, kinds)
    return record


class GenerativeModel(RecordNotFound):
    """A model whose artifacts are its components' (`M/prefill`, `M/decode`): `components` names them."""

    def __init__(self, model: str, components: list[str], message: str) -> None:
        super().__init__(message)
        self.model, self.components = model, components


def component_set(
    store: Any,
    model: str,
    components: list[str],
    kind: str,
    folder: str,
    run_id: str | None,
    *,
    kinds: ArtifactKinds,
    suffix: str,
    entry: str,
    source: str,
    order: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Every component's `kind` artifact of a generative model written into `folder` (created) as
    `<component><suffix>`, verified as `get` verifies one, with `manifest.json`: the model, the
    artifact kind, the call order, its `generate:` (from the source record) and per component its
    file, sha256, size, run and call specs (the traced program's in/out tree specs, JSON, from
    the entry stage's record of the same run: how a flat runtime is called; a record written before
    pt2flow kept them has none, which `warnings` says). Returns the manifest with `path`."""
    import json

    target = os.path.abspath(folder)
    if os.path.exists(target) and not os.path.isdir(target):
        raise ArtifactRequestError(f"{folder} is a file: a generative model's components go into a folder")
    condition = (pc.field("model") == model) & (pc.field("stage") == source) & (pc.field("status") == "ok")
    sources = newest_first(store.index.scan(None, filter=condition).to_pylist())
    source_details = (decode(sources[0]).get("details") or {}) if sources else {}
    order = tuple(source_details.get("components") or order)  # the call order the source recorded from the model
    named = [c for c in order if c in components] + [c for c in components if c not in order]
    records = {
        component: find_for_model(store.index, f"{model}/{component}", kind, run_id, kinds=kinds) for component in named
    }
    os.makedirs(target, exist_ok=True)  # every component's artifact is there: a refused set writes nothing
    entries: dict[str, Any] = {}
    for component in named:
        record = records[component]
        copy_out(store, record, os.path.join(target, component + suffix), kinds=kinds)
        condition = (
            (pc.field("model") == f"{model}/{component}")
            & (pc.field("stage") == entry)
            & (pc.field("status") == "ok")
            & (pc.field("run_id") == record["run_id"])
        )
        traced = newest_first(store.index.scan(None, filter=condition).to_pylist())
        specs = (decode(traced[0]).get("details") or {}).get("call_specs") if traced else None
        entries[component] = {
            "file": component + suffix,
            "sha256": record["sha256"],
            "size": record["size"],
            "run_id": record["run_id"],
            "call_specs": specs,
        }
    generate = (source_details.get("manifest") or {}).get("generate")
    manifest: dict[str, Any] = {
        "model": model,
        "artifact": kind,
        "order": named,
        "generate": generate,
        "components": entries,
    }
    unspecified = [name for name, entry in entries.items() if not entry["call_specs"]]
    if unspecified:  # traced by a pt2flow that did not record them: a flat runtime cannot be fed from this manifest
        manifest["warnings"] = [
            f"{', '.join(unspecified)}: no call specs recorded with the trace (an older pt2flow); "
            "a runtime taking flat tensors (.pte, ONNX) cannot be called from this manifest: "
            "`pt2flow run CONFIG --force` traces again and records them"
        ]
    with open(os.path.join(target, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return {**manifest, "path": target}


def _components_of(index: MetadataIndex, model: str, stage: str) -> list[str]:
    """The components (`M/prefill` -> prefill) of a generative model that have `stage` records."""
    condition = pc.starts_with(pc.field("model"), f"{model}/") & (pc.field("stage") == stage)
    names = {str(r["model"]).split("/", 1)[1] for r in index.scan(["model"], filter=condition).to_pylist()}
    return sorted(names)


class FailedVerdict(RecordNotFound):
    """The artifact was built, but its own validation in the run that recorded it failed: no
    record vouches for it as a deliverable (exit 1, as for a missing one)."""


def refuse_failed_verdict(index: MetadataIndex, record: Mapping[str, Any], kind: str, kinds: ArtifactKinds) -> None:
    """FailedVerdict when the judging stage's record of the same model and run says this artifact
    failed its validation (with that verdict's class and message); nothing when it passed or was
    not judged (no judging stage ran, or its report predates verdicts)."""
    if kinds.judge is None:
        return
    # a generative model's component (`M/decode`) is judged by its model's validate
    judged_model = str(record["model"]).split("/", 1)[0]
    if judged_model != record["model"]:
        _refuse_failed_component(
            index,
            judged_model,
            record["stage"],
            record["run_id"],
            f"the {kind} artifact of {record['model']} ({str(record['sha256'])[:12]})",
        )
    condition = (
        (pc.field("model") == judged_model)
        & (pc.field("stage") == kinds.judge)
        & (pc.field("run_id") == record["run_id"])
    )
    for judged in newest_first(index.scan(None, filter=condition).to_pylist()):
        verdict = ((decode(judged).get("validation") or {}).get("verdicts") or {}).get(kind)
        if verdict is not None and not verdict.get("passed"):
            raise FailedVerdict(
                f"the {kind} artifact of {record['model']} ({str(record['sha256'])[:12]}) failed validation in run {record['run_id']}, "
                f"{verdict.get('error_class')}: {verdict.get('error')}; `get` hands out only artifacts that validated"
            )
        if verdict is not None:
            return


def _refuse_failed_component(index: MetadataIndex, model: str, stage: str, run_id: str | None, what: str) -> None:
    """FailedVerdict when a component of the generative `model` failed `stage` (in run `run_id`;
    None: in the newest run that recorded that stage for a component): the model went on without
    that artifact kind (`require:`), so no component's artifact of it is a deliverable."""
    condition = pc.starts_with(pc.field("model"), f"{model}/") & (pc.field("stage") == stage)
    if run_id is not None:
        condition = condition & (pc.field("run_id") == run_id)
    rows = newest_first(index.scan(None, filter=condition).to_pylist())
    if not rows:
        return
    newest = rows[0]["run_id"]
    failed = [r for r in rows if r["run_id"] == newest and r.get("status") != "ok"]
    if failed:
        other = failed[0]
        raise FailedVerdict(
            f"{what} is unusable: {other['model']}'s {stage} failed in run {newest}, {other.get('error_class')}: "
            f"{other.get('error_message')}; `get` hands out only artifacts that validated"
        )


def check_destination(destination: str) -> str:
    """The absolute path of `destination`, a file to write; ArtifactRequestError when it names a
    folder or lies in no folder (`get`, and the CLI's --html pages)."""
    target = os.path.abspath(destination)
    if os.path.isdir(target):
        raise ArtifactRequestError(f"{destination} is a directory: give the file to write")
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise ArtifactRequestError(f"cannot write {destination}: no folder {folder}")
    return target


def _create_beside(target: str) -> tuple[int, str]:
    """A new, empty temporary file in `target`'s folder, open for writing, with the mode `open()`
    gives a new file (0666 less the umask), not mkstemp's 0600: os.replace keeps it for `target`."""
    folder = os.path.dirname(target)
    for _ in range(100):
        temporary = os.path.join(folder, f".pt2flow-get-{secrets.token_hex(8)}")
        try:
            return os.open(
                temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666
            ), temporary
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary name", folder)


def copy_out(store: Any, record: Mapping[str, Any], destination: str, *, kinds: ArtifactKinds) -> dict[str, Any]:
    """Write the artifact of `record` to the local path `destination` after checking its size and
    sha256 (IntegrityError for a corrupt blob, BlobNotFound for a missing one) and, for archives,
    its zip structure. Returns the decoded record with `path` and `artifact` added."""
    data = store.get_blob(record["sha256"], record.get("size"))
    if record["stage"] in kinds.zipped:
        check_archive(data, what=f"artifact {record['sha256'][:16]}")
    target = check_destination(destination)
    temporary = None
    try:
        handle, temporary = _create_beside(target)
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)
    except BaseException as exc:
        if temporary is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
        if isinstance(exc, OSError):
            raise ArtifactRequestError(f"cannot write {destination}: {exc.strerror or exc}") from exc
        raise
    result = decode(record)
    result["artifact"] = kinds.of(record["stage"])
    result["path"] = target
    return result


__all__ = [
    "ArtifactKinds",
    "ArtifactRequestError",
    "FailedVerdict",
    "IntegrityError",
    "check_destination",
    "copy_out",
    "find_by_id",
    "find_for_model",
]
