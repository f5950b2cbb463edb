"""`pt2flow validate`'s checks beyond the config's own (docs/architecture.md §3): what a run
would otherwise fail on only once it reached the model, checked without running a stage.

- Files (this process, no torch): every `weights` and `inputs_file` exists (a local path
  resolved against the config's folder; an fsspec URL with one metadata request, as a run would
  read it; a URL that cannot be asked is a note, not a problem).
- Code (a worker process of engine/orchestrator/supervisor.py, the isolation a run's stages get: a module that
  crashes, hangs or eats memory on import fails only its model): the factory and inputs_factory
  modules import, each factory is called once and returns what it must (an nn.Module; the
  inputs factory's `(args, kwargs)`), and the configured input names match the built model's
  `forward()` (an inputs_factory's positional arguments filling forward()'s first parameters).

Each factory is called on the meta device first (`with torch.device("meta")`): every parameter
is a shape without storage, so a 7B-parameter factory builds in seconds and no memory, and the
signature inspected is the built module's own `forward` (a factory may return a wrapper or
another class than its name says). One that refuses the meta device (it reads a checkpoint,
calls `.item()` in `__init__`) is called again on the CPU, as the run's source stage would,
within the model's limits (its memory ceiling; its source-stage time limit, else
PREFLIGHT_TIMEOUT_S): what it raises there is a problem carrying the exception's message, as
is running out of memory or time. A model's problems are found with the config's own in one
pass (`api.validate`: flows/config/load.py `check_config` leaves out only what the schema
refused).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Container, Mapping, Sequence

from pt2flow.flows.config import ResolvedModel
from pt2flow.flows.engine.common.inputs import declared_problems, resolve_model_url
from pt2flow.flows.engine.common.messages import InspectModel
from pt2flow.flows.engine.orchestrator.supervisor import Budget, Worker, WorkerLost
from pt2flow.flows.engine.orchestrator.runner import default_memory_gb
from pt2flow.flows.engine.worker.model_check import KeyPath

PREFLIGHT_TIMEOUT_S = 300.0  # one model: importing its modules and building it, unless its limits say less


def preflight_seconds(model: ResolvedModel) -> float:
    """How long one model's code check may take: its source stage's limit when it has one (the
    run builds it there), else PREFLIGHT_TIMEOUT_S or the model's whole limit if that is less."""
    source = model.limits.stage_budget("source")
    if source is not None:
        return float(source)
    return min(PREFLIGHT_TIMEOUT_S, model.limits.timeout_s or PREFLIGHT_TIMEOUT_S)


@dataclass(frozen=True)
class Finding:
    path: KeyPath
    message: str


@dataclass
class Preflight:
    """What validate found beyond the config's own checks: `problems` (exit 2, reported like a
    config error at their YAML path) and `notes` (what could not be checked, and why)."""

    problems: list[Finding] = field(default_factory=list)
    notes: list[Finding] = field(default_factory=list)
    imported: int = 0  # models whose modules a worker imported


def preflight(
    models: Sequence[ResolvedModel] | Mapping[int, ResolvedModel],
    *,
    imports: bool = True,
    url_exists: Callable[[str], bool] | None = None,
    code: Container[int] | None = None,
) -> Preflight:
    """Check `models` (the config's, in config order: position i is `models[i]`; or a mapping of
    position to model): their files here, their code in a worker process unless `imports` is
    False (only the positions in `code`, when given)."""
    found = Preflight()
    chosen = dict(models.items()) if isinstance(models, Mapping) else dict(enumerate(models))
    for i, model in chosen.items():
        for key in ("weights", "inputs_file"):
            location = getattr(model, key)
            if location is not None:
                _check_file(found, ("models", i, key), str(location), model.search_path, url_exists)
        for path, message in declared_problems(model):
            found.problems.append(Finding(("models", i, *path), message))
    if imports:
        _check_code(found, {i: m for i, m in chosen.items() if code is None or i in code})
    return found


def _check_file(
    found: Preflight, path: KeyPath, location: str, search_path: str, url_exists: Callable[[str], bool] | None
) -> None:
    url = resolve_model_url(location, search_path)
    if "://" not in url:
        if not os.path.isfile(url):
            found.problems.append(Finding(path, f"file not found: {url}"))
        return
    from pt2flow.storage.errors import StorageError
    from pt2flow.storage.urls import redact_url, url_exists as exists

    try:
        present = (url_exists or exists)(url)
    except StorageError as exc:
        found.notes.append(Finding(path, f"not checked: {exc}"))
        return
    if not present:
        found.problems.append(Finding(path, f"not found: {redact_url(url)}"))


def _check_code(found: Preflight, models: Mapping[int, ResolvedModel]) -> None:
    """Each model's modules imported and its forward() read in a worker process; the worker is
    replaced after one that died, ran out of time or memory, or reported a problem (what a
    broken module left behind must not decide the next model)."""
    worker: Worker | None = None
    try:
        for i, model in models.items():
            worker = worker or Worker(threads=1, exports=False)  # imports and builds models: no warm-up needed
            memory = model.limits.memory_gb or default_memory_gb()
            seconds = preflight_seconds(model)
            budget = Budget(
                deadline=time.monotonic() + seconds,
                memory_bytes=int(memory * 2**30),
                deadline_reason=f"importing and building it took over {seconds:g} s",
            )
            try:
                status, payload = worker.call(InspectModel(model), budget)
            except WorkerLost as lost:
                worker.close()
                worker = None
                found.problems.append(
                    Finding(
                        ("models", i, "factory"), f"{lost.error_class} while importing or building it: {lost.message}"
                    )
                )
                continue
            found.imported += 1
            if status != "ok":  # a bug in the check itself, not in the model
                found.notes.append(Finding(("models", i), f"not checked: {payload}"))
                continue
            problems = [Finding(("models", i, *p), m) for p, m in payload["problems"]]
            found.problems.extend(problems)
            found.notes.extend(Finding(("models", i, *p), m) for p, m in payload["notes"])
            if problems:
                worker.close()
                worker = None
    finally:
        if worker is not None:
            worker.close()
