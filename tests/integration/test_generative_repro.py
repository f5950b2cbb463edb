"""`pt2flow repro` of a generative model's component (issue 34).

Two tiny random Llamas, written by the test into the config's folder:

- `branchy`: its forward takes a data-dependent branch for a one-token input only, so `prefill`
  exports and `decode`'s trace fails (`decode: data_dependent: GuardOnDataDependentSymNode: ...`).
  `repro branchy` writes the decomposition and transformers' DynamoExporter call for `decode`; the
  script, run in a fresh process, raises the recorded exception (class and message) and imports
  nothing of pt2flow.
- `shifted`: its logits go through a custom operator with no core ATen decomposition, so every
  component exports and `prefill`'s decompose fails: the script of that later stage loads the
  component's program (transformers' cache classes registered as pytrees first) and fails as before.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_as_cli, run_cli, write_config

pytestmark = pytest.mark.integration

pytest.importorskip("transformers")

MODELS = textwrap.dedent('''\
    """Tiny random Llamas that fail at one component's stage, for test_generative_repro."""
    from typing import Any

    import torch

    CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


    @torch.library.custom_op("pt2flow_genrepro::shift", mutates_args=())
    def shift(x: torch.Tensor) -> torch.Tensor:
        return x + 1


    @shift.register_fake
    def _shift_fake(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)


    def _tiny(forward_after: Any) -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM

        class Tiny(LlamaForCausalLM):
            def forward(self, input_ids=None, **kwargs):
                return forward_after(input_ids, super().forward(input_ids=input_ids, **kwargs))

        model = Tiny(LlamaConfig(**CONFIG))
        model.generation_config.eos_token_id = None
        model.config.eos_token_id = None
        return model.eval()


    def _branch_on_one_token(input_ids, out):
        # data-dependent for a one-token step only: prefill exports, decode does not
        if input_ids is not None and input_ids.shape[-1] == 1 and input_ids.sum() > 0:
            out.logits = out.logits + 1
        return out


    def _shift(input_ids, out):
        out.logits = shift(out.logits)
        return out


    def branchy() -> Any:
        return _tiny(_branch_on_one_token)


    def shifted() -> Any:
        return _tiny(_shift)
    ''')

# runs a repro script as `python repro.py` would, then reports what it raised and whether any
# module of pt2flow was imported
RUNNER = textwrap.dedent("""\
    import json, runpy, sys
    outcome = {"class": None, "message": None}
    try:
        runpy.run_path(sys.argv[1], run_name="__main__")
    except BaseException as exc:
        outcome = {"class": type(exc).__name__, "message": str(exc)}
    outcome["pt2flow"] = sorted(name for name in sys.modules if name.split(".")[0] == "pt2flow")
    print("OUTCOME " + json.dumps(outcome))
    """)

ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("generative-repro")
    (folder / "failing_generative.py").write_text(MODELS)
    store = str(folder / "store")
    generate = {"prompt_lens": [2], "max_new_tokens": 4, "cache": "static", "max_cache_len": 32}
    config = write_config(
        folder / "failing.yaml",
        [
            {"name": "branchy", "factory": "failing_generative:branchy", "generate": generate},
            {"name": "shifted", "factory": "failing_generative:shifted", "generate": generate},
        ],
        store=store,
        stages=["trace", "decompose"],
    )
    run = run_as_cli(config, workers=2)  # from this process: its document is what is read
    assert run.returncode == 1, (run.stdout[-3000:], run.stderr[-5000:])
    models = {m["name"]: m for m in json.loads(run.stdout)["models"]}
    repros = {}
    for target in ("branchy", "shifted"):
        made = run_cli(["repro", target, "-o", str(folder / f"repro-{target}"), "--store", store, "--json"])
        assert made.returncode == 0, made.stderr[-3000:]
        repros[target] = json.loads(made.stdout)
    runner = folder / "runner.py"
    runner.write_text(RUNNER)
    # both scripts at once, each in a fresh interpreter, from a folder that is not the repository
    running = {
        target: subprocess.Popen(
            [sys.executable, str(runner), str(Path(made["dir"]) / "repro.py")],
            cwd=str(tmp_path_factory.mktemp("cwd")),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**_plain_env(), **ENV},
        )
        for target, made in repros.items()
    }
    outcomes = {}
    for target, proc in running.items():
        out, err = proc.communicate(timeout=600)
        lines = [line for line in out.splitlines() if line.startswith("OUTCOME ")]
        assert lines, (out[-2000:], err[-3000:])
        outcomes[target] = json.loads(lines[-1].removeprefix("OUTCOME "))
    return {"models": models, "repros": repros, "outcomes": outcomes, "store": store, "folder": folder}


def _plain_env() -> dict[str, str]:
    """The environment without the PYTHONPATH the CLI gets (the repository on sys.path)."""
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_a_component_that_fails_to_export_fails_the_model_with_its_name(fleet: dict[str, Any]) -> None:
    model = fleet["models"]["branchy"]
    assert model["status"] == "failed" and model["failed_stage"] == "trace" and model["error_class"] == "data_dependent"
    assert model["error"].startswith("decode: data_dependent: GuardOnDataDependentSymNode: "), model["error"]
    assert model["components"]["prefill"]["stages"]["trace"]["status"] == "ok"


def test_repro_writes_the_components_decomposition_and_export(fleet: dict[str, Any]) -> None:
    made = fleet["repros"]["branchy"]
    assert made["model"] == "branchy/decode" and made["stage"] == "trace" and made["error_class"] == "data_dependent"
    assert made["files"] == ["repro.py"]  # no weights: the factory's seeded init
    script = (Path(made["dir"]) / "repro.py").read_text()
    assert "pt2flow" not in "\n".join(line for line in script.splitlines() if "import" in line)
    assert "decompose_for_generation(" in script and "DynamoExporter().export_program(" in script
    assert (
        "decomposed['decode']" in script
        and "cache_implementation = 'static'" in script
        and "max_cache_len = 32" in script
    )


def test_the_component_script_raises_the_recorded_exception_without_pt2flow(fleet: dict[str, Any]) -> None:
    made, outcome = fleet["repros"]["branchy"], fleet["outcomes"]["branchy"]
    recorded_class, _, recorded = made["error"].partition(": ")  # short_message: "Class: message"
    assert outcome["class"] == recorded_class == "GuardOnDataDependentSymNode", outcome
    assert outcome["message"].splitlines()[0] == recorded.splitlines()[0], (outcome["message"][:500], recorded[:500])
    assert outcome["pt2flow"] == [], outcome["pt2flow"]


def test_a_later_stage_of_a_component_still_loads_its_program(fleet: dict[str, Any]) -> None:
    made, outcome = fleet["repros"]["shifted"], fleet["outcomes"]["shifted"]
    assert (
        made["model"] == "shifted/prefill" and made["stage"] == "decompose" and made["error_class"] == "decomposition"
    )
    assert made["files"] == ["program.pt2", "repro.py"]
    script = (Path(made["dir"]) / "repro.py").read_text()
    assert "register_cache_pytrees_for_model" in script
    assert outcome["class"] == "RuntimeError", outcome
    assert (
        "ops outside core ATen remain after decomposition" in outcome["message"]
        and "pt2flow_genrepro.shift.default" in outcome["message"]
    )
    assert outcome["pt2flow"] == [], outcome["pt2flow"]
