"""validate: reload the artifacts and compare them with eager (docs/architecture.md §6).

Reference: the eager model (eval mode, inference mode). Candidates: the serialized archive,
the compiled package and the deployment targets' artifacts (an ONNX model, an ExecuTorch .pte:
stages/targets.py), each run on the same samples. Inputs: the example inputs, every dynamic dim at its min, then at its
max, then random sizes in range: `samples` in all, from a fixed seed. Every output leaf is
compared (stages/comparison.py: structure, shape, dtype, allclose). A second eager copy tells a
nondeterministic model from a bad export. Training mode compares the loss and every parameter
gradient. Each candidate gets a verdict of its own; the stage fails only for a required one.

tolerance: auto: a float64 copy of the eager model (_Noise) runs on the same samples; each
floating leaf of a candidate is judged against it (stages/comparison.py leaf_noise).
"""

from __future__ import annotations

import copy
import functools
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from pt2flow.stages import program, signature
from pt2flow.stages.accuracy import Accuracy, budget_of, evaluation_label, judge
from pt2flow.stages.aot_compile import load_runner
from pt2flow.stages.binding import bind_inputs
from pt2flow.stages.classify import short_message
from pt2flow.stages.comparison import FLOOR_ULPS, Comparison, Observed, compare_observed, leaves_by_path
from pt2flow.stages.errors import StageError
from pt2flow.stages.example_inputs import BoundInputs, ModelInputs, clone_tree
from pt2flow.stages.options import DEFAULT_ACCURACY, ValidateOptions
from pt2flow.stages.quiet import quiet_torch
from pt2flow.stages.result import StageResult
from pt2flow.stages.sample_plan import Sample, plan_samples
from pt2flow.stages.serialize import load_archive
from pt2flow.stages.targets import FlatCandidate, TargetArtifact, restructure
from pt2flow.stages.validation_io import IOSample, NotStorable
from pt2flow.stages.validation_io import pack as pack_io
from pt2flow.stages.vocabulary import ErrorClass


def _observe(module: Any, call: Callable[[BoundInputs], Any], bound: BoundInputs, buffer_names: list[str]) -> Observed:
    """Call on a fresh copy of the inputs; keep the inputs and named buffers as they are afterwards."""
    inputs = bound.clone()
    output = call(inputs)
    after = {path: t.detach().clone() for path, t, _ in inputs.tensor_leaves()}
    buffers = {}
    for name in buffer_names:
        try:
            buffers[name] = module.get_buffer(name).detach().clone()
        except AttributeError:
            pass
    return Observed(output, after, buffers)


