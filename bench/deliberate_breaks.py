"""Ten deliberate breaks (issue 40): apply each to a checkout, run the tests named, record which
failed, put the file back. The suite must fail on every one, before and after a change to it.

    python3 bench/deliberate_breaks.py CHECKOUT VENV_PYTHON OUT.json [B1 B2 ...]

CHECKOUT is a clone (never the working tree: its files are changed while a break runs);
VENV_PYTHON an interpreter with pt2flow's dependencies (the CHECKOUT is put first on PYTHONPATH,
so another checkout's venv serves; CHECKOUT/.venv must exist for the tests' console scripts).
Not part of `make test`: each break runs the files that should catch it, with two xdist workers."""

import json
import os
import subprocess
import sys
import re
import pathlib

BREAKS = [
    (
        "B1 program fingerprint omits a weight's bytes",
        "stages/program.py",
        "h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())",
        "pass",
        ["tests/stages/test_program.py", "tests/stages/test_identity.py"],
    ),
    (
        "B2 a blob's bytes are not fsynced before they are named",
        "storage/publish.py",
        "            crash_point(point)\n    os.fsync(fd)",
        "            crash_point(point)\n    pass",
        ["tests/storage"],
    ),
    (
        "B3 validate compares only the first output leaf",
        "stages/comparison.py",
        "for path in sorted(set(cand) & set(ref)):",
        "for path in sorted(set(cand) & set(ref))[:1]:",
        ["tests/stages/test_validate.py", "tests/stages/test_validate_tolerance.py"],
    ),
    (
        "B4 retention keeps one run too many (off by one)",
        "storage/retention.py",
        "ordered[: rule.keep_runs]",
        "ordered[: rule.keep_runs + 1]",
        ["tests/storage/test_retention_rules.py"],
    ),
    (
        "B5 a data-dependent trace failure loses its class (runtime)",
        "stages/classify.py",
        'if "GuardOnDataDependentSymNode" in names or "DYNAMIC_CONTROL_FLOW" in error_type:\n        return ErrorClass.DATA_DEPENDENT',
        'if "GuardOnDataDependentSymNode" in names or "DYNAMIC_CONTROL_FLOW" in error_type:\n        return ErrorClass.RUNTIME',
        ["tests/stages/test_trace.py"],
    ),
    (
        "B6 a generation step of a flat runtime (pte, onnx, openvino) is fed a zeroed cache",
        "stages/generation_steps.py",
        "            return specs.unflatten(list(runner(specs.flatten(kwargs, keep_none=keep_none))))",
        "            flat = [x if not (isinstance(x, torch.Tensor) and x.is_floating_point()) else torch.zeros_like(x) for x in specs.flatten(kwargs, keep_none=keep_none)]\n            return specs.unflatten(list(runner(flat)))",
        [
            "tests/stages/test_generation_validate.py",
            "tests/integration/test_generative_t5.py::test_a_component_failing_a_target_not_required_leaves_the_model_partial",
        ],
    ),
    (
        "B7 a stage's key ignores its options",
        "flows/engine/orchestrator/stage_keys.py",
        "stage.name, parents, options_json(model, stage.name), environment_part",
        "stage.name, parents, {}, environment_part",
        ["tests/flows/test_key_properties.py"],
    ),
    (
        "B8 the memory ceiling is never enforced",
        "flows/engine/orchestrator/supervisor.py",
        "if budget.memory_bytes is not None and now >= next_sample:",
        "if False and budget.memory_bytes is not None and now >= next_sample:",
        ["tests/flows/test_isolation.py::test_crashing_hanging_and_hoarding_models_fail_alone"],
    ),
    (
        "B9 a blob read skips its sha256 check",
        "storage/store.py",
        "elif (actual := sha256_hex(data)) != digest:",
        "elif False and (actual := sha256_hex(data)) != digest:",
        ["tests/storage/test_store.py", "tests/storage/test_retrieve.py"],
    ),
    (
        "B10 a failed stage's record loses its failure class (all runtime)",
        "flows/engine/orchestrator/records.py",
        "error_class=outcome.error_class,",
        'error_class=("runtime" if outcome.error_class else None),',
        ["tests/flows/test_known_failures.py"],
    ),
]


def main():
    checkout, python, out = sys.argv[1], sys.argv[2], sys.argv[3]
    wanted = set(sys.argv[4:])
    results = []
    link = pathlib.Path(f"/tmp/breaks/link-{os.getpid()}")
    link.mkdir(parents=True, exist_ok=True)
    (link / "pt2flow").unlink(missing_ok=True)
    (link / "pt2flow").symlink_to(checkout)
    for name, path, old, new, tests in BREAKS:
        if wanted and name.split()[0] not in wanted:
            continue
        file = pathlib.Path(checkout) / path
        text = file.read_text()
        if text.count(old) != 1:
            results.append({"break": name, "error": f"{old!r} found {text.count(old)} times in {path}"})
            print(results[-1], flush=True)
            continue
        file.write_text(text.replace(old, new))
        try:
            env = dict(os.environ, PYTHONPATH=str(link))
            proc = subprocess.run(
                [python, "-m", "pytest", "-qq", "-p", "no:cacheprovider", "-rf", "-n", "2", *tests],
                cwd=checkout,
                env=env,
                capture_output=True,
                text=True,
                timeout=1500,
            )
            failed = sorted(set(re.findall(r"^FAILED (\S+)", proc.stdout, re.M)))
            summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
            results.append(
                {"break": name, "tests": tests, "returncode": proc.returncode, "failed": failed, "summary": summary}
            )
        finally:
            file.write_text(text)
        print(json.dumps(results[-1]), flush=True)
    pathlib.Path(out).write_text(json.dumps(results, indent=1))


main()
