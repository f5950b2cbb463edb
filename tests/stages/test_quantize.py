"""PT2E int8 (stages/quantize.py): the functional program quantized with XNNPACK's quantizer,
calibrated, converted, lowered to a .pte; validate judges it by accuracy budgets
(stages/accuracy.py), not allclose. Ground truth from outside pt2flow: the .pte run by the
ExecuTorch runtime in a plain interpreter, its outputs measured there against eager. The outlier
channel that misses a budget until its modules stay float, and a calibration change rebuilding
only the int8 artifacts, are tests/integration/test_int8.py's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from pt2flow.stages.binding import bind_inputs
from pt2flow.stages.errors import StageError
from pt2flow.stages.example_inputs import InputSpec, ModelInputs
from pt2flow.stages.executorch_target import load_pte
from pt2flow.stages.options import Bound, ValidateOptions
from pt2flow.stages.quantize import calibration_seeds, load_int8_package, quantize_for_executorch, quantize_for_inductor
from pt2flow.stages.result import StageResult
from pt2flow.stages.target_options import Int8Options
from pt2flow.stages.targets import TargetArtifact
from pt2flow.stages.validate import validate
from pt2flow.stages.vocabulary import ErrorClass
from tests import models
from tests.conftest import run_plain_script
from tests.stages.conftest import TargetCase, _target_case

pytest.importorskip("executorch")
pytest.importorskip("torchao")
pytestmark = pytest.mark.integration  # quantizes and lowers to ExecuTorch (5-15 s each)


def image_inputs() -> ModelInputs:
    return ModelInputs({"x": InputSpec((2, 3, 16, 16))}, {}, {})


def int8(case: TargetCase, **options: object) -> StageResult:
    chosen = Int8Options(**options)  # type: ignore[arg-type]
    eager = case.build()
    calibration = [bind_inputs(eager, case.inputs, seed=s) for s in calibration_seeds(chosen)]
    return quantize_for_executorch(case.program, calibration, bind_inputs(eager, case.inputs), chosen)


def judged(case: TargetCase, pte: bytes, **validate_options: object) -> dict:
    result = validate(
        case.build,
        case.inputs,
        case.dims,
        ValidateOptions(**validate_options),  # type: ignore[arg-type]
        targets={"executorch_int8": TargetArtifact(pte, load_pte, exact=False)},
    )
    return result.output


@pytest.fixture(scope="module")
def convnet() -> TargetCase:
    return _target_case(models.small_convnet, image_inputs())


@pytest.fixture(scope="module")
def convnet_int8(convnet: TargetCase) -> StageResult:
    return int8(convnet)


PLAIN_SCRIPT = """
import json, sys, torch
from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
sys.path.insert(0, sys.argv[3])
from tests import models
torch.manual_seed(0)
model = models.small_convnet().eval()
data = open(sys.argv[1], "rb").read()  # kept: the runtime reads the program from these bytes
runtime = _load_for_executorch_from_buffer(data)
x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(int(sys.argv[2])))
out = runtime.forward((x,))[0]
ref = model(x).detach()
noise = ((out - ref) ** 2).sum()
print(json.dumps({
    "sqnr_db": float(10 * torch.log10((ref ** 2).sum() / noise)) if noise > 0 else None,
    "argmax_agrees": bool((out.argmax(1) == ref.argmax(1)).all()),
    "max_abs_err": float((out - ref).abs().max()),
}))
"""


def run_plain(script: str, artifact: Path, seed: int) -> dict[str, Any]:
    """`script` run by this interpreter with no variable of pt2flow's or the tests' (PATH alone):
    the artifact's path, the seed of its input and the repository (for tests.models) as its
    arguments; the JSON line it printed last."""
    return run_plain_script(script, artifact, seed, Path(__file__).resolve().parents[2])


def test_a_conv_net_in_int8_runs_in_a_plain_interpreter_within_its_budget(
    convnet: TargetCase, convnet_int8: StageResult, tmp_path: Path
) -> None:
    meta = convnet_int8.metadata
    assert meta["backends"] == ["XnnpackBackend"] and meta["calibration_batches"] == 8
    assert meta["quantize_ops"], meta  # quantize/dequantize pairs went into the program: it is int8
    pte = tmp_path / "model.int8.pte"
    pte.write_bytes(convnet_int8.output)
    # the model as tests.models builds it under pt2flow's builder: seeded the same way
    built = convnet.build()
    assert torch.equal(built.conv.weight, (torch.manual_seed(0), models.small_convnet())[1].conv.weight)
    seen = run_plain(PLAIN_SCRIPT, pte, 12345)
    # int8, not float: close to eager, not equal to it
    assert seen["sqnr_db"] is not None and 20 < seen["sqnr_db"] < 120, seen
    assert seen["argmax_agrees"] and 0 < seen["max_abs_err"] < 0.05, seen

    report = judged(convnet, convnet_int8.output)
    entry = report["candidates"]["executorch_int8"]
    assert report["passed"] and entry["verdict"]["passed"], entry["verdict"]
    metrics = entry["accuracy"]["metrics"]
    assert 20 < metrics["sqnr_db"] < 120 and metrics["top1_agreement"] == 1.0 and metrics["cosine"] > 0.99
    assert entry["accuracy"]["budget"] == {"sqnr_db": {"min": 20.0, "max": None}}  # the default budget
    assert report["max_abs_err"] == 0.0  # the exact candidates' figure: the int8 one has its own
    assert entry["max_abs_err"] == metrics["max_abs_err"] > 0


def test_a_budget_the_int8_artifact_misses_fails_it_naming_the_metric(
    convnet: TargetCase, convnet_int8: StageResult
) -> None:
    with pytest.raises(StageError) as caught:
        judged(convnet, convnet_int8.output, accuracy={"sqnr_db": Bound(min=150.0), "top1_agreement": {"min": 0.5}})
    assert caught.value.error_class == ErrorClass.NUMERIC_MISMATCH
    assert "executorch_int8 misses its accuracy budget: sqnr_db" in caught.value.message
    assert "< 150 (min)" in caught.value.message and "top1_agreement" not in caught.value.message
    # allclose would have failed it too: the budget, not atol, is what judged it
    report = judged(convnet, convnet_int8.output, atol=0.0, rtol=0.0)
    assert report["candidates"]["executorch_int8"]["verdict"]["passed"]


def test_a_dynamic_batch_and_sequence_are_kept_through_quantization(seq_case: TargetCase) -> None:
    pte = int8(seq_case)
    runner = load_pte(pte.output)
    for sizes in ({"batch": 1, "seq": 2}, {"batch": 5, "seq": 11}):
        bound = seq_case.bound(**sizes)
        (x,) = [t for _, t, _ in bound.tensor_leaves()]
        hidden, pooled = runner([x])
        assert hidden.shape == (sizes["batch"], sizes["seq"], 8) and pooled.shape == (sizes["batch"], 8)


def test_a_float_module_the_model_does_not_have_is_a_config_error(convnet: TargetCase) -> None:
    with pytest.raises(StageError) as caught:
        int8(convnet, float_modules=("fc", "cnov"))
    assert caught.value.error_class == ErrorClass.CONFIG
    assert "float_modules names ['cnov']" in caught.value.message and "conv, fc" in caught.value.message


PLAIN_PACKAGE_SCRIPT = """
import json, sys, torch
sys.path.insert(0, sys.argv[3])
from tests import models
torch.manual_seed(0)
model = models.small_convnet().eval()
package = torch._inductor.aoti_load_package(sys.argv[1])
x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(int(sys.argv[2])))  # a static batch
out, ref = package(x), model(x).detach()
print(json.dumps({
    "sqnr_db": float(10 * torch.log10((ref ** 2).sum() / ((out - ref) ** 2).sum())),
    "argmax_agrees": bool((out.argmax(1) == ref.argmax(1)).all()),
}))
"""


@pytest.mark.compile
def test_a_conv_net_in_an_int8_aotinductor_package_runs_in_a_plain_interpreter(
    convnet: TargetCase, tmp_path: Path
) -> None:
    options = Int8Options()
    eager = convnet.build()
    calibration = [bind_inputs(eager, convnet.inputs, seed=s) for s in calibration_seeds(options)]
    package = quantize_for_inductor(convnet.program, calibration, bind_inputs(eager, convnet.inputs), options)
    assert package.metadata["quantize_ops"] and package.metadata["inductor_configs"] == {"freezing": True}
    path = tmp_path / "model.int8.pt2"
    path.write_bytes(package.output)
    seen = run_plain(PLAIN_PACKAGE_SCRIPT, path, 99)
    assert seen["argmax_agrees"] and 20 < seen["sqnr_db"] < 120, seen  # int8: close to eager, not equal

    report = validate(
        convnet.build,
        convnet.inputs,
        convnet.dims,
        ValidateOptions(),
        targets={"aot_compile_int8": TargetArtifact(package.output, load_int8_package, exact=False)},
    ).output
    metrics = report["candidates"]["aot_compile_int8"]["accuracy"]["metrics"]
    assert report["passed"] and metrics["sqnr_db"] > 20 and metrics["top1_agreement"] == 1.0, metrics


def unit_images(seed: int) -> dict[str, torch.Tensor]:
    """A batch of the conv net's data as its user has it: images in [0, 1)."""
    return {"x": torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))}


