"""The upgrade report's version list (flows/report/upgrade.py, flows/api/upgrade.py): ranked by how
many models import each distribution, torch first, a torch build's own wheels folded under torch,
found from torch's Requires-Dist in the environment's metadata (not a list of names)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pt2flow.flows.api.upgrade import requirement_closure
from pt2flow.flows.engine.environment.interpreter import Interpreter
from pt2flow.flows.report.upgrade import Finding, _compat_problem, version_changes


def _dist(site: Path, name: str, version: str, requires: list[str]) -> str:
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True)
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *[f"Requires-Dist: {r}" for r in requires],
    ]
    (folder / "METADATA").write_text("\n".join(lines) + "\n")
    return str(folder)


def test_torch_requirements_are_found_transitively_from_the_metadata(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    dists = {
        "torch": (
            "2.14.1",
            [
                "filelock",
                "sympy>=1.13.3",
                'cuda-toolkit[cublas,cudart]==13.0.3; platform_system == "Linux"',
                'triton==3.7.0; platform_system == "Linux"',
                'opt-einsum>=3.3; extra == "opt-einsum"',
            ],
        ),
        "cuda-toolkit": (
            "13.0.3",
            [
                'nvidia-cublas==13.1.0.3; extra == "cublas"',
                "nvidia-cuda-runtime==13.0.96; extra == 'cudart'",
                "nvidia-cufft==12.0; (sys_platform == 'linux') and extra == 'cufft'",
            ],
        ),
        "nvidia-cufft": ("12.0", []),
        "nvidia-cuda-runtime": ("13.0.96", []),
        "nvidia-cublas": ("13.1.0.3", []),
        "sympy": ("1.14.0", ["mpmath<1.4,>=1.1.0"]),
        "mpmath": ("1.3.0", []),
        "filelock": ("3.20.0", []),
        "triton": ("3.7.0", []),
        "opt-einsum": ("3.4.0", []),
        "transformers": ("5.23.0", ["filelock"]),
    }
    python = Interpreter(
        python=sys.executable,
        python_version="3.11",
        distributions={n: v for n, (v, _) in dists.items()},
        dist_info={n: _dist(site, n, v, r) for n, (v, r) in dists.items()},
    )
    found = requirement_closure("torch", python)
    # through sympy, and through cuda-toolkit's extras torch asks for (cublas, cudart: not cufft);
    # torch's own extras (opt-einsum) and what torch does not reach (transformers) are left out
    assert found == {"filelock", "sympy", "mpmath", "cuda-toolkit", "nvidia-cublas", "nvidia-cuda-runtime", "triton"}


def test_versions_rank_by_models_and_fold_the_torch_builds_wheels() -> None:
    baseline = {"torch": "2.13.0+cpu", "transformers": "5.23.0", "numpy": "2.3.0", "tinyops": "1.0", "rich": "14.0.0"}
    candidate = {
        "torch": "2.14.1",
        "transformers": "5.23.0",
        "numpy": "2.4.0",
        "tinyops": "2.0",
        "rich": "14.1.0",
        "nvidia-cublas": "13.1.0.3",
        "triton": "3.7.0",
        "sympy": "1.14.0",
    }
    baseline["sympy"] = "1.13.3"
    used = {
        "torch": ["a", "b", "c"],
        "numpy": ["a", "b"],
        "tinyops": ["c"],
        "triton": ["a", "b", "c"],
        "nvidia-cublas": ["a", "b", "c"],
    }
    relevant, other = version_changes(
        baseline, candidate, used, with_torch={"nvidia-cublas", "triton", "sympy", "filelock"}
    )
    assert [(v.name, len(v.used_by)) for v in relevant] == [("torch", 3), ("numpy", 2), ("tinyops", 1)]
    torch = relevant[0]
    assert [(w.name, w.baseline, w.candidate) for w in torch.came_with] == [
        ("nvidia-cublas", None, "13.1.0.3"),
        ("sympy", "1.13.3", "1.14.0"),
        ("triton", None, "3.7.0"),
    ]
    assert [v.name for v in other] == ["rich"]  # imported by no model; the folded wheels are in neither list
    # without a torch change nothing is folded: a CUDA wheel that moved alone is listed as itself
    same_torch = {**candidate, "torch": "2.13.0+cpu"}
    relevant, _ = version_changes(baseline, same_torch, used, with_torch={"nvidia-cublas", "triton", "sympy"})
    assert [v.name for v in relevant][:3] == ["nvidia-cublas", "triton", "numpy"]


def test_an_incompatible_artifact_carries_the_command_that_shows_it() -> None:
    command = "pt2flow get abc -o /tmp/m.compiled.pt2 --store s && python -c 'import torch; ...'"
    entry = {
        "status": "failed",
        "archive": {"error_class": None},
        "compiled": {
            "loads": False,
            "error_class": "incompatible",
            "error": "compiled does not load with this torch: boom\nmore",
            "load_command": command,
        },
    }
    finding = _compat_problem(entry)
    assert isinstance(finding, Finding) and finding.rule == "artifact_incompatible"
    assert (
        finding.message
        == "the baseline's compiled no longer loads under the candidate: incompatible: compiled does not load with this torch: boom"
    )
    assert finding.evidence == command
    moved = {
        "status": "failed",
        "compiled": {
            "loads": True,
            "runs": True,
            "matches": False,
            "max_abs_err": 0.5,
            "max_rel_err": 0.1,
            "samples": 3,
            "error_class": "numeric_mismatch",
            "error": "output: max abs 0.5",
        },
    }
    assert _compat_problem(moved).evidence == "max_abs_err 0.5, max_rel_err 0.1 over 3 stored samples"
    missing = {
        "status": "failed",
        "compiled": {
            "loads": None,
            "error_class": "import",
            "error": "importing 'transformers.modeling_outputs' failed",
        },
    }
    assert _compat_problem(missing).rule == "artifact_module_missing"


def test_a_compile_time_regression_stands_only_when_the_back_to_back_retiming_repeats_it(tmp_path: Path) -> None:
    """Real index records (tests/flows/test_report.chain), real drift reports: the runs say
    compile time 10 s -> 20 s; re-timed back to back it is 10 s -> 10.5 s (noise: the model is
    `changed`, nothing regressed) or 10 s -> 20 s (confirmed, the re-timed numbers as evidence)."""
    from pt2flow.flows.report.compare import build_report
    from pt2flow.flows.report.runs import given
    from pt2flow.flows.report.upgrade import apply_retiming, model_verdicts, timing_only
    from pt2flow.storage import ArtifactStore
    from tests.flows.test_report import chain

    store = ArtifactStore(str(tmp_path / "store"))
    for i, (run, seconds) in enumerate(
        [("run-a", 10.0), ("run-b", 20.0), ("run-c", 10.0), ("run-d", 10.5), ("run-e", 10.0), ("run-f", 20.0)]
    ):
        chain(store, "m", run, offset=10 * i, salt=f"s{i}", aot_compile={"seconds": seconds})

    def drift(a: str, b: str) -> Any:
        return build_report(store.index, a, b, selection=given((a, b)))

    def verdict() -> Any:
        [m] = model_verdicts(drift("run-a", "run-b"), {"models": []})
        assert m.verdict == "regressed" and [f.rule for f in m.regressions] == ["compile_time_up"] and timing_only(m)
        assert m.regressions[0].evidence == "baseline 10.0, candidate 20.0 (×2)"
        return m

    noise = verdict()
    apply_retiming(noise, drift("run-c", "run-d").models[0])
    assert (noise.verdict, noise.regressions) == ("changed", [])
    assert (
        noise.retimed == "re-timed back to back: compile 10 s → 10.5 s: not confirmed, so not reported as a regression"
    )
    real = verdict()
    apply_retiming(real, drift("run-e", "run-f").models[0])
    assert real.verdict == "regressed" and real.retimed == "re-timed back to back: compile 10 s → 20 s: confirmed"
    assert (
        real.regressions[0].evidence == "baseline 10.0, candidate 20.0 (×2); re-timed back to back: compile 10 s → 20 s"
    )
