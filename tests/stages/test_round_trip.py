"""Intermediate programs are stored only when they load back, and carry the modules a fresh process
must import before they do (a pytree output type registered outside torch)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from collections.abc import Iterator

import pytest
import torch

from pt2flow.stages.errors import StageError
from pt2flow.stages.serialize import (
    PYTREE_MODULES,
    archive_metadata,
    check_round_trip,
    program_bytes,
    program_bytes_checked,
    pytree_modules,
)
from tests import models
from tests.stages.helpers import builder, functional, mlp_inputs

ROOT = Path(__file__).resolve().parents[2]
OUTPUT_MODULE = "pt2flow_test_outputs"


@pytest.fixture(scope="module")
def output_type_program(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, torch.export.ExportedProgram]]:
    """A functionalized program whose output is a dataclass registered as a pytree node by a user
    module, the way transformers registers its ModelOutput classes."""
    folder = tmp_path_factory.mktemp("outputs")
    (folder / f"{OUTPUT_MODULE}.py").write_text(
        textwrap.dedent(
            f"""
            from dataclasses import dataclass
            import torch
            import torch.utils._pytree as pytree

            @dataclass
            class Output:
                logits: torch.Tensor

            pytree.register_dataclass(Output, serialized_type_name="{OUTPUT_MODULE}.Output")

            class Model(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.linear = torch.nn.Linear(8, 3)

                def forward(self, x):
                    return Output(torch.relu(self.linear(x)))
            """
        )
    )
    sys.path.insert(0, str(folder))
    try:
        import importlib

        module = importlib.import_module(OUTPUT_MODULE)
        program = functional(builder(module.Model), mlp_inputs(1, 16)).output
        yield folder, program
    finally:
        sys.path.remove(str(folder))


def load_in_fresh_process(
    data: bytes, tmp_path: Path, folder: Path, *, import_modules: bool
) -> subprocess.CompletedProcess[str]:
    """Load the bytes where nothing but torch and pt2flow has been imported (a warm run's worker)."""
    archive = tmp_path / "program.pt2"
    archive.write_bytes(data)
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(folder)!r})
        from pt2flow.stages.errors import StageError
        from pt2flow.stages.serialize import load_archive
        try:
            ep, _ = load_archive(open({str(archive)!r}, "rb").read(), import_pytree_modules={import_modules})
        except StageError as exc:
            print("FAILED", exc.error_class, exc.message)
        else:
            with torch.no_grad():
                print("LOADED", float(ep.module()(torch.ones(2, 8)).logits.sum()))
        """
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_pytree_modules_names_the_registering_module(output_type_program) -> None:
    _, program = output_type_program
    assert pytree_modules(program) == [OUTPUT_MODULE]
    plain = functional(builder(models.tiny_mlp), mlp_inputs(1, 16)).output
    assert pytree_modules(plain) == []  # tuples, lists and dicts are torch's own


@pytest.mark.integration  # fresh processes or a transformers model
def test_a_program_with_a_user_output_type_loads_only_where_that_type_is_registered(
    output_type_program, tmp_path: Path
) -> None:
    folder, program = output_type_program
    # in this process (the cold run, where the model was just built) the plain bytes load back fine
    plain = program_bytes(program)
    assert check_round_trip(plain) is not None
    # a fresh process (the warm run, program from the store) cannot load them; the reason is named
    failed = load_in_fresh_process(plain, tmp_path, folder, import_modules=False)
    assert failed.returncode == 0, failed.stderr
    assert failed.stdout.startswith("FAILED serialization"), failed.stdout
    assert f"Deserializing {OUTPUT_MODULE}.Output in pytree is not registered" in failed.stdout
    assert "Deserializing" not in failed.stderr  # torch's logged traceback is caught, not printed
    # bytes that name no modules: the loader imports the one the type's name points into
    guessed = load_in_fresh_process(plain, tmp_path, folder, import_modules=True)
    assert guessed.stdout.startswith("LOADED"), guessed.stdout + guessed.stderr


@pytest.mark.integration  # fresh processes or a transformers model
def test_checked_bytes_record_the_modules_and_load_in_a_fresh_process(output_type_program, tmp_path: Path) -> None:
    folder, program = output_type_program
    data = program_bytes_checked(program)
    assert archive_metadata(data) == {PYTREE_MODULES: [OUTPUT_MODULE]}
    with torch.no_grad():
        expected = float(program.module()(torch.ones(2, 8)).logits.sum())
    loaded = load_in_fresh_process(data, tmp_path, folder, import_modules=True)
    word, value = loaded.stdout.split()
    assert word == "LOADED", loaded.stdout + loaded.stderr
    assert float(value) == pytest.approx(expected, abs=1e-6)
    without = load_in_fresh_process(data, tmp_path, folder, import_modules=False)
    assert without.stdout.startswith("FAILED serialization"), without.stdout


def _corrupt(data: bytes, member_suffix: str) -> bytes:
    """The same archive with one member's JSON cut in half."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            body = src.read(info)
            if info.filename.endswith(member_suffix):
                body = body[: len(body) // 2]
            dst.writestr(info, body)
    return out.getvalue()


def test_a_corrupt_archive_is_refused_with_its_reason() -> None:
    program = functional(builder(models.tiny_mlp), mlp_inputs(1, 16)).output
    data = program_bytes_checked(program)
    members = zipfile.ZipFile(io.BytesIO(data)).namelist()
    model_json = next(n for n in members if n.endswith("models/model.json"))
    with pytest.raises(StageError) as caught:
        check_round_trip(_corrupt(data, model_json))
    assert caught.value.error_class == "serialization"
    assert "does not load" in caught.value.message
    assert "check the warnings above" not in caught.value.message  # torch's own reason, not its pointer
    with pytest.raises(StageError) as not_zip:
        archive_metadata(b"not a zip")
    assert not_zip.value.error_class == "serialization"
    json.loads(json.dumps(archive_metadata(data)))


def test_a_program_that_does_not_save_is_a_serialization_error() -> None:
    """A pytree type registered without a serialized name cannot be saved at all."""
    from dataclasses import dataclass

    import torch.utils._pytree as pytree

    @dataclass
    class Unnamed:
        y: torch.Tensor

    pytree.register_dataclass(Unnamed)

    class M(torch.nn.Module):
        def forward(self, x):
            return Unnamed(x + 1)

    try:
        ep = torch.export.export(M(), (torch.ones(2),))
        with pytest.raises(StageError) as caught:
            program_bytes_checked(ep)
        assert caught.value.error_class == "serialization" and "save failed" in caught.value.message
    finally:
        pytree._deregister_pytree_node(Unnamed)


@pytest.mark.integration  # fresh processes or a transformers model
def test_gpt2_cold_and_warm_decompose_fail_alike(tmp_path: Path) -> None:
    """The issue's case: a tiny GPT-2's functionalized program, stored and loaded in a fresh process,
    reaches the same decompose failure as the in-memory one once its pytree module is imported."""
    transformers = pytest.importorskip("transformers")
    from pt2flow.stages.decompose import decompose
    from pt2flow.stages.options import DecomposeOptions, FunctionalizeOptions, TraceOptions
    from pt2flow.stages.functionalize import functionalize
    from pt2flow.stages.example_inputs import InputSpec, ModelInputs
    from pt2flow.stages.source import build_model
    from pt2flow.stages.trace import trace

    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64, use_cache=False, bos_token_id=0, eos_token_id=0
    )
    model = build_model(lambda: transformers.GPT2LMHeadModel(config), {})
    inputs = ModelInputs({"input_ids": InputSpec((2, 8), dtype="int64", low=0, high=100)})
    program = functionalize(trace(model, inputs, TraceOptions()).output, FunctionalizeOptions()).output
    with pytest.raises(StageError) as cold:
        decompose(program, DecomposeOptions())
    data = program_bytes_checked(program)
    assert archive_metadata(data)[PYTREE_MODULES] == ["transformers.modeling_outputs"]
    archive = tmp_path / "functionalize.pt2"
    archive.write_bytes(data)
    code = textwrap.dedent(
        f"""
        from pt2flow.stages.decompose import decompose
        from pt2flow.stages.errors import StageError
        from pt2flow.stages.options import DecomposeOptions
        from pt2flow.stages.serialize import load_archive
        data = open({str(archive)!r}, "rb").read()
        for imports in (False, True):
            try:
                decompose(load_archive(data, import_pytree_modules=imports)[0], DecomposeOptions())
            except StageError as exc:
                print(exc.error_class)
        """
    )
    warm = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert warm.stdout.split() == ["serialization", cold.value.error_class], warm.stdout + warm.stderr
    assert cold.value.error_class == "decomposition"