def _eager_training_step(step: torch.nn.Module, bound: BoundInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    step.zero_grad(set_to_none=True)
    loss = bound.call(step)
    loss.backward()
    grads = {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in step.named_parameters()
        if p.requires_grad
    }
    return loss.detach(), grads


def _run_eager(model: torch.nn.Module, bound: BoundInputs, training: bool) -> Any:
    if training:
        return _eager_training_step(model, bound)
    with torch.inference_mode():
        return bound.call(model)


def _run_candidate(fn: Callable[..., Any], bound: BoundInputs, training: bool) -> Any:
    with torch.no_grad():
        out = fn(*clone_tree(bound.args), **clone_tree(bound.kwargs))
    if training:  # (loss, {param: grad}) as tensors detached from any graph
        out = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
    return out


def _observe_eager(model: torch.nn.Module, bound: BoundInputs, training: bool, buffer_names: list[str]) -> Observed:
    if training:
        return Observed(_run_eager(model, bound.clone(), training), {}, {})
    return _observe(model, lambda inputs: _run_eager(model, inputs, training), bound, buffer_names)


def _observe_candidate(fn: Callable[..., Any], bound: BoundInputs, training: bool, buffer_names: list[str]) -> Observed:
    if training:
        return Observed(_run_candidate(fn, bound, training), {}, {})

    def call(inputs: BoundInputs) -> Any:
        with torch.no_grad():
            return inputs.call(fn)

    return _observe(fn, call, bound, buffer_names if isinstance(fn, torch.nn.Module) else [])


def _median_ms(fn: Callable[[], Any], runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


@dataclass
class _Findings:
    """What went wrong over the samples, one line each: a candidate that raised, an output that
    differs from eager, eager disagreeing with its twin."""

    raised: list[tuple[str, str]] = field(default_factory=list)  # (candidate, what it raised)
    mismatches: list[tuple[str, str]] = field(default_factory=list)  # (candidate, how it differs)
    # candidate -> why its artifact does not load: serialization, or a StageError's own class (runtime: its device is missing here)
    unloadable: dict[str, tuple[ErrorClass, str]] = field(default_factory=dict)
    nondeterministic: list[str] = field(default_factory=list)
    io: list[IOSample] = field(default_factory=list)  # each sample's inputs and eager outputs
    # the candidates judged by accuracy budgets (not meant to be exact), their outputs gathered
    accuracy: dict[str, Accuracy] = field(default_factory=dict)
    # every comparison, judged once the tolerance is settled (auto can fall back on a later sample):
    # (candidate, sample label, its report entry, the fixed comparison, the noise comparison or None)
    judged: list[tuple[str, str, dict[str, Any], Comparison, Comparison | None]] = field(default_factory=list)


@dataclass
class _Noise:
    """tolerance: auto over the samples: the float64 copy of the eager model (None once it cannot
    be used: fallback says why), the multiple, and the time its calls took."""

    model: torch.nn.Module | None
    multiple: float
    fallback: str | None = None
    seconds: float = 0.0

    @classmethod
    def start(cls, reference: torch.nn.Module, multiple: float) -> _Noise:
        """A float64 copy of `reference` before any call (a stateful model's copy keeps in step)."""
        state = [*reference.parameters(), *reference.buffers()]
        if state and not any(t.is_floating_point() for t in state):
            return cls(
                None,
                multiple,
                "the model holds no floating-point parameter or buffer: a float64 copy would compute the same",
            )
        try:
            return cls(copy.deepcopy(reference).double(), multiple)
        except Exception as exc:
            return cls(None, multiple, f"no float64 copy of the model: {short_message(exc)}")

    def observe(self, sample: Sample, bound: BoundInputs, training: bool, buffer_names: list[str]) -> Observed | None:
        """The float64 copy on `bound` with its floating tensors in float64; None (and the copy
        dropped, fallback set) where it raises or returns a floating leaf narrower than float64."""
        if self.model is None:
            return None
        widened = replace(bound, args=_widen(bound.args), kwargs=_widen(bound.kwargs))
        floating_state = any(t.is_floating_point() for t in [*self.model.parameters(), *self.model.buffers()])
        if not floating_state and not any(t.is_floating_point() for _, t, _ in bound.tensor_leaves()):
            self._give_up("nothing in the model or its inputs is floating point")
            return None
        start = time.perf_counter()
        try:
            observed = _observe_eager(self.model, widened, training, buffer_names)
        except Exception as exc:
            self._give_up(f"the float64 copy of the model raised on sample {sample.label}: {short_message(exc)}")
            return None
        finally:
            self.seconds += time.perf_counter() - start
        for path, leaf in leaves_by_path(observed.output).items():
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != torch.float64:
                self._give_up(
                    f"the float64 copy returns {str(leaf.dtype).removeprefix('torch.')} for output {path}: the model sets its own dtype"
                )
                return None
        return observed

    def _give_up(self, why: str) -> None:
        self.model, self.fallback = None, why

    def report(self) -> dict[str, Any]:
        return {
            "mode": "auto",
            "applied": "fixed" if self.fallback else "auto",
            "noise_multiple": self.multiple,
            "floor_ulps": FLOOR_ULPS,
            "fallback": self.fallback,
            "reference_ms": self.seconds * 1000.0,
        }


def _widen(tree: Any) -> Any:
    """Floating tensors in float64 (fresh copies), everything else as it is."""
    return pytree.tree_map(
        lambda x: x.detach().to(torch.float64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree
    )


def validate(
    build_reference: Callable[[], torch.nn.Module],
    model_inputs: ModelInputs,
    dims: Mapping[str, Mapping[str, Any]],
    options: ValidateOptions,
    *,
    archive: bytes | None = None,
    package: bytes | None = None,
    training: bool = False,
    device: str = "cpu",
    targets: Mapping[str, TargetArtifact] | None = None,
    required: Collection[str] | None = None,
    kinds: Mapping[str, str] | None = None,
    evaluation: Sequence[tuple[tuple[Any, ...], dict[str, Any]]] = (),
) -> StageResult:
    """Output: the validation report (a dict), with a verdict per candidate
    (`candidates[name]["verdict"]`: passed, error_class, error). Raises StageError(serialization |
    runtime | numeric_mismatch | nondeterministic), the report attached as `details`, when a
    required candidate failed (or eager disagrees with itself); an optional one that failed is a
    warning and its verdict.
    device: where the package was compiled for; it runs there on copies of the CPU inputs.
    targets: deployment-target artifacts by candidate name ("onnx", "executorch"), inference only.
    required: the candidates that must pass ("archive", "compiled", a target's name); None: all.
    kinds: candidate name -> the artifact kind the caller calls it, recorded as its `artifact`.
    evaluation: the model's own evaluation batches, (args, kwargs) each (`data.evaluation`): every
    candidate runs on them after the samples (labelled evaluation[i]), and the candidates not
    meant to be exact are measured on them alone (stages/accuracy.py). Inference only."""
    targets = dict(targets or {})
    if archive is None and package is None and not targets:
        raise StageError(
            ErrorClass.CONFIG, "validate needs serialize, aot_compile or a target to have produced a candidate"
        )
    if training and targets:
        raise StageError(
            ErrorClass.CONFIG,
            f"deployment targets ({', '.join(targets)}) take inference programs: nothing to validate in training mode",
        )
    plan = plan_samples(dims, model_inputs.dims, options.samples, options.seed)
    with tempfile.TemporaryDirectory(prefix="pt2flow-validate-") as workdir, quiet_torch() as sink:
        reference = build_reference()
        twin = copy.deepcopy(reference)  # same state, same inputs: any disagreement is the model's own
        noise = _Noise.start(reference, options.noise_multiple) if options.tolerance == "auto" else None
        evaluation = () if training else evaluation
        findings = _Findings(
            accuracy={
                name: Accuracy(evaluation_only=bool(evaluation)) for name, target in targets.items() if not target.exact
            }
        )
        candidates, buffer_names, archived = _load_candidates(archive, package, workdir, device, targets, findings)
        names = [*candidates, *findings.unloadable]
        must = set(names) if required is None else set(required) & set(names)
        report: dict[str, Any] = {
            "passed": False,
            "nondeterministic": False,
            "training": training,
            "device": device,
            "atol": options.atol,
            "rtol": options.rtol,
            "tolerance": noise.report() if noise is not None else {"mode": "fixed", "applied": "fixed"},
            "samples": len(plan),
            "plan": [{"label": s.label, "sizes": s.sizes} for s in plan],
            "evaluation": len(evaluation),
            "candidates": {
                name: {"artifact": (kinds or {}).get(name, name), "max_abs_err": 0.0, "max_rel_err": 0.0, "samples": []}
                for name in names
            },
            "required": sorted(must),
        }

        def bound_samples() -> Iterator[tuple[Sample, BoundInputs]]:
            """The plan's samples, then the model's own evaluation batches (evaluation[i])."""
            for i, sample in enumerate(plan):
                yield sample, bind_inputs(reference, model_inputs, seed=options.seed + i, dim_sizes=sample.sizes)
            for i, (args, kwargs) in enumerate(evaluation):
                batch = ModelInputs(inputs=kwargs, positional=tuple(args))
                yield Sample(evaluation_label(i), {}), bind_inputs(reference, batch)

        for i, (sample, bound) in enumerate(bound_samples()):
            if i == 0:  # before any number: do the artifacts take these inputs at all?
                _check_signature(archived, candidates.get("compiled"), bound, dims, report)
            _check_sample(
                sample,
                bound,
                reference,
                twin,
                noise,
                candidates,
                archived,
                buffer_names,
                training,
                options,
                report,
                findings,
            )

        _judge(findings, report, auto=noise is not None and noise.model is not None)
        _judge_accuracy(findings, report, options)
        exact = [c for name, c in report["candidates"].items() if name not in findings.accuracy]
        report["max_abs_err"] = max((c["max_abs_err"] for c in exact), default=0.0)
        report["max_rel_err"] = max((c["max_rel_err"] for c in exact), default=0.0)
        report["nondeterministic"] = bool(findings.nondeterministic)
        failed = _verdicts(findings, report)
        report["passed"] = not (failed or findings.nondeterministic)
        if options.benchmark and not (findings.nondeterministic or failed & must):
            bound = bind_inputs(reference, model_inputs, seed=options.seed)
            passing = {name: fn for name, fn in candidates.items() if name not in failed}
            report["latency_ms"] = _latency(reference, passing, bound, training, options.benchmark_runs)
        report["warnings"] = list(sink.items)
        for name in sorted(failed - must):
            verdict = report["candidates"][name]["verdict"]
            report["warnings"].append(
                f"{name} (not required) failed validation, {verdict['error_class']}: {verdict['error']}"
            )
        if noise is not None:
            report["tolerance"] = noise.report()
            if noise.fallback:
                report["warnings"].append(
                    f"tolerance: auto fell back to atol={options.atol:g}, rtol={options.rtol:g}: {noise.fallback}"
                )

    _raise_findings(findings, report, options, must)
    io, skipped = _stored_io(findings, training)
    if skipped:
        report["io_skipped"] = skipped
    metadata = {"passed": True, "max_abs_err": report["max_abs_err"], "max_rel_err": report["max_rel_err"]}
    return StageResult(
        output=report, metadata=metadata, warnings=tuple(report["warnings"]), side={"io": io} if io else {}
    )


def _stored_io(findings: _Findings, training: bool) -> tuple[bytes | None, str | None]:
    """Safetensors bytes of the samples' inputs and eager outputs (stages/validation_io.py), for a
    later check that re-runs the artifacts without the model; or None and why not."""
    if training:
        return None, "training mode: the candidates' outputs are a loss and gradients"
    try:
        return pack_io(findings.io), None
    except NotStorable as exc:
        return None, str(exc)


def _check_signature(
    archived: Any, compiled: Any, bound: BoundInputs, dims: Mapping[str, Mapping[str, Any]], report: dict[str, Any]
) -> None:
    """StageError(numeric_mismatch) naming every input the archive does not take as configured
    (dtype, rank, which dims are dynamic and their ranges, static sizes), or a package whose
    input/output structure is not the archive's (stages/signature.py)."""
    if archived is None:
        return
    problems = signature.input_mismatches(archived, bound, dims)
    if compiled is not None and (spec_problem := signature.call_spec_mismatch(archived, compiled)):
        problems.append(spec_problem)
    report["signature"] = problems
    if problems:
        shown = " | ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
        raise StageError(ErrorClass.NUMERIC_MISMATCH, f"signature mismatch: {shown}", details=report)


def _load_candidates(
    archive: bytes | None,
    package: bytes | None,
    workdir: str,
    device: str,
    targets: Mapping[str, TargetArtifact],
    findings: _Findings,
) -> tuple[dict[str, Callable[..., Any]], list[str], Any]:
    """The candidates that load, by name ("archive", "compiled", then each target's), the buffers
    the program mutates, and the archive's ExportedProgram (None without a loadable archive); why
    each other one does not load into findings.unloadable."""
    candidates: dict[str, Callable[..., Any]] = {}
    buffer_names: list[str] = []
    archived = None
    loaders: list[tuple[str, Callable[[], Callable[..., Any]]]] = []
    if archive is not None:

        def load_archived() -> Callable[..., Any]:
            nonlocal archived, buffer_names
            archived = load_archive(archive)[0]
            buffer_names = sorted(program.mutated_buffers_in_signature(archived))
            return archived.module()

        loaders.append(("archive", load_archived))
    if package is not None:
        loaders.append(("compiled", lambda: load_runner(package, workdir, device)))
    for name, target in targets.items():
        loaders.append((name, target.candidate))
    for name, load in loaders:
        try:
            candidates[name] = load()
        except Exception as exc:
            if isinstance(exc, StageError):
                findings.unloadable[name] = (ErrorClass(exc.error_class), f"{name} does not load: {exc.message}")
            else:
                findings.unloadable[name] = (ErrorClass.SERIALIZATION, f"{name} does not load: {short_message(exc)}")
    return candidates, buffer_names, archived


def _check_sample(
    sample: Sample,
    bound: BoundInputs,
    reference: torch.nn.Module,
    twin: torch.nn.Module,
    noise: _Noise | None,
    candidates: Mapping[str, Callable[..., Any]],
    archived: Any,
    buffer_names: list[str],
    training: bool,
    options: ValidateOptions,
    report: dict[str, Any],
    findings: _Findings,
) -> None:
    """One sample: eager against its twin, then every candidate against eager (and, with
    tolerance: auto, against the float64 copy), into the report; judged later (_judge)."""
    try:
        expected = _observe_eager(reference, bound, training, buffer_names)
        again = _observe_eager(twin, bound, training, buffer_names)
    except Exception as exc:
        raise StageError(
            ErrorClass.RUNTIME, f"eager model failed on sample {sample.label}: {short_message(exc)}"
        ) from exc
    exact = noise.observe(sample, bound, training, buffer_names) if noise is not None else None
    findings.io.append(IOSample(sample.label, bound.args, dict(bound.kwargs), pytree.tree_leaves(expected.output)))
    if archived is not None and not training and sample.label == "example":
        problems = signature.output_mismatches(archived, expected.output)
        if problems:
            report["signature"] = [*report.get("signature", []), *problems]
            raise StageError(
                ErrorClass.NUMERIC_MISMATCH, "signature mismatch: " + " | ".join(problems[:5]), details=report
            )
    self_check = compare_observed(again, expected, options.atol, options.rtol)
    if not self_check.ok:
        findings.nondeterministic.append(f"{sample.label}: " + "; ".join(self_check.failures[:3]))
    for name, fn in candidates.items():
        entry = report["candidates"][name]
        try:
            got = _observe_candidate(fn, bound, training, buffer_names)
        except Exception as exc:
            text = f"{name} raised on sample {sample.label} {sample.sizes}: {short_message(exc, 800)}"
            findings.raised.append((name, text))
            entry["samples"].append({"label": sample.label, "sizes": sample.sizes, "ok": False, "error": text})
            continue
        if isinstance(fn, FlatCandidate):  # a target returns flat tensors: put them in eager's structure
            got.output = restructure(got.output, expected.output)
        if name in findings.accuracy:  # judged by the budgets once every sample is in (_judge_accuracy)
            findings.accuracy[name].add(sample.label, got.output, expected.output)
            entry["samples"].append({"label": sample.label, "sizes": sample.sizes, "ok": True})
            continue
        buffers = isinstance(fn, torch.nn.Module)
        result = compare_observed(got, expected, options.atol, options.rtol, buffers=buffers)
        noisy = None
        if exact is not None:
            noisy = compare_observed(
                got, expected, options.atol, options.rtol, buffers=buffers, exact=exact, multiple=options.noise_multiple
            )
        done = {
            "label": sample.label,
            "sizes": sample.sizes,
            "ok": result.ok,
            "max_abs_err": result.max_abs_err,
            "max_rel_err": result.max_rel_err,
            "failures": result.failures,
        }
        entry["samples"].append(done)
        entry["max_abs_err"] = max(entry["max_abs_err"], result.max_abs_err)
        entry["max_rel_err"] = max(entry["max_rel_err"], result.max_rel_err)
        findings.judged.append((name, sample.label, done, result, noisy))


def _judge(findings: _Findings, report: dict[str, Any], *, auto: bool) -> None:
    """Each comparison's verdict into its sample's entry and the mismatches: the noise comparison
    where tolerance: auto held to the end, else the fixed one. With auto, each sample's entry gets
    its leaves' noise table, each candidate its worst ratio (error vs float64 over eager's)."""
    for name, label, done, fixed, noisy in findings.judged:
        result = noisy if auto and noisy is not None else fixed
        done["ok"], done["failures"] = result.ok, result.failures
        findings.mismatches.extend((name, f"{name} on {label}: {f}") for f in result.failures)
        if auto and noisy is not None:
            done["noise"] = noisy.noise
            entry = report["candidates"][name]
            ratios = [
                leaf["ratio"] for leaf in noisy.noise.values() if leaf["ratio"] is not None
            ]  # None: eager exact, the floor judged it
            entry["max_noise_ratio"] = max([entry.get("max_noise_ratio", 0.0), *ratios])
    if auto:
        ratios = [c["max_noise_ratio"] for c in report["candidates"].values() if "max_noise_ratio" in c]
        report["max_noise_ratio"] = max(ratios, default=0.0)


def _judge_accuracy(findings: _Findings, report: dict[str, Any], options: ValidateOptions) -> None:
    """Each candidate not meant to be exact, measured over every sample against eager and held to
    the model's budgets (options.accuracy, else DEFAULT_ACCURACY): its report entry gets the
    metrics, a missed budget is a mismatch naming the metric and by how much."""
    budget = budget_of(options.accuracy, DEFAULT_ACCURACY)
    for name, accuracy in findings.accuracy.items():
        if name not in report["candidates"] or name in findings.unloadable:
            continue
        entry = report["candidates"][name]
        measured, missed = judge(accuracy, budget)
        entry["accuracy"] = measured
        entry["max_abs_err"] = measured["metrics"]["max_abs_err"] or 0.0
        findings.mismatches.extend((name, f"{name} misses its accuracy budget: {line}") for line in missed)


def _latency(
    reference: torch.nn.Module,
    candidates: Mapping[str, Callable[..., Any]],
    bound: BoundInputs,
    training: bool,
    runs: int,
) -> dict[str, float]:
    """Median milliseconds per call: eager, then each candidate."""
    latency = {"eager": _median_ms(lambda: _run_eager(reference, bound.clone(), training), runs)}
    for name, fn in candidates.items():
        latency[name] = _median_ms(functools.partial(_run_candidate, fn, bound, training), runs)
    return latency


def _verdicts(findings: _Findings, report: dict[str, Any]) -> set[str]:
    """Each candidate's own verdict into its report entry (passed; else the class and message of
    what went wrong first: its artifact did not load, it raised, its outputs differ); returns the
    names of those that failed."""
    failed = set()
    for name, entry in report["candidates"].items():
        raised = [text for who, text in findings.raised if who == name]
        differs = [text for who, text in findings.mismatches if who == name]
        verdict: dict[str, Any]
        if name in findings.unloadable:
            error_class, text = findings.unloadable[name]
            verdict = {"passed": False, "error_class": error_class.value, "error": text}
        elif raised:
            verdict = {"passed": False, "error_class": ErrorClass.RUNTIME.value, "error": " | ".join(raised[:2])}
        elif differs:
            more = f" (+{len(differs) - 3} more)" if len(differs) > 3 else ""
            verdict = {
                "passed": False,
                "error_class": ErrorClass.NUMERIC_MISMATCH.value,
                "error": " | ".join(differs[:3]) + more,
            }
        else:
            verdict = {"passed": True, "error_class": None, "error": None}
        entry["verdict"] = verdict
        if not verdict["passed"]:
            failed.add(name)
    return failed


def _raise_findings(
    findings: _Findings, report: dict[str, Any], options: ValidateOptions, required: Collection[str]
) -> None:
    """The StageError for the findings about required candidates (and eager disagreeing with
    itself), the report attached; nothing when there are none."""
    unloadable = [found for name, found in findings.unloadable.items() if name in required]
    raised = [text for name, text in findings.raised if name in required]
    mismatches = [text for name, text in findings.mismatches if name in required]
    if findings.nondeterministic:
        raise StageError(
            ErrorClass.NONDETERMINISTIC,
            "the eager model disagrees with itself on the same input, so the export cannot be judged: "
            + " | ".join(findings.nondeterministic[:3]),
            details=report,
        )
    if unloadable:
        raise StageError(unloadable[0][0], " | ".join(text for _, text in unloadable[:3]), details=report)
    if raised:
        raise StageError(ErrorClass.RUNTIME, " | ".join(raised[:3]), details=report)
    close = [text for name, text in findings.mismatches if name in required and name not in findings.accuracy]
    if mismatches and not close:  # only budgets missed: atol and rtol judged none of them
        raise StageError(ErrorClass.NUMERIC_MISMATCH, " | ".join(mismatches[:5]), details=report)
    if mismatches:
        shown = " | ".join(mismatches[:5])
        more = f" (+{len(mismatches) - 5} more)" if len(mismatches) > 5 else ""
        if report["tolerance"]["applied"] == "auto":
            bound = f"{options.noise_multiple:g}x eager's own error against a float64 reference (tolerance: auto)"
        else:
            bound = f"atol={options.atol:g}, rtol={options.rtol:g}"
        raise StageError(ErrorClass.NUMERIC_MISMATCH, f"outputs differ beyond {bound}: {shown}{more}", details=report)
