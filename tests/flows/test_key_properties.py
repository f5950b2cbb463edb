"""Property tests of the cache keys (issue 19): for two models or configs that differ in exactly
one respect, whenever the artifacts differ the keys differ; the same model exported again, in
this process or a fresh one, gets the same key. Drawn by hypothesis, run for real: every program
is a real torch.export, every key the registry's own key function."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pt2flow.flows.config import load_config
from pt2flow.flows.engine.common.context import Outcome
from pt2flow.flows.engine.orchestrator.planner import source_key
from pt2flow.flows import pipeline
from pt2flow.flows.engine.orchestrator.stage_keys import stage_key
from pt2flow.stages.program import fingerprint

ROOT = Path(__file__).resolve().parents[2]
OPS = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything about a small model and its example input that can change its program."""

    features: int = 4
    batch: int = 2
    dtype: str = "float32"
    dynamic_max: int | None = None  # None: static batch
    weight_seed: int = 0
    buffer: float = 0.0
    constant: float = 1.0
    op: str = "relu"


class Net(torch.nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        torch.manual_seed(spec.weight_seed)
        self.fc = torch.nn.Linear(spec.features, 3)
        self.register_buffer("offset", torch.full((3,), spec.buffer))
        self.constant, self.op = spec.constant, OPS[spec.op]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.fc(x) + self.offset) * self.constant


def export(spec: Spec) -> torch.export.ExportedProgram:
    dtype = getattr(torch, spec.dtype)
    net = Net(spec).to(dtype)
    example = torch.randn(spec.batch, spec.features, dtype=dtype)
    dynamic = ({0: torch.export.Dim("batch", min=1, max=spec.dynamic_max)},) if spec.dynamic_max else None
    return torch.export.export(net, (example,), dynamic_shapes=dynamic)


# one respect changed at a time
CHANGES = st.one_of(
    st.builds(lambda v: ("features", v), st.integers(5, 8)),
    st.builds(lambda v: ("batch", v), st.integers(3, 6)),
    st.just(("dtype", "float64")),
    st.builds(lambda v: ("dynamic_max", v), st.integers(8, 64)),
    st.builds(lambda v: ("weight_seed", v), st.integers(1, 10_000)),
    st.builds(lambda v: ("buffer", v), st.floats(0.5, 4.0)),
    st.builds(lambda v: ("constant", v), st.floats(1.5, 4.0)),
    st.sampled_from([("op", "tanh"), ("op", "sigmoid")]),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(change=CHANGES)
def test_programs_that_differ_in_one_respect_have_different_fingerprints(change: tuple[str, Any]) -> None:
    base = Spec()
    other = dataclasses.replace(base, **{change[0]: change[1]})
    a, b = export(base), export(other)
    assert fingerprint(a) == fingerprint(export(base))  # the same model exported again
    assert fingerprint(a) != fingerprint(b), change
    # and every key downstream of the program differs too
    model = _model({})
    for stage in ("functionalize", "decompose", "serialize"):
        keys = {stage_key(pipeline.get(stage), model, {"program": Outcome(fingerprint=fingerprint(p))}) for p in (a, b)}
        assert len(keys) == 2, stage


def test_a_dynamic_range_change_alone_changes_the_fingerprint() -> None:
    assert fingerprint(export(Spec(dynamic_max=16))) != fingerprint(export(Spec(dynamic_max=32)))


FRESH = """
import sys, torch
sys.path.insert(0, sys.argv[1])
if sys.argv[2:] == ["warm"]:  # what a fork server does before its first worker that exports (stages/warmup.py)
    from pt2flow.stages.warmup import warm_up
    assert warm_up()
from tests.flows.test_key_properties import Spec, export
from tests.hf_models import bert_tiny
from pt2flow.stages.program import fingerprint
ids = torch.randint(0, 100, (2, 8))
print(fingerprint(export(Spec(dynamic_max=16, op="tanh"))))
print(fingerprint(torch.export.export(bert_tiny(), (ids,), {"attention_mask": torch.ones_like(ids)})))
"""


@pytest.mark.integration  # exports in fresh processes
def test_re_exports_in_fresh_processes_give_equal_fingerprints() -> None:
    """Two fresh processes, the second after the fork server's warm-up (torch's first export done
    on a meta-device module first, as every forked worker has it), and this process."""
    runs = [
        subprocess.run(
            [sys.executable, "-c", FRESH, str(ROOT), *extra], capture_output=True, text=True, check=True, cwd="/"
        )
        for extra in ([], ["warm"])
    ]
    first, second = (r.stdout.split() for r in runs)
    assert len(first) == 2 and first == second
    assert first[0] == fingerprint(export(Spec(dynamic_max=16, op="tanh")))  # and in this process


# --- keys of what is not in the program: stage options, device, code, distributions -----------


def _model(model_extra: dict[str, Any], defaults: dict[str, Any] | None = None, folder: Path | None = None) -> Any:
    folder = folder or Path(__import__("tempfile").mkdtemp())
    config = {
        "version": 1,
        "defaults": defaults or {},
        "models": [
            {"name": "m", "factory": "tests.models:plain", "inputs": {"input": {"shape": [2, 8]}}, **model_extra}
        ],
    }
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return load_config(path).models[0]


OPTION_CHANGES = st.sampled_from(
    [
        ("trace", {"strict": True}),
        ("trace", {"fallback": False}),
        ("functionalize", {"mode": "training"}),
        ("decompose", {"preserve": ["aten.linear.default"]}),
        ("decompose", {"table": "none"}),
        ("aot_compile", {"inductor_configs": {"max_autotune": True}}),
        ("aot_compile", {"device": "cuda"}),
    ]
)


@settings(max_examples=10, deadline=None)
@given(change=OPTION_CHANGES)
def test_one_option_or_the_device_changes_the_keys_of_its_stage(change: tuple[str, dict[str, Any]]) -> None:
    stage, options = change
    base, other = _model({}), _model({"stages": {stage: options}})
    inputs = {"source": Outcome(key="s" * 64), "program": Outcome(fingerprint="f" * 64)}
    keyed = "trace" if stage == "functionalize" else stage  # the mode decides what trace exports
    spec = pipeline.get(keyed)
    assert stage_key(spec, base, inputs) != stage_key(spec, other, inputs)


@settings(max_examples=10, deadline=None)
@given(entry=st.sampled_from(["files", "distributions"]), value=st.text("0123456789abcdef.", min_size=1, max_size=12))
def test_a_helper_file_or_a_distribution_version_changes_the_source_key(entry: str, value: str) -> None:
    manifest = {
        "factory": "m:f",
        "deps": {"files": {"helpers.py": "a" * 64}, "distributions": {"torch": "2.13.0", "transformers": "5.23.0"}},
    }
    changed = json.loads(json.dumps(manifest))
    name = "helpers.py" if entry == "files" else "transformers"
    if changed["deps"][entry][name] == value:
        value += "0"
    changed["deps"][entry][name] = value
    assert source_key(manifest) != source_key(changed)
    assert source_key(manifest) == source_key(json.loads(json.dumps(manifest)))
