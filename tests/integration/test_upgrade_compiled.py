"""check-compat and upgrade-check on transformers models WITH their AOTInductor packages (the
default stages): a package records no pytree modules of its own, so a serving process (and
check-compat) must import the model archive's (transformers.modeling_outputs registers
BaseModelOutput...) before it loads. Without that, every transformers model with the default
stages was a false `regressed` (issue 30). Real runs, a real compile (tiny BERT: the mechanism
is the package's missing pytree modules, which one transformers model shows; DistilBERT's
archive goes through the same upgrade-check in tests/integration/test_upgrade_check.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_env, run_in_process, run_json, write_config
from tests.integration.test_upgrade_check import FLEET

pytestmark = [pytest.mark.integration, pytest.mark.compile]

HF_FLEET = [m for m in FLEET if m["name"] == "bert"]

# Ground truth outside pt2flow: torch's own loader in a fresh interpreter (no transformers module
# imported: checked), once as a serving process that imports nothing else would call it, then,
# in the same interpreter, again after `import transformers.modeling_outputs`
PLAIN_SERVE = """
import sys, traceback
import torch
def serve():
    m = torch._inductor.aoti_load_package(sys.argv[1])
    out = m(torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.int64))
    return type(out).__name__
assert not any(name.startswith("transformers") for name in sys.modules), "transformers imported before the bare load"
try:
    print("bare:", serve())
except Exception:
    traceback.print_exc()
    print("bare: failed")
import transformers.modeling_outputs
print("imported:", serve())
"""


def _serve_in_plain_python(package: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PLAIN_SERVE, str(package)], capture_output=True, text=True, timeout=300, env=cli_env()
    )


def test_a_compiled_transformers_fleet_passes_check_compat_and_an_unchanged_upgrade_check(tmp_path: Path) -> None:
    store = tmp_path / "store"
    config = write_config(tmp_path / "fleet.yaml", HF_FLEET, store=str(store))  # default stages: aot_compile included
    code, run = run_in_process(
        config
    )  # the store upgrade-check reads, built in this process (upgrade-check is the binary)
    assert code == 0, run
    assert {m["name"]: (m["status"], bool(m["artifacts"].get("compiled"))) for m in run["models"]} == {
        "bert": ("ok", True)
    }

    # a package needs its archive's pytree modules to run: torch's own loader, in a plain process, says so
    package = tmp_path / "bert.pt2"
    code, got, stderr = run_json(
        ["get", "--model", "bert", "--artifact", "compiled", "-o", str(package), "--store", str(store), "--json"]
    )
    assert code == 0, stderr[-2000:]
    plain = _serve_in_plain_python(package)
    said = [line for line in plain.stdout.splitlines() if line.startswith(("bare:", "imported:"))]
    assert plain.returncode == 0 and said == [
        "bare: failed",
        "imported: BaseModelOutputWithPoolingAndCrossAttentions",
    ], (plain.stdout, plain.stderr[-3000:])
    assert "BaseModelOutputWithPoolingAndCrossAttentions in pytree is not registered" in plain.stderr, plain.stderr[
        -3000:
    ]

    # check-compat loads them as a serving process would: every archive and package loads, runs and matches
    code, compat, stderr = run_json(["check-compat", run["run_id"], "--store", str(store), "--json"])
    assert code == 0, stderr[-3000:]
    assert compat["summary"] == {"ok": 1, "failed": 0, "unchecked": 0}
    for model in compat["models"]:
        assert model["pytree_modules"] == ["transformers.modeling_outputs"], model
        for kind in ("archive", "compiled"):
            artifact = model[kind]
            assert (artifact["loads"], artifact["runs"], artifact["matches"], artifact["error_class"]) == (
                True,
                True,
                True,
                None,
            ), (model["name"], kind, artifact)
            assert artifact["samples"] >= 1 and artifact["max_abs_err"] <= 1e-4

    # an unchanged candidate (this very environment) regresses nothing
    code, report, stderr = run_json(
        [
            "upgrade-check",
            str(config),
            "--python",
            sys.executable,
            "--baseline",
            run["run_id"],
            "--repro-dir",
            str(tmp_path / "repro"),
            "--json",
        ],
        cwd=tmp_path,
    )
    assert code == 0, stderr[-4000:]
    assert (
        report["regressed"] is False and report["summary"]["regressed"] == 0 and report["summary"]["newly_failing"] == 0
    )
    assert {m["model"]: (m["verdict"], m["regressions"]) for m in report["models"]} == {"bert": ("unchanged", [])}
    assert report["versions"] == [] and report["other_version_changes"] == []
    assert {m["name"]: m["status"] for m in report["compat"]["models"]} == {"bert": "ok"}
    for m in report["models"]:  # the numbers beside their baseline values
        assert m["compile_seconds"]["a"] > 0 and m["compile_seconds"]["a"] == m["compile_seconds"]["b"]
        assert m["validation_error"]["max_abs_err"]["a"] == m["validation_error"]["max_abs_err"]["b"]
