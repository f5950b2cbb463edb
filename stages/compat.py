"""Does an artifact built by another torch still work here? (`pt2flow check-compat`)

Loads an archive, an AOTInductor package or a deployment target's artifact (an ONNX model run by
ONNX Runtime, an ExecuTorch .pte run by its runtime) with the libraries installed now, runs it on the inputs
validate stored (stages/validation_io.py) and compares every output leaf with the eager outputs
recorded then, with the run's tolerances. An artifact that no longer loads is `incompatible`; one
that loads but raises is `runtime`; one whose outputs moved is `numeric_mismatch`; an archive
whose pytree modules do not import here is `import` (the model's code is missing here, which is
not torch's doing). A package compiled for a device this process does not have (a CUDA package on
a CPU-only checker) is not checked at all: `skipped` says why, and nothing is claimed about it.
"""

from __future__ import annotations

import tempfile
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from pt2flow.stages.accuracy import Accuracy, is_evaluation, judge
from pt2flow.stages.aot_compile import load_runner
from pt2flow.stages.classify import short_message
from pt2flow.stages.devices import missing_device
from pt2flow.stages.errors import StageError
from pt2flow.stages.quiet import quiet_torch
from pt2flow.stages.serialize import import_archive_modules, import_pytree_modules, load_archive
from pt2flow.stages.comparison import compare
from pt2flow.stages.targets import flat_tensor_inputs
from pt2flow.stages.validation_io import IOSample
from pt2flow.stages.vocabulary import ErrorClass


def _load(
    kind: str,
    data: bytes,
    workdir: str,
    device: str,
    imported: list[str],
    flat: Callable[[bytes], Any] | None,
    modules: Sequence[str] | None,
) -> Callable[..., Any]:
    """The artifact, callable, loaded as a serving process would: first the modules registering
    the program's pytree types (an archive names them itself; a package or target gets them from
    `modules`, its model's archive's); `imported` gets the modules loading it imported."""
    if kind != "archive" and modules:
        imported += import_pytree_modules(list(modules))
    if flat is not None:
        return flat(data)
    if kind == "archive":
        imported += import_archive_modules(data)
        return load_archive(data)[0].module()
    return load_runner(data, workdir, device)


def check_artifact(
    kind: str,
    data: bytes,
    samples: Sequence[IOSample] | None,
    atol: float,
    rtol: float,
    device: str = "cpu",
    *,
    flat: Callable[[bytes], Any] | None = None,
    target: str | None = None,
    modules: Sequence[str] | None = None,
    lacking: str | None = None,
    accuracy: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """{loads, runs, matches, max_abs_err, max_rel_err, samples, error_class, error, skipped,
    imported} of one artifact; runs/matches are None without stored samples, all three None when
    skipped; imported: the modules loading it imported (a process that checks another artifact
    after this one is no longer clean). device: where a package was compiled for (its record's
    `device`). kind: archive, compiled, or another candidate's artifact kind, whose `flat` loader
    (its stage's candidate: bytes -> a runner of flat tensor lists) loads it; target: that
    stage; lacking: why its libraries are missing here (the check is then skipped). modules: for a
    package or target, the pytree modules its model's archive records (imported first, as a
    serving process must; one that does not import here is `import`, not `incompatible`).
    accuracy: the budgets of an artifact not meant to be exact (an int8 one), judged over the
    stored samples against eager's stored outputs instead of atol/rtol (stages/accuracy.py)."""
    result: dict[str, Any] = {
        "loads": False,
        "runs": None,
        "matches": None,
        "max_abs_err": None,
        "max_rel_err": None,
        "samples": 0,
        "error_class": None,
        "error": None,
        "skipped": None,
        "imported": [],
    }
    why = missing_device(device) if kind == "compiled" else None
    if why is not None:
        return {**result, "loads": None, "skipped": f"compiled for {device}, and {why}: not checked"}
    if lacking is not None:
        return {**result, "loads": None, "skipped": f"{lacking}: not checked"}
    with tempfile.TemporaryDirectory(prefix="pt2flow-compat-") as workdir, quiet_torch():
        try:
            fn = _load(kind, data, workdir, device, result["imported"], flat, modules)
        except StageError as exc:
            if (
                exc.error_class == ErrorClass.IMPORT
            ):  # a module the archive names does not import here: not torch's doing
                return {**result, "loads": None, "error_class": ErrorClass.IMPORT, "error": exc.message}
            return {
                **result,
                "error_class": ErrorClass.INCOMPATIBLE,
                "error": f"{kind} does not load with this torch: {exc.message}",
            }
        except Exception as exc:  # noqa: BLE001 - whatever torch raises, the artifact does not load here
            return {
                **result,
                "error_class": ErrorClass.INCOMPATIBLE,
                "error": f"{kind} does not load with this torch: {short_message(exc, 1000)}",
            }
        result["loads"] = True
        if not samples:
            return result
        return {**result, **_run_samples(fn, samples, atol, rtol, flat=flat is not None, accuracy=accuracy)}


def _run_samples(
    fn: Callable[..., Any],
    samples: Sequence[IOSample],
    atol: float,
    rtol: float,
    *,
    flat: bool = False,
    accuracy: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """flat: fn is a target's runner (flat input tensors in, output tensors out); the stored
    outputs' non-tensor leaves, constants a target does not return, are left out of the comparison."""
    worst_abs = worst_rel = 0.0
    failures: list[str] = []
    # the model's own evaluation batches, where it stored some, are what its budgets are judged on
    measured = Accuracy(evaluation_only=any(is_evaluation(sample.label) for sample in samples))
    for sample in samples:
        try:
            got = fn(flat_tensor_inputs(sample.args, sample.kwargs)) if flat else fn(*sample.args, **sample.kwargs)
        except Exception as exc:  # noqa: BLE001
            return {
                "runs": False,
                "samples": len(samples),
                "error_class": ErrorClass.RUNTIME,
                "error": f"raised on sample {sample.label}: {short_message(exc, 1000)}",
            }
        expected = [o for o in sample.outputs if isinstance(o, torch.Tensor)] if flat else list(sample.outputs)
        if accuracy is not None:  # judged over every sample once all are in
            measured.add(sample.label, list(pytree.tree_leaves(got)), expected)
            continue
        comparison = compare(pytree.tree_leaves(got), expected, atol, rtol)
        worst_abs, worst_rel = max(worst_abs, comparison.max_abs_err), max(worst_rel, comparison.max_rel_err)
        failures += [f"{sample.label}: {f}" for f in comparison.failures]
    if accuracy is not None:
        judged, missed = judge(measured, accuracy)
        worst_abs = judged["metrics"]["max_abs_err"] or 0.0
        failures += [f"misses its accuracy budget: {line}" for line in missed]
    out: dict[str, Any] = {
        "runs": True,
        "matches": not failures,
        "max_abs_err": worst_abs,
        "max_rel_err": worst_rel,
        "samples": len(samples),
    }
    if failures:
        out.update(error_class=ErrorClass.NUMERIC_MISMATCH, error="; ".join(failures[:5]))
    return out
