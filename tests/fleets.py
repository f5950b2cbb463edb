"""The expensive fleets, each built once per test session and shared by the tests that read them.

A fleet is a shipped config run cold into a fresh store through the real `pt2flow` binary, then
warm from the test's process (tests/conftest.py `run_as_cli`: the same document and exit code,
without a second start of the CLI). Tests assert on the runs' documents and read the store; a test that changes the store
copies it first (`Fleet.copy_store`). Under pytest-xdist every test that uses a fleet is in the
fleet's xdist group (`MEMBERS` below: tests/session.py's scheduler sends a group to one worker),
so that one worker builds it and runs them all; these groups go to the workers first (they are
the longest).

- `generative_fleet`: configs/generative.yaml as shipped (tiny Llama, Qwen2, Gemma, Phi3 and T5,
  trace, serialize, aot_compile, onnx, executorch, validate) run cold; then the same fleet with
  tiny Llama whose decode program has one weight wrong (tests/generative_faults.py), whose first
  run builds only that model (its prefill is tiny Llama's program, served from tiny Llama's
  records); then both again, warm. Read by tests/integration/test_generative.py,
  test_generative_t5.py and test_reproducible_identity.py (its first store, audited).
- `targets_fleet`: configs/targets.yaml as shipped (the demo's inference models to the archive,
  the AOTInductor package, ONNX, ExecuTorch and OpenVINO, validated) with the benchmark stage
  after validate (a few runs per point; tiny-encoder at the sizes it configures), cold then
  warm. Read by tests/integration/test_targets.py, test_benchmark.py,
  test_reproducible_identity.py (its first store, audited) and tests/stages/test_validate_tolerance.py
  (its onnx, .pte and OpenVINO blobs validated with tolerance auto).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT, run_as_cli, run_cli

GENERATIVE_GROUP = "fleet:generative"
TARGETS_GROUP = "fleet:targets"
# the tests that read a fleet, by file and parametrization id (None: every test of the file); a
# test that uses a fleet and is not listed here fails (`in_group`), as another worker would build
# the fleet again
MEMBERS: dict[tuple[str, str | None], str] = {
    ("tests/integration/test_generative.py", None): GENERATIVE_GROUP,
    ("tests/integration/test_generative_t5.py", None): GENERATIVE_GROUP,
    ("tests/integration/test_reproducible_identity.py", "generative.yaml"): GENERATIVE_GROUP,
    ("tests/integration/test_targets.py", None): TARGETS_GROUP,
    ("tests/integration/test_benchmark.py", None): TARGETS_GROUP,
    ("tests/integration/test_reproducible_identity.py", "targets.yaml"): TARGETS_GROUP,
    ("tests/stages/test_validate_tolerance.py", None): TARGETS_GROUP,
}
# files whose parametrizations are each a group of their own (long, independent, one store each)
BY_PARAMETER = frozenset({"tests/integration/test_reproducible_identity.py"})


def group_of(nodeid: str) -> str:
    """The xdist group of a test: its fleet's, its parametrization's (BY_PARAMETER) or its file."""
    path, _, rest = nodeid.partition("::")
    param = rest[rest.index("[") + 1 : -1] if rest.endswith("]") and "[" in rest else None
    for key in ((path, None), (path, param)):
        if key in MEMBERS:
            return MEMBERS[key]
    return f"{path}[{param}]" if path in BY_PARAMETER and param is not None else path

# generative models generate with one torch thread each (2 workers on 2 cores)
GENERATIVE_ENV = {"OMP_NUM_THREADS": "1"}
BAD_DECODE = "tiny-llama-bad-decode"
BENCHMARK_FEW_RUNS = {"warmup": 1, "min_runs": 3, "max_runs": 8, "window": 2, "max_seconds": 2.0}
BENCHMARK_ENCODER_SIZES = {"batch": [1, 4]}


@dataclass(frozen=True)
class Run:
    """A finished `pt2flow run --json`: its exit code, stdout (one JSON document) and stderr."""

    returncode: int
    stdout: str
    stderr: str

    @classmethod
    def of(cls, proc: subprocess.CompletedProcess[str]) -> "Run":
        return cls(proc.returncode, proc.stdout, proc.stderr)

    @property
    def document(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.stdout))
        except json.JSONDecodeError as exc:
            raise AssertionError(f"not one JSON document ({exc}): {self.stdout[-2000:]}\n--- stderr ---\n{self.stderr[-4000:]}") from exc

    def models(self) -> dict[str, dict[str, Any]]:
        return {m["name"]: m for m in self.document["models"]}


@dataclass(frozen=True)
class Fleet:
    folder: Path  # the config's folder (the factories' modules beside it)
    shipped: Path  # the shipped config, its store set to the fleet's
    config: Path  # the config that built the store: the shipped one plus what the fleet adds
    store: str
    cold: Run  # the first run into the fresh store: every model built (generative: the shipped config's models)
    warm: Run  # `config` run again: every stage served from the index
    fault: Run | None = None  # generative: `config`'s first run, building only the bad decode model

    def copy_store(self, target: Path) -> str:
        """A copy of the store for a test that changes it (the fleet's own store stays as built)."""
        shutil.copytree(self.store, target)
        return str(target)


def in_group(request: pytest.FixtureRequest, group: str) -> None:
    """A test using a fleet must be in its xdist group, or another worker would build it again."""
    from tests.session import grouped

    if not grouped(request.config):
        return
    assert group_of(request.node.nodeid) == group, f"{request.node.nodeid} uses the {group!r} fleet: list it in tests/fleets.py MEMBERS"


def build_generative(folder: Path) -> Fleet:
    """configs/generative.yaml run cold into a fresh store; the fleet with the bad decode model
    added run once (only that model builds) and once more (warm)."""
    for module in ("configs/generative_models.py", "tests/generative_faults.py"):
        shutil.copy(ROOT / module, folder / Path(module).name)
    store = folder / "store"
    config = yaml.safe_load((ROOT / "configs" / "generative.yaml").read_text())
    config["store"] = str(store)
    shipped = folder / "generative.yaml"
    shipped.write_text(yaml.safe_dump(config, sort_keys=False))
    llama = next(m for m in config["models"] if m["name"] == "tiny-llama")
    config["models"].append({**llama, "name": BAD_DECODE, "factory": "generative_faults:tiny_llama_bad_decode"})
    with_fault = folder / "generative-with-fault.yaml"
    with_fault.write_text(yaml.safe_dump(config, sort_keys=False))
    cold = Run.of(run_cli(["run", str(shipped), "--json"], env=GENERATIVE_ENV, timeout=1800))
    # the run with the bad decode model and the warm run from this process (their documents and
    # exit codes are what tests read; the cold run's stderr is read too: the binary's)
    fault, warm = (Run.of(run_as_cli(with_fault)) for _ in range(2))
    return Fleet(folder, shipped, with_fault, str(store), cold, warm, fault)


def build_targets(folder: Path) -> Fleet:
    """configs/targets.yaml as shipped plus the benchmark stage, cold then warm."""
    shutil.copy(ROOT / "configs" / "demo_models.py", folder / "demo_models.py")
    store = folder / "store"
    config = yaml.safe_load((ROOT / "configs" / "targets.yaml").read_text())
    config["store"] = str(store)
    shipped = folder / "targets-shipped.yaml"
    shipped.write_text(yaml.safe_dump(config, sort_keys=False))
    config["stages"] = [*config["stages"], "benchmark"]
    config["defaults"]["benchmark"] = BENCHMARK_FEW_RUNS
    for model in config["models"]:
        if model["name"] == "tiny-encoder":
            model["stages"] = {**model.get("stages", {}), "benchmark": {"sizes": BENCHMARK_ENCODER_SIZES}}
    path = folder / "targets.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    cold = Run.of(run_cli(["run", str(path), "--json"], timeout=1800))
    warm = Run.of(run_as_cli(path))  # from this process: every stage served from the index
    return Fleet(folder, shipped, path, str(store), cold, warm)


@pytest.fixture(scope="session")
def _generative_fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    return build_generative(tmp_path_factory.mktemp("generative-fleet"))


@pytest.fixture(scope="session")
def _targets_fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    return build_targets(tmp_path_factory.mktemp("targets-fleet"))


@pytest.fixture
def generative_fleet(request: pytest.FixtureRequest, _generative_fleet: Fleet) -> Fleet:
    in_group(request, GENERATIVE_GROUP)
    return _generative_fleet


@pytest.fixture
def targets_fleet(request: pytest.FixtureRequest, _targets_fleet: Fleet) -> Fleet:
    in_group(request, TARGETS_GROUP)
    return _targets_fleet
