"""`pt2flow validate` checks what a run would otherwise fail on at its model (issue 23, item 4):
weights and inputs files exist, factory modules import in a worker process (isolated as a run's
stages are), and the input names match the model's forward(). Real configs, real worker
processes, the real CLI."""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import pytest

from pt2flow.flows.engine.worker.model_check import argument_problems
from pt2flow.flows.engine.orchestrator.preflight import preflight
from pt2flow.flows.config import load_config
from tests.conftest import run_cli

MODELS = """\
import os
import torch
from torch import nn


class Two(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.lin = nn.Linear(n, 2)

    def forward(self, x, mask=None):
        return self.lin(x)


def two(n=4):
    return Two(n)


def needs_real_weights():
    model = Two()
    float(model.lin.weight.sum())  # cannot run on the meta device
    return model


def not_a_module():
    return 3


def inputs_wrong():
    return {"x": torch.randn(2, 4), "y": torch.randn(2)}


def inputs_positional():
    return (torch.randn(2, 4),), {"mask": torch.ones(2, 4)}


def inputs_too_many():
    return (torch.randn(2, 4), torch.ones(2, 4), torch.ones(2)), {}


def inputs_not_meta():
    return {"x": torch.tensor([[1.0, 2.0, 3.0, 4.0]]) * float(torch.ones(1))}


def inputs_bad_shape():
    return [torch.randn(2, 4)]


def always_raises():
    raise ValueError("checkpoint format 3 is not supported by this factory")


def inputs_always_raise():
    raise KeyError("no such split: validation")


def _refuse_meta():
    if torch.empty(0).device.type == "meta":
        raise NotImplementedError("this factory reads real tensors")


def big_on_cpu():
    _refuse_meta()
    hold = torch.ones(400 * 2**20)  # 1.6 GB written: over a limit of 0.8 GiB
    return Two()


def slow_on_cpu():
    _refuse_meta()
    import time
    time.sleep(60)
    return Two()
"""