def test_int8_accuracy_is_measured_on_the_models_own_evaluation_batches(convnet: TargetCase) -> None:
    """Calibrated on the model's own data (images in [0, 1)), its int8 artifact is judged on
    held-out batches of that data (`data.evaluation`), not on validate's random samples, half of
    whose values are negatives that an input scale calibrated on [0, 1) clips. Ground truth: the
    SQNR computed here from ExecuTorch's own runtime on those batches; and check-compat, from the
    stored samples, judges on the same batches alone."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    from pt2flow.stages.compat import check_artifact
    from pt2flow.stages.validation_io import unpack

    eager = convnet.build()
    calibration = [bind_inputs(eager, ModelInputs(unit_images(seed))) for seed in range(8)]
    pte = quantize_for_executorch(convnet.program, calibration, bind_inputs(eager, convnet.inputs), Int8Options())
    target = {"executorch_int8": TargetArtifact(pte.output, load_pte, exact=False)}
    evaluation = [((), unit_images(100 + i)) for i in range(4)]

    with pytest.raises(StageError) as caught:  # on random samples: far outside what it was calibrated for
        validate(convnet.build, convnet.inputs, convnet.dims, ValidateOptions(), targets=target)
    assert caught.value.error_class == ErrorClass.NUMERIC_MISMATCH
    assert caught.value.message.startswith("executorch_int8 misses its accuracy budget: sqnr_db ")  # no atol in it
    random_sqnr = caught.value.details["candidates"]["executorch_int8"]["accuracy"]["metrics"]["sqnr_db"]
    assert random_sqnr < 20

    result = validate(
        convnet.build, convnet.inputs, convnet.dims, ValidateOptions(), targets=target, evaluation=evaluation
    )
    report = result.output
    measured = report["candidates"]["executorch_int8"]["accuracy"]
    assert report["passed"] and report["evaluation"] == 4
    assert measured["on"] == "evaluation" and measured["measured_on"] == 4
    labels = [s["label"] for s in report["candidates"]["executorch_int8"]["samples"]]
    assert labels[-4:] == [f"evaluation[{i}]" for i in range(4)] and len(labels) == report["samples"] + 4

    runtime = _load_for_executorch_from_buffer(pte.output)
    noise = signal = 0.0
    for _, batch in evaluation:
        out, ref = runtime.forward((batch["x"],))[0], eager(batch["x"]).detach()
        noise, signal = noise + float(((out - ref) ** 2).sum()), signal + float((ref**2).sum())
    by_hand = 10 * math.log10(signal / noise)
    assert measured["metrics"]["sqnr_db"] == pytest.approx(by_hand, abs=1e-3) and by_hand > 30 > random_sqnr

    samples = unpack(result.side["io"])
    assert [s.label for s in samples][-4:] == [f"evaluation[{i}]" for i in range(4)]
    budget = {"sqnr_db": {"min": 20.0}}
    rechecked = check_artifact("pte-int8", pte.output, samples, 0.0, 0.0, flat=load_pte, accuracy=budget)
    assert rechecked["matches"] and rechecked["samples"] == len(samples), rechecked
    strict = check_artifact(
        "pte-int8", pte.output, samples, 0.0, 0.0, flat=load_pte, accuracy={"sqnr_db": {"min": by_hand + 1}}
    )
    assert not strict["matches"] and f"sqnr_db {by_hand:.4g} < " in strict["error"], strict


PLAIN_BERT_SCRIPT = """
import json, sys, torch
import torch.utils._pytree as pytree
from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
sys.path.insert(0, sys.argv[3])
from tests.hf_models import bert_tiny
model = bert_tiny()  # seeds itself: the weights pt2flow's build had
generator = torch.Generator().manual_seed(int(sys.argv[2]))
ids, mask = torch.randint(0, 100, (2, 8), generator=generator), torch.ones(2, 8, dtype=torch.long)
reference = [t.detach() for t in pytree.tree_leaves(model(input_ids=ids, attention_mask=mask))]
pte = open(sys.argv[1] + ".pte", "rb").read()  # kept: the runtime reads the program from these bytes
outputs = {
    "pte": list(_load_for_executorch_from_buffer(pte).forward((ids, mask))),
    "package": pytree.tree_leaves(torch._inductor.aoti_load_package(sys.argv[1] + ".pt2")(ids, mask)),  # positional
}
def sqnr(out, ref):
    return float(10 * torch.log10((ref ** 2).sum() / ((out - ref) ** 2).sum()))
