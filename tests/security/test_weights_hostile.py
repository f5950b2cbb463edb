"""Checkpoints that would run code when unpickled are refused as `weights` errors, and the code never
runs: stages.source.load_state_dict directly, and `pt2flow run` end to end."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch

from pt2flow.stages.errors import StageError
from pt2flow.stages.source import load_state_dict
from tests.security.conftest import SecurityRun, evil_checkpoints

VARIANTS = sorted(evil_checkpoints(Path("/nonexistent/marker")))
FILENAMES = ["model.pt", "model.pth", "pytorch_model.bin", "model.safetensors"]


@pytest.mark.parametrize("filename", FILENAMES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_code_running_checkpoint_is_refused_and_the_code_never_runs(
    tmp_path: Path, variant: str, filename: str
) -> None:
    marker = tmp_path / "pwned"
    data = evil_checkpoints(marker)[variant]
    with pytest.raises(StageError) as info:
        load_state_dict(data, filename)
    assert info.value.error_class == "weights"
    assert info.value.message.startswith(f"{filename}: ")
    if not filename.endswith(".safetensors"):
        assert "refused to load (torch.load with weights_only=True)" in info.value.message
        assert "save a state_dict or use .safetensors" in info.value.message
        assert (
            "unsupported" in info.value.message.lower()
        )  # what torch refused, not its advice to use weights_only=False
        assert "False" not in info.value.message and "\x1b[" not in info.value.message
    assert not marker.exists()


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_payloads_are_live(tmp_path: Path, variant: str) -> None:
    """An unrestricted unpickler does run each payload, so the refusal above is what saves us."""
    marker = tmp_path / "ran"
    data = evil_checkpoints(marker)[variant]
    if variant.startswith("torch-"):
        torch.load(io.BytesIO(data), weights_only=False)
    else:
        pickle.loads(data)
    assert marker.exists()


def test_a_plain_state_dict_still_loads() -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    loaded = load_state_dict(buffer.getvalue(), "plain.pt")
    assert set(loaded) == {"w", "b"} and torch.equal(loaded["w"], state["w"])


@pytest.mark.integration
def test_pt2flow_run_refuses_the_checkpoint_as_a_weights_error(security_run: SecurityRun) -> None:
    run = security_run
    assert run.code == 1, run.stderr[-3000:]
    evil = run.model("evil")
    assert (evil["status"], evil["failed_stage"], evil["error_class"]) == ("failed", "trace", "weights")
    assert "evil.pt: refused to load (torch.load with weights_only=True)" in evil["error"]
    assert "Unsupported global: GLOBAL io.open was not an allowed global by default" in evil["error"]
    assert "weights_only` set to `False`" not in evil["error"]  # torch's advice to do the unsafe thing is cut
    assert "\x1b[" not in evil["error"]
    assert not run.marker.exists()
    assert "Traceback" not in run.stderr
    # one bad checkpoint does not stop the fleet
    assert run.model("mlp")["status"] == "ok"
    assert run.doc["summary"]["ok"] == 1 and run.doc["summary"]["failed"] == 1