RAISES = 'raise RuntimeError("this module refuses to import")\n\ndef f():\n    pass\n'
EXITS = "import os\nos._exit(7)\n\ndef f():\n    pass\n"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A config's folder holding its model modules (found through the config's folder, not PYTHONPATH)."""
    root = tmp_path / "fleet"
    root.mkdir()
    (root / "vmodels.py").write_text(MODELS)
    (root / "vraising_factory.py").write_text(
        "def model():\n    raise RuntimeError('tokenizer.json is missing from the checkpoint folder')\n"
    )
    (root / "vraises.py").write_text(RAISES)
    (root / "vexits.py").write_text(EXITS)
    return root


def config(folder: Path, body: str) -> Path:
    path = folder / "fleet.yaml"
    path.write_text("version: 1\nstages: [trace, serialize]\nmodels:\n" + textwrap.indent(textwrap.dedent(body), "  "))
    return path


@pytest.mark.integration  # builds the models in worker processes
def test_each_problem_at_its_yaml_path_and_every_one_at_once(folder: Path) -> None:
    path = config(
        folder,
        """\
        - name: no-weights
          factory: vmodels:two
          weights: checkpoints/missing.safetensors
          inputs: {x: {shape: [2, 4], dtype: float32}}
        - name: raises-on-import
          factory: vraises:f
          inputs: {x: {shape: [2, 4], dtype: float32}}
        - name: wrong-names
          factory: vmodels:two
          inputs: {x: {shape: [2, 4], dtype: float32}, y: {shape: [2], dtype: float32}}
        - name: required-left-out
          factory: vmodels:Two
          inputs: {mask: {shape: [2, 4], dtype: float32}}
        - name: exits-on-import
          factory: vexits:f
          inputs: {x: {shape: [2, 4], dtype: float32}}
        - name: not-a-module
          factory: vmodels:not_a_module
          inputs: {x: {shape: [2, 4], dtype: float32}}
        - name: fine-after-all-that
          factory: vmodels:two
          inputs: {x: {shape: [2, 4], dtype: float32}}
        """,
    )
    load_config(path)  # the config's own checks pass: each problem below needs a file or the code
    proc = run_cli(["validate", str(path)], cwd=folder.parent, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == f"{path}: 6 problems in the config:"
    assert (
        lines[1] == f"  {path}:6: models[0].weights: file not found: {folder / 'checkpoints' / 'missing.safetensors'}"
    )
    assert (
        lines[2]
        == f"  {path}:9: models[1].factory: importing 'vraises' failed: RuntimeError: this module refuses to import"
    )
    assert lines[3] == f"  {path}:13: models[2].inputs.y: forward() has no parameter 'y' (it takes x, mask)"
    assert lines[4] == f"  {path}:16: models[3].inputs: forward() requires 'x', which the inputs do not give"
    assert lines[5].startswith(
        f"  {path}:18: models[4].factory: crash while importing or building it: the worker process (pid "
    ) and lines[5].endswith("exited with code 7"), lines[5]
    assert lines[6] == f"  {path}:21: models[5].factory: the factory returned int, expected a torch.nn.Module"
    assert len(lines) == 7  # the last model is fine, in a fresh worker after the one that exited


@pytest.mark.integration  # builds the models in worker processes
def test_a_good_config_passes_and_a_model_that_refuses_meta_is_built_on_the_cpu(folder: Path) -> None:
    (folder / "weights.pt").write_bytes(b"not read by validate: it only has to exist")
    path = config(
        folder,
        """\
        - name: good
          factory: vmodels:two
          weights: weights.pt
          inputs: {x: {shape: [2, 4], dtype: float32}, mask: {shape: [2, 4], dtype: float32}}
        - name: meta-refuses
          factory: vmodels:needs_real_weights
          inputs: {x: {shape: [2, 4], dtype: float32}}
        """,
    )
    elsewhere = folder.parent  # files and modules resolve against the config's folder
    proc = run_cli(["validate", str(path), "--json"], cwd=elsewhere, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["valid"] is True and doc["models"] == ["good", "meta-refuses"] and doc["imported"] == 2
    assert doc["notes"] == []  # the meta device refused it; the CPU built it and forward() was checked
    proc = run_cli(["validate", str(path)], cwd=elsewhere, timeout=300)
    assert proc.returncode == 0 and f"{path}: ok — 2 model(s)" in proc.stdout and proc.stderr == ""


def test_no_import_checks_files_only(folder: Path) -> None:
    path = config(
        folder,
        """\
        - name: raises-on-import
          factory: vraises:f
          weights: absent.pt
          inputs: {x: {shape: [2, 4], dtype: float32}}
        """,
    )
    proc = run_cli(["validate", str(path), "--no-import"], timeout=120)
    assert proc.returncode == 2
    assert f"models[0].weights: file not found: {folder / 'absent.pt'}" in proc.stderr and "vraises" not in proc.stderr


def test_weights_on_s3_are_asked_for_with_one_request(folder: Path, moto_s3) -> None:
    import boto3

    boto3.client("s3", endpoint_url=moto_s3.url).put_object(
        Bucket=moto_s3.bucket, Key="ckpt/present.safetensors", Body=b"x"
    )
    model = load_config(
        config(
            folder,
            f"""\
        - name: present
          factory: vmodels:two
          weights: s3://{moto_s3.bucket}/ckpt/present.safetensors
          inputs: {{x: {{shape: [2, 4], dtype: float32}}}}
        - name: absent
          factory: vmodels:two
          weights: s3://{moto_s3.bucket}/ckpt/absent.safetensors
          inputs: {{x: {{shape: [2, 4], dtype: float32}}}}
        """,
        )
    ).models
    found = preflight(model, imports=False)
    assert [(f.path, f.message) for f in found.problems] == [
        (("models", 1, "weights"), f"not found: s3://{moto_s3.bucket}/ckpt/absent.safetensors")
    ]
    assert found.notes == []


def _sig(text: str) -> inspect.Signature:
    namespace: dict = {}
    exec(f"def forward({text}): pass", namespace)
    return inspect.signature(namespace["forward"])


@pytest.mark.parametrize(
    ("params", "names", "expected"),
    [
        ("x, mask=None", ["x"], []),
        ("x, mask=None", ["x", "mask"], []),
        ("x, mask=None", ["x", "y"], [(("inputs", "y"), "forward() has no parameter 'y' (it takes x, mask)")]),
        ("x, **kwargs", ["x", "anything"], []),
        ("x, *rest", ["x", "rest"], []),  # *args takes its list by its name, as binding.py does
        ("x, *, scale", ["x"], [(("inputs",), "forward() requires 'scale', which the inputs do not give")]),
        ("x, y, /", ["x", "y"], []),
        ("", ["x"], [(("inputs", "x"), "forward() has no parameter 'x' (it takes none)")]),
    ],
)
def test_argument_names_against_forward(params: str, names: list[str], expected: list) -> None:
    assert argument_problems(_sig(params), names) == expected


@pytest.mark.integration  # builds the models in worker processes
def test_validate_imports_no_torch_in_the_calling_process(folder: Path) -> None:
    """The model's code is imported in the worker only: the caller stays torch- and Prefect-free."""
    import subprocess
    import sys

    path = config(
        folder,
        """\
        - name: good
          factory: vmodels:two
          inputs: {x: {shape: [2, 4], dtype: float32}}
        """,
    )
    code = (
        "import sys; from pt2flow.flows import api; doc = api.validate(sys.argv[1]);"
        "print(doc['imported'], sorted(m for m in ('torch', 'prefect', 'vmodels') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "1 []", proc.stderr


def with_inputs_factories(folder: Path, **models: str) -> Path:
    """A config of vmodels:two models, each with the inputs factory vmodels:<its value>."""
    return config(
        folder,
        "".join(
            f"- {{name: {name}, factory: 'vmodels:two', inputs_factory: 'vmodels:{make}'}}\n"
            for name, make in models.items()
        ),
    )


@pytest.mark.integration  # builds the models in worker processes
def test_an_inputs_factorys_names_are_checked_on_the_meta_device(folder: Path) -> None:
    path = with_inputs_factories(
        folder,
        wrong_names="inputs_wrong",
        positional_then_named="inputs_positional",
        too_many="inputs_too_many",
        not_args_kwargs="inputs_bad_shape",
    )
    proc = run_cli(["validate", str(path)], cwd=folder.parent, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == f"{path}: 3 problems in the config:"
    assert lines[1] == f"  {path}:4: models[0].inputs_factory: forward() has no parameter 'y' (it takes x, mask)"
    assert (
        lines[2] == f"  {path}:6: models[2].inputs_factory: forward() takes 2 positional argument(s), the inputs give 3"
    )
    assert lines[3].startswith(
        f"  {path}:7: models[3].inputs_factory: inputs_factory vmodels:inputs_bad_shape must give (args, kwargs)"
    ), lines[3]
    assert len(lines) == 4  # positional-then-named binds x then mask: no problem
    # a factory whose tensors must hold values refuses the meta device: it is called on the CPU
    path = with_inputs_factories(
        folder, positional_then_named="inputs_positional", needs_real_tensors="inputs_not_meta"
    )
    proc = run_cli(["validate", str(path), "--json"], cwd=folder.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["notes"] == []


@pytest.mark.parametrize(
    ("params", "positional", "names", "expected"),
    [
        ("x, mask=None", 1, ["mask"], []),  # x by position, mask by name
        ("x, mask=None", 2, [], []),
        ("x, mask=None", 3, [], [((), "forward() takes 2 positional argument(s), the inputs give 3")]),
        ("x, *rest", 4, [], []),  # the rest go to *rest
        (
            "x, *rest",
            1,
            ["y"],
            [(("inputs", "y"), "forward() has no parameter 'y' (it takes x, rest)")],
        ),  # names still checked
        ("x, *, scale", 1, [], [(("inputs",), "forward() requires 'scale', which the inputs do not give")]),
    ],
)
def test_an_inputs_factorys_positional_arguments_fill_the_first_parameters(
    params: str, positional: int, names: list[str], expected: list
) -> None:
    assert argument_problems(_sig(params), names, positional=positional) == expected


SIX_PROBLEMS = """\
    - name: unknown-key-and-undefined-dim
      factory: vmodels:two
      weigths: w.safetensors
      inputs: {x: {shape: [2, 4], dtype: float32}}
      dynamic_shapes: {x: {0: batch}}
    - name: no-colon
      factory: vmodels.two
      inputs: {x: {shape: [2, 4], dtype: float32}}
    - name: no-such-module
      factory: nosuchmodule:make
      inputs: {x: {shape: [2, 4], dtype: float32}}
    - name: missing-weights
      factory: vmodels:two
      weights: absent.safetensors
      inputs: {x: {shape: [2, 4], dtype: float32}}
    - name: wrong-input-name
      factory: vmodels:two
      inputs: {x: {shape: [2, 4], dtype: float32}, y: {shape: [2], dtype: float32}}
    - name: fine
      factory: vmodels:two
      inputs: {x: {shape: [2, 4], dtype: float32}}
    """


@pytest.mark.integration  # builds the models in worker processes
def test_six_problems_of_different_kinds_are_found_in_one_pass(folder: Path) -> None:
    """Issue 31: a schema problem (an unknown key) used to hide every deeper check, and the file
    and code checks ran only once the config's own checks passed: a user fixed 2, then met 4 more.
    One `validate` now names all six, each at its YAML path, in file order; fixing exactly those
    six leaves a config that validates."""
    path = config(folder, SIX_PROBLEMS)
    proc = run_cli(["validate", str(path)], cwd=folder.parent, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        f"{path}: 6 problems in the config:",
        f"  {path}:6: models[0].weigths: unknown key; did you mean `weights`?",
        f"  {path}:8: models[0].dynamic_shapes.x[0]: dim 'batch' has no definition under dims; "
        "define it: dims: {batch: {min: 1, max: 64}}",
        f"  {path}:10: models[1].factory: 'vmodels.two' is not of the form 'package.module:callable'",
        f"  {path}:13: models[2].factory: module 'nosuchmodule' not found (looked in {folder} and on sys.path)",
        f"  {path}:17: models[3].weights: file not found: {folder / 'absent.safetensors'}",
        f"  {path}:21: models[4].inputs.y: forward() has no parameter 'y' (it takes x, mask)",
    ], proc.stderr
    # ground truth: the six fixes, and nothing else, make the config valid (no second layer of problems)
    (folder / "absent.safetensors").write_bytes(b"validate only needs the file to exist")
    fixed = (
        SIX_PROBLEMS.replace("      weigths: w.safetensors\n", "      dims: {batch: {min: 1, max: 8}}\n")
        .replace("vmodels.two", "vmodels:two")
        .replace("nosuchmodule:make", "vmodels:two")
        .replace(", y: {shape: [2], dtype: float32}", "")
    )
    proc = run_cli(["validate", str(config(folder, fixed)), "--json"], cwd=folder.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["imported"] == 6 and doc["notes"] == [] and len(doc["models"]) == 6


@pytest.mark.integration  # builds the models in worker processes
def test_a_factory_that_raises_is_a_problem_with_its_message(folder: Path) -> None:
    """A factory that raises on the meta device is called again on the CPU (as the run's source
    stage would); raising there too is a problem carrying the exception, not a note and exit 0.
    A factory that only refuses the meta device builds on the CPU and has its inputs checked."""
    path = config(
        folder,
        """\
        - name: raises
          factory: vmodels:always_raises
          inputs: {x: {shape: [2, 4], dtype: float32}}
        - name: raises-too
          factory: vraising_factory:model
          inputs: {x: {shape: [2, 4], dtype: float32}}
        - name: inputs-raise
          factory: vmodels:two
          inputs_factory: vmodels:inputs_always_raise
        - name: cpu-only
          factory: vmodels:needs_real_weights
          inputs: {x: {shape: [2, 4], dtype: float32}, nonsense: {shape: [2, 4], dtype: float32}}
        """,
    )
    proc = run_cli(["validate", str(path)], cwd=folder.parent, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"{path}: 4 problems in the config:",
        f"  {path}:5: models[0].factory: the factory raised ValueError: checkpoint format 3 is not supported by this factory",
        f"  {path}:8: models[1].factory: the factory raised RuntimeError: tokenizer.json is missing from the checkpoint folder",
        f"  {path}:12: models[2].inputs_factory: inputs_factory vmodels:inputs_always_raise raised KeyError: 'no such split: validation'",
        f"  {path}:15: models[3].inputs.nonsense: forward() has no parameter 'nonsense' (it takes x, mask)",
    ], proc.stderr
    # ground truth outside pt2flow: the factory raises exactly that when called in a plain process
    import subprocess
    import sys

    plain = subprocess.run(
        [sys.executable, "-c", "import vraising_factory; vraising_factory.model()"],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    assert plain.returncode == 1 and plain.stderr.strip().endswith(
        "RuntimeError: tokenizer.json is missing from the checkpoint folder"
    )


@pytest.mark.integration  # builds the models in worker processes
def test_the_cpu_build_runs_within_the_models_limits(folder: Path) -> None:
    """The CPU attempt is the run's source stage in small: the model's memory ceiling and its
    source-stage time limit hold, and going over either is that model's problem."""
    path = config(
        folder,
        """\
        - name: big
          factory: vmodels:big_on_cpu
          inputs: {x: {shape: [2, 4], dtype: float32}}
          limits: {memory_gb: 0.8}
        - name: slow
          factory: vmodels:slow_on_cpu
          inputs: {x: {shape: [2, 4], dtype: float32}}
          limits: {stage_timeout_s: {source: 8}}
        - name: fine
          factory: vmodels:two
          inputs: {x: {shape: [2, 4], dtype: float32}}
        """,
    )
    proc = run_cli(["validate", str(path)], cwd=folder.parent, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == f"{path}: 2 problems in the config:" and len(lines) == 3, proc.stderr
    assert lines[1].startswith(
        f"  {path}:5: models[0].factory: out_of_memory while importing or building it: its processes used "
    ), lines[1]
    assert "GiB, over the limit of 0.80 GiB; its worker process (pid " in lines[1], lines[1]
    assert lines[2].startswith(
        f"  {path}:9: models[1].factory: timeout while importing or building it: importing and building it took over 8 s; "
    ), lines[2]


def test_what_the_schema_refuses_is_left_out_and_the_rest_still_checked(folder: Path) -> None:
    """check_config (used by run's load_config too): a refused key of a model, a refused top-level
    key or `defaults` section, and a model whose name is refused leave every other check running;
    the checks that would read a refused key are skipped, not misled (a refused `dims` does not
    make its dim "undefined")."""
    from pt2flow.flows.config import ConfigError
    from pt2flow.flows.config.load import check_config

    path = config(
        folder,
        """\
        - name: refused-dims
          factory: vmodels:two
          inputs: {x: {shape: [2, 4]}}
          dynamic_shapes: {x: {0: batch}}
          dims: {batch: {min: 0, max: 4}}
        - name: bad-option
          factory: vmodels:two
          inputs: {x: {shape: [2, 4], dtype: floatt}}
          stages: {validate: {atool: 1}}
        - name: 3
          factory: nosuch:x
        - name: undefined-dim
          factory: vmodels:two
          inputs: {x: {shape: [2, 4]}}
          dynamic_shapes: {x: {0: seq}}
        """,
    )
    path.write_text(
        path.read_text().replace(
            "stages: [trace, serialize]\n", "stagez: [trace]\ndefaults:\n  limits: {timeout_s: -1}\n"
        )
    )
    checked = check_config(path)
    assert checked.pipeline is None
    assert [(i.line, i.path, i.message.split(" (got")[0]) for i in checked.issues] == [
        # the schema's problems, then the inputs', then what the schema let through
        (4, "defaults.limits.timeout_s", "Input should be greater than 0"),
        (10, "models[0].dims.batch.min", "Input should be greater than or equal to 1"),
        (15, "models[2].name", "Input should be a valid string"),
        (2, "stagez", "unknown key; did you mean `stages`?"),
        (
            13,
            "models[1].inputs.x.dtype",
            "Input should be 'float32', 'float16', 'bfloat16', 'float64', 'int64', 'int32', 'int16', 'int8', 'uint8' or 'bool'",
        ),
        (
            14,
            "models[1].stages.validate.atool",
            "unknown key; did you mean `atol`?",
        ),  # the defaults' stage sections were sound: options checked
        (16, "models[2].factory", f"module 'nosuch' not found (looked in {folder} and on sys.path)"),
        (15, "models[2].inputs", "required key is missing"),
        (
            20,
            "models[3].dynamic_shapes.x[0]",
            "dim 'seq' has no definition under dims; define it: dims: {seq: {min: 1, max: 64}}",
        ),
    ]
    assert sorted(checked.models) == [0, 1, 2, 3]  # each is still given to validate's file and code checks
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert raised.value.issues == checked.issues
