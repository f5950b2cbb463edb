"""A stage written the way pt2flow's own are (flows/builtin/: one module), here in this one test
file, is known everywhere a built-in is: the pipeline order (its `position`), the config schema,
the CLI's choices, lineage order, `get` kinds, validate's candidates, `audit` (its `rebuild`) and
`repro` (its template). Nothing else in the tree names it.

`optimized` rewrites the functional program with chosen decompositions (a platform team's graph
pass) and stores it as an archive; validate runs that archive beside eager, audit rebuilds it from
its parent program, and with `forbid` it fails, with class unsupported_op, on a program that still
calls a forbidden operator. It joins through the entry point group `pt2flow.stages`, as a
distribution's stage does (tests/integration/test_plugin_stage.py), in the CLI and its workers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import pytest
from pydantic import BaseModel, ConfigDict

from pt2flow.flows.pipeline import Input, Stage
from tests.conftest import ROOT, run_cli, write_config


class OptimizedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    decompose: tuple[str, ...] = ("aten.linear.default",)  # ops rewritten by torch's default decompositions
    forbid: tuple[str, ...] = ()  # ops the result may not call (unsupported_op)


def _rewrite(program: Any, options: OptimizedOptions) -> Any:
    import torch

    table = torch.export.default_decompositions()
    wanted = {op: fn for op, fn in table.items() if str(op) in options.decompose}
    return program.run_decompositions(wanted)


def compute(call: Any) -> Any:
    from pt2flow.stages.errors import StageError
    from pt2flow.stages.result import StageResult
    from pt2flow.stages.vocabulary import ErrorClass

    options = call.options(OptimizedOptions)
    program = _rewrite(call.program(), options)
    left = sorted({str(n.target) for n in program.graph.nodes if n.op == "call_function"} & set(options.forbid))
    if left:
        raise StageError(ErrorClass.UNSUPPORTED_OP, f"forbidden operators left after the rewrite: {', '.join(left)}")
    return call.publish_program(StageResult(output=program, metadata={"nodes": len(program.graph.nodes)}))


def load(data: bytes) -> Any:
    """The archive as a runner of flat tensor lists (validate's and check-compat's candidate)."""
    import torch.utils._pytree as pytree

    from pt2flow.stages.serialize import load_archive

    program = load_archive(data)[0]
    module = program.module()

    def run(flat: Sequence[Any]) -> list[Any]:
        args, kwargs = pytree.tree_unflatten(list(flat), program.call_spec.in_spec)
        return [leaf for leaf in pytree.tree_leaves(module(*args, **kwargs))]

    return run


def rebuild(call: Any) -> str | None:
    from pt2flow.stages.serialize import stored_program

    return (
        stored_program(_rewrite(call.parent, OptimizedOptions(**call.options))).fingerprint
        if call.parent is not None
        else None
    )


def repro(job: Any) -> str:
    options = OptimizedOptions(**job.options)
    return job.program() + textwrap.dedent(f"""\
        table = torch.export.default_decompositions()
        ep = ep.run_decompositions({{op: fn for op, fn in table.items() if str(op) in {options.decompose!r}}})
        left = sorted({{str(n.target) for n in ep.graph.nodes if n.op == "call_function"}} & set({options.forbid!r}))
        if left:
            raise RuntimeError("forbidden operators left after the rewrite: " + ", ".join(left))
        """)


STAGE = Stage(
    "optimized",
    1,
    compute=f"{__name__}:compute",
    inputs=(Input("program", ("functionalize", "trace")),),
    options=OptimizedOptions,
    publishes="optimized",
    artifact="optimized",
    suffix=".pt2",
    candidate=f"{__name__}:load",
    repro=f"{__name__}:repro",
    rebuild=f"{__name__}:rebuild",
    accepts_training=False,
    position=45,
    description="the functional program with chosen ops decomposed",
)

pytestmark = pytest.mark.integration

STAGES = ["trace", "functionalize", "serialize", "optimized", "validate"]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("site")
    info = site / "pt2flow_optimized-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pt2flow-optimized\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[pt2flow.stages]\noptimized = {__name__}:STAGE\n")
    return {"PYTHONPATH": f"{site}:{ROOT}"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("optimized")
    models = [
        {
            "name": "mlp",
            "factory": "tests.models:tiny_mlp",
            "inputs": {"x": {"shape": [4, 8]}},
            "dynamic_shapes": {"x": {0: "batch"}},
            "dims": {"batch": {"min": 1, "max": 16}},
        },
        {
            "name": "strict",
            "factory": "tests.models:tiny_mlp",
            "kwargs": {"hidden": 12},
            "inputs": {"x": {"shape": [3, 8]}},
            "stages": {"optimized": {"forbid": ["aten.relu.default"]}},
        },
    ]
    config = write_config(folder / "optimized.yaml", models, stages=STAGES, defaults={"validate": {"samples": 3}})
    store = str(folder / "store")
    cold = run_cli(["run", str(config), "--store", store, "--json"], env=env)
    return {"cold": cold, "store": store, "config": config, "folder": folder}


def test_its_place_comes_from_its_declaration(env: dict[str, str]) -> None:
    """Position 45 puts it after serialize (40) and before aot_compile (50) in the order every
    stage list keeps; the config schema gets its options section; the CLI offers its kind."""
    code = "from pt2flow.flows import pipeline; import json; print(json.dumps([pipeline.names(), pipeline.candidates(), pipeline.lineage_order()]))"
    names, candidates, lineage = json.loads(
        subprocess.run(
            [sys.executable, "-c", code],
            env={**_base_env(), **env},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
    )
    assert names[names.index("serialize") + 1] == "optimized" and names[names.index("optimized") + 1] == "aot_compile"
    assert "optimized" in candidates and lineage.index("optimized") < lineage.index("validate")
    schema = json.loads(run_cli(["schema"], env=env).stdout)
    assert "optimized" in json.dumps(schema) and "forbid" in json.dumps(schema)
    assert "optimized" in run_cli(["get", "--help"], env=env).stdout
    wrong = write_config(
        Path(env["PYTHONPATH"].split(":")[0]) / "wrong.yaml",
        [{"name": "m", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [2, 8]}}}],
        stages=["trace", "functionalize", "optimized", "serialize", "validate"],
    )
    refused = run_cli(["validate", str(wrong)], env=env)
    assert refused.returncode == 2 and "stages must keep the pipeline order" in refused.stderr
    assert "'serialize', 'optimized', 'aot_compile'" in refused.stderr


def _base_env() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_it_runs_is_validated_and_lineage_lists_it_in_order(fleet: dict[str, Any], env: dict[str, str]) -> None:
    cold = fleet["cold"]
    assert cold.returncode == 1, cold.stderr[-3000:]  # `strict` fails at optimized; mlp is ok
    models = {m["name"]: m for m in json.loads(cold.stdout)["models"]}
    assert list(models["mlp"]["stages"]) == STAGES and models["mlp"]["status"] == "ok"
    assert models["strict"]["failed_stage"] == "optimized" and models["strict"]["error_class"] == "unsupported_op"
    store = fleet["store"]
    report_row = next(
        r
        for r in json.loads(
            run_cli(["ls", "--store", store, "--model", "mlp", "--stage", "validate", "--json"], env=env).stdout
        )
    )
    report = json.loads(run_cli(["show", report_row["sha256"], "--store", store, "--json"], env=env).stdout)
    candidates = report["report"]["candidates"]
    assert (
        "optimized" in candidates and candidates["optimized"]["max_abs_err"] < 1e-4
    )  # run beside eager at batch 1 and 16
    assert [s["sizes"] for s in report["report"]["plan"]] == [
        {},
        {"batch": 1},
        {"batch": 16},
    ]  # the example, then the dim's edges
    lineage = json.loads(run_cli(["lineage", report_row["sha256"], "--store", store, "--json"], env=env).stdout)
    assert [a["stage"] for a in lineage["ancestors"]] == ["source", "trace", "functionalize", "serialize", "optimized"]


def test_get_hands_out_its_artifact_which_loads_in_a_plain_script(
    fleet: dict[str, Any], env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "mlp.optimized.pt2"
    got = run_cli(
        ["get", "--model", "mlp", "--artifact", "optimized", "-o", str(out), "--store", fleet["store"], "--json"],
        env=env,
    )
    assert got.returncode == 0, got.stderr
    script = (
        f"import torch; ep = torch.export.load({str(out)!r}); ops = {{str(n.target) for n in ep.graph.nodes if n.op == 'call_function'}}; "
        "print(sorted(ops)); assert 'aten.linear.default' not in ops; print(ep.module()(torch.randn(5, 8)).shape)"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "torch.Size([5" in ran.stdout  # the dynamic batch kept


def test_audit_rebuilds_it_from_its_parent(fleet: dict[str, Any], env: dict[str, str]) -> None:
    audited = run_cli(["audit", "--store", fleet["store"], "--config", str(fleet["config"]), "--json"], env=env)
    assert audited.returncode == 0, audited.stderr[-3000:]
    entries = [e for e in json.loads(audited.stdout)["records"] if e["stage"] == "optimized"]
    assert [e["model"] for e in entries] == ["mlp"]  # the ok record (the failed one is no cache entry)
    assert entries[0]["status"] == "ok" and entries[0]["rebuilt"] == entries[0]["fingerprint"] == entries[0]["stored"]


def test_its_failure_reproduces_from_its_template(fleet: dict[str, Any], env: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "repro"
    made = run_cli(["repro", "strict", "-o", str(folder), "--store", fleet["store"], "--json"], env=env)
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["stage"] == "optimized"
    ran = subprocess.run(
        [sys.executable, str(folder / "repro.py")], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert ran.returncode != 0 and "forbidden operators left after the rewrite: aten.relu.default" in ran.stderr


def test_a_stage_whose_library_is_missing_is_refused_naming_its_extra(tmp_path: Path) -> None:
    """A declaration's `libraries` and `extra` are all pt2flow needs to refuse a config naming a
    stage it cannot run, before anything runs (no list of targets to keep up to date)."""
    from pt2flow.flows import pipeline
    from pt2flow.flows.config import ConfigError, load_config

    needy = Stage(
        "needy",
        1,
        compute=f"{__name__}:compute",
        inputs=(Input("program", ("trace",)),),
        libraries=("no_such_module_for_pt2flow",),
        extra="needy",
        publishes="needy",
        position=46,
    )
    pipeline.register(needy)
    try:
        config = write_config(
            tmp_path / "needy.yaml",
            [{"name": "m", "factory": "tests.models:tiny_mlp", "inputs": {"x": {"shape": [2, 8]}}}],
            stages=["trace", "needy"],
        )
        with pytest.raises(ConfigError) as info:
            load_config(str(config))
        assert "no_such_module_for_pt2flow" in str(info.value) and "pt2flow[needy]" in str(info.value)
    finally:
        pipeline.unregister("needy")
