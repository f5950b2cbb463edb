"""`pt2flow check-compat`: do the archives and packages a run produced still load, run and compute
the same with the torch installed now? The question to answer before a serving fleet upgrades
torch (docs/architecture.md §6). Each artifact is checked by stages/compat.py on the inputs and
eager outputs validate stored with it, with the run's tolerances: no model code, no weights.

The checks run in a supervised worker process (engine/orchestrator/supervisor.py), never in the caller: a loader
that crashes, hangs or runs out of memory fails that artifact alone (class crash, timeout or
out_of_memory) and a fresh worker checks the rest. This process imports no torch.
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import sys
import time
from typing import Any
from collections.abc import Mapping, Sequence

from pt2flow.flows import pipeline
from pt2flow.flows.engine.common.messages import CheckArtifact
from pt2flow.flows.engine.orchestrator.supervisor import Budget, Worker, WorkerLost
from pt2flow.flows.engine.orchestrator.runner import default_memory_gb
from pt2flow.storage.errors import InvalidId, RecordNotFound, StorageError
from pt2flow.storage.lineage import decode
from pt2flow.stages.archive_meta import recorded_pytree_modules
from pt2flow.stages.options import DEFAULT_ACCURACY
from pt2flow.stages.vocabulary import ErrorClass


def checked_kinds() -> dict[str, str]:
    """The entry key of each candidate stage's artifact in a check-compat document -> the stage:
    `archive` (serialize's: the name this document has always used), `compiled`, then each
    target's artifact kind (`onnx`, `pte`)."""
    return {
        ("archive" if pipeline.get(name).publishes == "archive" else pipeline.get(name).artifact or name): name
        for name in pipeline.candidates()
    }


CHECK_TIMEOUT_S = 600.0  # one artifact: the worker's start, the load and every stored sample
_UNCHECKED = {
    "loads": None,
    "runs": None,
    "matches": None,
    "max_abs_err": None,
    "max_rel_err": None,
    "samples": 0,
    "skipped": None,
}


class Checker:
    """stages.compat.check_artifact in one worker process at a time, under a deadline and the
    memory ceiling a run's worker gets. A worker is replaced when it is lost, after any check
    that failed (a broken CUDA context must not fail the next artifact), and after a check that
    imported modules outside torch (an archive's pytree types: what one archive registered must
    not make the next one load)."""

    def __init__(self, timeout_s: float = CHECK_TIMEOUT_S, python: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.python = python  # the interpreter to check under (default: this one)
        self.memory_bytes = int(default_memory_gb() * 2**30)
        self.worker: Worker | None = None
        self.torch_version: str | None = None  # the workers' torch.__version__, once one answered
        self.checked_in: str | None = None  # the workers' sys.executable, once one answered

    def check(
        self,
        kind: str,
        data: bytes,
        io: bytes | None,
        atol: float,
        rtol: float,
        device: str,
        stage: str | None = None,
        modules: list[str] | None = None,
        accuracy: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if self.worker is None:
            self.worker = Worker(
                threads=None, python=self.python, exports=False
            )  # loads and runs artifacts: no warm-up needed
        budget = Budget(
            deadline=time.monotonic() + self.timeout_s,
            deadline_reason=f"checking the {kind} took over {self.timeout_s:g} s",
            memory_bytes=self.memory_bytes,
        )
        try:
            status, payload = self.worker.call(
                CheckArtifact(kind, data, io, atol, rtol, device, stage, modules, accuracy), budget
            )
        except WorkerLost as lost:
            self.close()
            return {
                **_UNCHECKED,
                "error_class": lost.error_class,
                "error": f"{lost.message} while checking the {kind}",
                "stderr_tail": lost.stderr_tail[-4000:],
            }
        if status != "ok":
            self.close()
            return {**_UNCHECKED, "error_class": payload["error_class"], "error": payload["error"]}
        result = dict(payload)
        self.torch_version = result.pop("checked_with", None) or self.torch_version
        self.checked_in = result.pop("checked_in", None) or self.checked_in
        if result.pop("imported", None) or result.get("error_class"):
            self.close()
        return result

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def _installed_torch(python: str | None = None) -> str | None:
    """The torch version of the checking environment, for a run whose artifacts no worker checked."""
    if python is not None:
        from pt2flow.flows.engine.environment.interpreter import describe

        return describe(python).version("torch", None)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _run_records(index: Any, run_id: str) -> dict[str, dict[str, dict[str, Any]]]:
    """model -> stage -> its newest record in the run."""
    import pyarrow.compute as pc

    models: dict[str, dict[str, dict[str, Any]]] = {}
    rows = sorted(
        index.scan(None, filter=pc.field("run_id") == run_id).to_pylist(), key=lambda r: r.get("ended_at") or 0
    )
    for row in rows:
        models.setdefault(row["model"], {})[row["stage"]] = decode(row)
    return models


def _samples(store: Any, validate: Mapping[str, Any] | None) -> tuple[bytes | None, str | None]:
    """The stored validation samples of a model (safetensors bytes), or (None, why there are none)."""
    if validate is None or validate.get("status") != "ok":
        return None, "no ok validate record in this run: loading is all that can be checked"
    io = (validate.get("details") or {}).get("io")
    if not io:
        why = (validate.get("details") or {}).get(
            "io_skipped"
        ) or "validate stored no inputs (a run of an older pt2flow)"
        return None, why
    return store.get_blob(io["sha256"], io["size"]), None


def _pytree_modules(records: Mapping[str, Mapping[str, Any]], archive: bytes | None) -> list[str] | None:
    """The modules a serving process imports before the model's package or targets load: those
    its archive records (read from the zip, no torch), else those its aot_compile record names."""
    named = recorded_pytree_modules(archive) if archive is not None else None
    if named is None:
        named = ((records.get(pipeline.publisher_name("package") or "") or {}).get("details") or {}).get(
            "pytree_modules"
        )
    return list(named) if named else None


_LOADERS = {
    "archive": "torch.export.load({path!r}).module()",
    "compiled": "torch._inductor.aoti_load_package({path!r})",
}


def load_command(store_url: str, python: str, model: str, kind: str, sha256: str, modules: Sequence[str] | None) -> str:
    """A shell command that loads the artifact as a serving process would, outside pt2flow (the
    evidence behind an `incompatible` verdict): copy it out of the store, import the pytree
    modules, load it with torch's own loader. A target's artifact: check-compat of its run again."""
    path = f"/tmp/{model}.{kind}.pt2"
    loader = _LOADERS.get(kind)
    get = f"pt2flow get {sha256} -o {shlex.quote(path)} --store {shlex.quote(store_url)}"
    if loader is None:
        return get
    imports = "".join(f"import {m}; " for m in modules or ())
    script = f"{imports}import torch; {loader.format(path=path)}; print('loads')"
    return f"{get} && {shlex.quote(python)} -c {shlex.quote(script)}"


def recheck_command(store_url: str, python: str, run_id: str | None) -> str:
    """check-compat of the run again in the interpreter that checked it: the evidence of an
    artifact that loads but raises or computes differently on the stored samples."""
    run = f" {run_id}" if run_id else ""
    return f"{shlex.quote(python)} -m pt2flow.flows.cli.main check-compat{run} --store {shlex.quote(store_url)} --json"


def check_model(
    store: Any, name: str, records: Mapping[str, Mapping[str, Any]], checker: Checker
) -> dict[str, Any] | None:
    """One model's entry, or None when the run produced no archive or package of it. Its status:
    failed (an artifact failed), unchecked (none failed, one could not be run here: a CUDA package
    on a machine without CUDA), ok. Each artifact is loaded as a serving process would: its
    archive's pytree modules imported first (the package and targets record none of their own).
    A failed artifact carries `load_command`, the evidence a person can re-run: torch's own
    loader outside pt2flow when it does not load, else check-compat of its run again."""
    built = {
        kind: records[stage] for kind, stage in checked_kinds().items() if records.get(stage, {}).get("status") == "ok"
    }
    if not built:
        return None
    validate = records.get(pipeline.publisher_name("report") or "")
    samples, note = _samples(store, validate)
    options = (validate or {}).get("options") or {}
    atol, rtol = float(options.get("atol", 1e-5)), float(options.get("rtol", 1e-4))
    accuracy = options.get("accuracy")
    if accuracy is None:  # the model set no budget: the default one (an empty one has no goals)
        accuracy = {m: b.model_dump() for m, b in DEFAULT_ACCURACY.items()}
    entry: dict[str, Any] = {"name": name, "status": "ok", "error_class": None, "note": note}
    blobs: dict[str, bytes | None] = {}
    for kind, record in built.items():
        try:
            blobs[kind] = store.get_blob(record["sha256"], record.get("size"))
        except (StorageError, InvalidId) as exc:  # InvalidId: a record whose digest is not one
            blobs[kind] = None
            entry[kind] = {
                "loads": False,
                "runs": None,
                "matches": None,
                "error_class": ErrorClass.STORAGE,
                "error": str(exc),
            }
    modules = _pytree_modules(records, blobs.get("archive"))
    if modules:
        entry["pytree_modules"] = modules
    for kind, record in built.items():
        checked: dict[str, Any] = {
            "sha256": record["sha256"],
            "torch_version": record.get("torch_version"),
            "archive_version": record.get("archive_version"),
        }
        data = blobs[kind]
        if data is None:
            checked.update(entry[kind])
        else:
            checked.update(
                checker.check(
                    kind,
                    data,
                    samples,
                    atol,
                    rtol,
                    record.get("device") or "cpu",
                    record["stage"],
                    None if kind == "archive" else modules,
                    None if pipeline.get(record["stage"]).exact else accuracy,
                )
            )
            if checked.get("error_class"):
                python = checker.checked_in or checker.python or sys.executable
                if os.path.isdir(python):  # a virtualenv's folder (`--python VENV`): its interpreter
                    python = os.path.join(python, "bin", "python")
                checked["load_command"] = (
                    load_command(store.url, python, name, kind, record["sha256"], modules)
                    if checked.get("loads") is False
                    else recheck_command(store.url, python, record.get("run_id"))
                )
        entry[kind] = checked
        if checked["error_class"] and entry["error_class"] is None:
            entry.update(status="failed", error_class=checked["error_class"])
        elif checked.get("skipped") and entry["status"] == "ok":
            entry["status"] = "unchecked"
    return entry


def check_compat(
    store: Any,
    run_id: str,
    *,
    models_from: Mapping[str, str] | None = None,
    selection: Mapping[str, Any] | None = None,
    python: str | None = None,
) -> dict[str, Any]:
    """The check-compat document of a run: one entry per model with an archive or package, each
    with the run it was taken from (`run_id`). `models_from` (model -> run) takes each model
    from its own run instead (a fleet whose newest run was partial); `selection` says which runs
    and why, and is kept in the document. `python`: check under that interpreter's torch (an
    upgrade candidate's) instead of this one's."""
    taken = dict(models_from or {})
    records: dict[str, dict[str, dict[str, Any]]] = {}
    origin: dict[str, str] = {}
    for run in dict.fromkeys([run_id, *taken.values()]):
        for name, stages in _run_records(store.index, run).items():
            if taken.get(name, run_id) == run and name not in records:
                records[name], origin[name] = stages, run
    if not records:
        raise RecordNotFound(f"no records of run {run_id!r} in the index")
    checker = Checker(python=python)
    try:
        models = [
            {**entry, "run_id": origin[name]}
            for name in sorted(records)
            if (entry := check_model(store, name, records[name], checker)) is not None
        ]
    finally:
        checker.close()
    failed = sum(1 for m in models if m["status"] == "failed")
    unchecked = sum(1 for m in models if m["status"] == "unchecked")
    built_with = sorted(
        {a["torch_version"] for m in models for k in checked_kinds() if (a := m.get(k)) and a.get("torch_version")}
    )
    return {
        "run_id": run_id,
        "runs": sorted(set(origin.values()), key=[run_id, *taken.values()].index),
        "selection": dict(selection) if selection is not None else None,
        "store": store.url,
        "torch_version": checker.torch_version or _installed_torch(python),
        "built_with": built_with,
        "python": checker.checked_in or python or sys.executable,  # the interpreter the checks ran in
        "summary": {"ok": len(models) - failed - unchecked, "failed": failed, "unchecked": unchecked},
        "models": models,
    }