print(json.dumps({kind: [sqnr(o, r) for o, r in zip(leaves, reference)] + [len(leaves)] for kind, leaves in outputs.items()}))
"""


@pytest.mark.compile
def test_tiny_bert_in_int8_runs_in_executorch_and_aotinductor_in_a_plain_interpreter(tmp_path: Path) -> None:
    """A transformers encoder nobody on the team wrote (tiny random BERT, an integer attention
    mask whose arithmetic must stay integer), quantized for both runtimes: each artifact, run by
    its runtime in an interpreter without pt2flow against transformers' own eager model, is
    int8 (close to eager, not equal) on both of its outputs."""
    from tests.hf_models import bert_tiny

    inputs = ModelInputs(
        {
            "input_ids": InputSpec((2, 8), "int64", low=0, high=100),
            "attention_mask": InputSpec((2, 8), "int64", value=1),
        }
    )
    case = _target_case(bert_tiny, inputs)
    options = Int8Options()
    eager = case.build()
    calibration = [bind_inputs(eager, inputs, seed=s) for s in calibration_seeds(options)]
    example = bind_inputs(eager, inputs)
    (tmp_path / "bert.pte").write_bytes(quantize_for_executorch(case.program, calibration, example, options).output)
    package = quantize_for_inductor(case.program, calibration, example, options)
    assert package.metadata["quantize_ops"], package.metadata
    (tmp_path / "bert.pt2").write_bytes(package.output)
    seen = run_plain(PLAIN_BERT_SCRIPT, tmp_path / "bert", 5)
    for kind in ("pte", "package"):
        *sqnrs, leaves = seen[kind]
        assert leaves == 2 and all(20 < s < 120 for s in sqnrs), (kind, seen)
