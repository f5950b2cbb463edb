"""Shared pieces of the hostile-input tests: malicious pickles, a one-model config, and one real
`pt2flow run` (a good model beside one whose checkpoint would run code) whose store several
tests reuse, so that the suite pays for a Prefect server and an export only once."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest

from tests.conftest import run_json, write_config

# the model every end-to-end test here runs: tiny, static shapes, no AOTInductor compile
MLP = {"name": "mlp", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [3, 8]}}}
STAGES = ["trace", "serialize", "validate"]


class OpenPayload:
    """Unpickling this calls open(path, "w"): benign, but it proves code ran (the file appears)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (open, (self.path, "w"))


class SystemPayload:
    """Unpickling this runs a shell command (touch PATH) through os.system."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (os.system, (f"touch '{self.path}'",))


def evil_checkpoints(marker: Path) -> dict[str, bytes]:
    """Checkpoints that run code when unpickled, in every format torch.load reads."""
    import torch

    state = {"fc1.weight": torch.zeros(16, 8), "payload": OpenPayload(marker)}
    zipped = io.BytesIO()
    torch.save(state, zipped)
    legacy = io.BytesIO()
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    return {
        "torch-zip": zipped.getvalue(),
        "torch-legacy": legacy.getvalue(),
        "plain-pickle": pickle.dumps({"fc1.weight": OpenPayload(marker)}, protocol=2),
        "os-system": pickle.dumps(SystemPayload(marker), protocol=2),
        "wrapped-state-dict": pickle.dumps({"state_dict": {"w": OpenPayload(marker)}}),
    }


@dataclass(frozen=True)
class SecurityRun:
    root: Path
    config: Path
    store: Path
    marker: Path
    code: int
    doc: dict[str, Any]
    stderr: str

    def model(self, name: str) -> dict[str, Any]:
        return next(m for m in self.doc["models"] if m["name"] == name)

    def copy_store(self, target: Path) -> Path:
        shutil.copytree(self.store, target)
        return target


@pytest.fixture(scope="session")
def security_run(tmp_path_factory: pytest.TempPathFactory) -> SecurityRun:
    """`pt2flow run --json` on a good model and one whose .pt checkpoint would create a marker file."""
    root = tmp_path_factory.mktemp("security-run")
    marker = root / "pwned-by-checkpoint"
    (root / "evil.pt").write_bytes(evil_checkpoints(marker)["torch-zip"])
    config = write_config(root / "pipeline.yaml", [MLP, {**MLP, "name": "evil", "weights": "evil.pt"}], stages=STAGES)
    store = root / "store"
    code, doc, stderr = run_json(["run", str(config), "--store", str(store)], timeout=600)
    return SecurityRun(root, config, store, marker, code, doc, stderr)


@pytest.fixture
def no_torch_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every call of torch's archive and package loaders (which must not happen)."""
    import torch
    import torch._inductor

    calls: list[str] = []
    real_load = torch.export.load

    def spy_load(*args, **kwargs):
        calls.append("torch.export.load")
        return real_load(*args, **kwargs)

    def spy_package(*args, **kwargs):
        calls.append("aoti_load_package")
        raise AssertionError("aoti_load_package must not be reached")

    monkeypatch.setattr(torch.export, "load", spy_load)  # stages.serialize looks it up at call time
    monkeypatch.setattr(torch._inductor, "aoti_load_package", spy_package)
    return calls


def record(store: Any, digest: str, size: int, stage: str, status: str = "ok") -> None:
    """Append a minimal index record vouching for (or failing) a blob."""
    import uuid

    store.index.append(
        [
            {
                "record_id": uuid.uuid4().hex,
                "run_id": "security-test",
                "model": "mlp",
                "stage": stage,
                "status": status,
                "sha256": digest,
                "size": size,
            }
        ]
    )


def call_validate(
    store_url: str,
    *,
    archive: dict[str, Any] | None = None,
    package: dict[str, Any] | None = None,
    atol: float = 1e-5,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The validate stage on the given artifact outcomes, both halves in this process (so that
    the torch-load spies see every load): the worker's compute (flows.engine.worker.compute.run_stage)
    and the orchestrator's bookkeeping (StageRun records it). Returns the outcome, failed or not."""
    from pt2flow.flows.config.load import parse_config
    from pt2flow.flows import pipeline
    from pt2flow.flows.engine.worker import compute
    from pt2flow.flows.engine.orchestrator.bookkeeping import StageRun
    from pt2flow.flows.engine.common.context import Outcome, RunContext
    from tests.conftest import ROOT

    text = (
        "version: 1\nmodels:\n  - name: mlp\n    factory: tests.models:tiny_mlp\n"
        f"    inputs: {{x: {{shape: [3, 8]}}}}\n    stages: {{validate: {{atol: {atol!r}}}}}\n"
    )
    model = parse_config(text, source="security.yaml", base_dir=str(ROOT)).models[0]
    ctx = RunContext(run_id="security-test", store_url=store_url, stages=tuple(STAGES))
    given = {
        "source": source or {"key": "security-source-key"},
        "trace": {},
        "serialize": archive,
        "aot_compile": package,
    }
    inputs = {name: Outcome.model_validate(c) for name, c in given.items() if c is not None}
    request = compute.StageRequest(
        "validate", pipeline.get("validate").compute, model, ctx, inputs, "security-validate-key"
    )
    status, payload = compute.run_stage(request)
    run = StageRun("validate", model, ctx, "security-validate-key", [c["key"] for c in (archive, package) if c])
    if isinstance(payload, compute.Produced):
        outcome = run.produced(payload)
        run.record(outcome)
        return outcome.model_dump()
    return run.fail(
        payload.error_class, payload.error, details=payload.details, report=payload.report
    ).outcome.model_dump()
