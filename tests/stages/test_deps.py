"""Dependency manifest: local files by content, installed distributions by version, stdlib and
pt2flow left out, found again in a reused worker process."""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from collections.abc import Iterator

import pytest
import torch

from pt2flow.stages import deps, distributions
from pt2flow.stages.options import TraceOptions
from pt2flow.stages.example_inputs import InputSpec, ModelInputs
from pt2flow.stages.source import build_model, import_factory
from pt2flow.stages.trace import trace

_counter = itertools.count()


@dataclass
class Project:
    """A config folder with a factory module importing a helper, and a fake installed distribution."""

    folder: Path
    site: Path
    models: str  # module names, unique per test (sys.modules is shared by the whole session)
    layers: str
    dist: str

    @property
    def layers_file(self) -> Path:
        return self.folder / f"{self.layers}.py"

    def set_dist_version(self, version: str, requires: tuple[str, ...] = ("sympy",)) -> None:
        """What pip does on an upgrade: a new <name>-<version>.dist-info folder replaces the old one."""
        for old in self.site.glob(f"{self.dist}-*.dist-info"):
            for child in old.iterdir():
                child.unlink()
            old.rmdir()
        info = self.site / f"{self.dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {self.dist}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {name}\n" for name in requires)
        )
        (info / "top_level.txt").write_text(f"{self.dist}\n")


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Project]:
    n = next(_counter)
    p = Project(tmp_path / "config", tmp_path / "site", f"my_models_{n}", f"layers_{n}", f"fakedist{n}")
    p.folder.mkdir()
    p.site.mkdir()
    (p.site / p.dist).mkdir()
    (p.site / p.dist / "__init__.py").write_text("SCALE = 2.0\n")
    p.set_dist_version("1.0")
    p.layers_file.write_text(
        textwrap.dedent(
            f"""
            import collections, json
            import torch
            import {p.dist}
            from pt2flow.stages import errors  # pt2flow's own: left out

            class Block(torch.nn.Module):
                def forward(self, x):
                    return torch.relu(x) * {p.dist}.SCALE
            """
        )
    )
    (p.folder / f"{p.models}.py").write_text(f"from {p.layers} import Block\n\ndef make():\n    return Block()\n")
    sys.path.insert(0, str(p.site))
    sys.path.insert(0, str(p.folder))
    try:
        yield p
    finally:
        for entry in (str(p.site), str(p.folder)):
            while entry in sys.path:
                sys.path.remove(entry)
        for name in (p.models, p.layers, p.dist):
            sys.modules.pop(name, None)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_and_trace(p: Project) -> torch.nn.Module:
    factory = import_factory(f"{p.models}:make", str(p.folder))
    model = build_model(factory, {})
    trace(model, ModelInputs({"x": InputSpec((2, 3))}), TraceOptions())
    return model


def model_manifest(p: Project, model: torch.nn.Module) -> dict:
    """As the source stage seeds it: the factory's module and the model's classes."""
    return deps.manifest([p.models, *(type(m) for m in model.modules())], str(p.folder))


def test_manifest_of_a_traced_model(project: Project) -> None:
    model = build_and_trace(project)
    m = model_manifest(project, model)
    assert m["files"] == {
        f"{project.models}.py": sha(project.folder / f"{project.models}.py"),
        f"{project.layers}.py": sha(project.layers_file),
    }
    dists = m["distributions"]
    assert dists[project.dist] == "1.0"
    assert dists["torch"] == metadata.version("torch")
    assert dists["sympy"] == metadata.version("sympy")  # required by torch and by the fake dist
    assert json.loads(json.dumps(m)) == m
    assert deps.changed_entries(m, str(project.folder)) == []


def test_stdlib_and_pt2flow_are_left_out(project: Project) -> None:
    model = build_and_trace(project)
    m = model_manifest(project, model)
    stdlib = os.path.dirname(os.__file__)
    own = Path(deps.__file__).resolve().parent.parent
    for name in m["files"]:
        path = Path(name) if os.path.isabs(name) else project.folder / name
        assert not str(path).startswith(stdlib), name
        assert not str(path.resolve()).startswith(str(own / "stages")), name
    assert "pt2flow" not in m["distributions"]
    kinds = deps.dependency_modules([project.models], str(project.folder))
    assert "json" not in kinds and "collections" not in kinds and "pt2flow.stages.errors" not in kinds
    assert kinds[project.layers].kind == "file" and kinds["torch"].kind == "dist"


def test_editing_a_helper_module_names_it(project: Project) -> None:
    model = build_and_trace(project)
    m = model_manifest(project, model)
    project.layers_file.write_text(project.layers_file.read_text().replace("torch.relu", "torch.sigmoid"))
    assert deps.changed_entries(m, str(project.folder)) == [f"{project.layers}.py: content changed"]
    project.layers_file.unlink()
    assert deps.changed_entries(m, str(project.folder)) == [f"{project.layers}.py: file missing"]


def test_a_new_distribution_version_is_detected(project: Project) -> None:
    model = build_and_trace(project)
    m = model_manifest(project, model)
    project.set_dist_version("2.0")
    assert deps.changed_entries(m, str(project.folder)) == [f"{project.dist}: 1.0 -> 2.0"]
    assert distributions.installed_distributions()[project.dist].version == "2.0"
    assert metadata.version(project.dist) == "2.0"  # what importlib itself now reports


def test_an_upgrade_that_brings_a_new_requirement_records_it(project: Project) -> None:
    """Requirements are read once per dist-info folder (stages/distributions.py): a reinstall of
    the same version with another requirement (an editable project's), seen by the same long-lived
    process, records what it now requires, and so does an upgrade."""
    model = build_and_trace(project)
    before = model_manifest(project, model)["distributions"]
    assert "sympy" in before and "pyyaml" not in before
    project.set_dist_version("1.0", requires=("sympy", "PyYAML"))
    reinstalled = model_manifest(project, model)["distributions"]
    assert reinstalled[project.dist] == "1.0"
    assert reinstalled["pyyaml"] == metadata.version("pyyaml")
    project.set_dist_version("2.0", requires=("sympy",))
    upgraded = model_manifest(project, model)["distributions"]
    assert upgraded[project.dist] == "2.0" and "pyyaml" not in upgraded


def test_worker_reuse_modules_imported_before_still_count(project: Project) -> None:
    """A reused worker: the factory's modules were imported by an earlier model, so none is new."""
    importlib.import_module(project.models)
    model = build_and_trace(project)
    m = model_manifest(project, model)
    assert f"{project.layers}.py" in m["files"]
    assert m["distributions"][project.dist] == "1.0"
    # and the same manifest as a fresh process would record (the walk, not the import history)
    m_factory_only = deps.manifest([project.models], str(project.folder))
    assert m_factory_only == m
    # found by walking the factory module's imports, not by its folder: no search_path given
    walked = deps.manifest([project.models])
    assert walked["files"] == {
        p.as_posix(): sha(p) for p in (project.folder / f"{project.models}.py", project.layers_file)
    }
    assert walked["distributions"] == m["distributions"]


def test_constant_imported_by_name_counts(tmp_path: Path, project: Project) -> None:
    """`from consts import SCALE` leaves no module object in the importer's globals; the import
    statement still names the module."""
    (project.folder / "consts_x.py").write_text("SCALE = 3.0\n")
    (project.folder / "uses_x.py").write_text("from consts_x import SCALE\n")
    try:
        importlib.import_module("uses_x")
        m = deps.manifest(["uses_x"])  # no search_path: absolute file names
        assert str((project.folder / "consts_x.py").as_posix()) in m["files"]
    finally:
        sys.modules.pop("uses_x", None)
        sys.modules.pop("consts_x", None)


def test_check_imports_neither_torch_nor_user_modules(project: Project) -> None:
    model = build_and_trace(project)
    m = model_manifest(project, model)
    project.layers_file.write_text("raise SystemExit('imported!')\n")
    code = textwrap.dedent(
        f"""
        import json, sys
        sys.path[:0] = [{str(project.folder)!r}, {str(project.site)!r}]
        from pt2flow.stages import deps
        print(json.dumps(deps.changed_entries(json.loads(sys.argv[1]), {str(project.folder)!r})))
        print("torch" in sys.modules, {project.layers!r} in sys.modules)
        """
    )
    root = Path(deps.__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(m)], capture_output=True, text=True, cwd=root, check=True
    )
    changes, imported = out.stdout.splitlines()
    assert json.loads(changes) == [f"{project.layers}.py: content changed"]
    assert imported == "False False"


def test_installed_modules_under_the_config_folder_count_only_when_used(project: Project) -> None:
    """A virtual environment inside the config's folder: its loaded distributions are not all the
    model's dependencies; only those the model's modules import are."""
    other = project.site / f"other_{project.dist}"
    other.mkdir()
    (other / "__init__.py").write_text("")
    info = project.site / f"other_{project.dist}-3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: other_{project.dist}\nVersion: 3.0\n")
    (info / "top_level.txt").write_text(f"other_{project.dist}\n")
    try:
        importlib.import_module(f"other_{project.dist}")
        importlib.import_module(project.models)
        m = deps.manifest([project.models], str(project.folder.parent))
        assert m["distributions"][project.dist] == "1.0"
        assert f"other-{project.dist}" not in m["distributions"]
        assert set(m["files"]) == {f"config/{project.models}.py", f"config/{project.layers}.py"}
    finally:
        sys.modules.pop(f"other_{project.dist}", None)


def test_manifest_does_not_depend_on_what_the_process_imported_before(project: Project) -> None:
    """The rule reads source files, not sys.modules: an import inside a function that has not run
    yet counts, and a sibling model's module that an earlier model loaded into this (reused)
    worker does not, so a fresh worker and a reused one record the same manifest."""
    (project.folder / f"lazy_{project.models}.py").write_text(
        f"def make():\n    import {project.layers}\n    return {project.layers}.Block()\n"
    )
    (project.folder / f"sibling_{project.models}.py").write_text("import json\n")
    lazy = f"lazy_{project.models}"
    try:
        before = deps.manifest([lazy], str(project.folder))  # nothing of it imported yet
        assert project.layers not in sys.modules
        importlib.import_module(f"sibling_{project.models}")  # another model's module, loaded first
        model = build_model(import_factory(f"{lazy}:make", str(project.folder)), {})
        after = deps.manifest([lazy, *(type(m) for m in model.modules())], str(project.folder))
        assert before == after
        assert set(after["files"]) == {f"{lazy}.py", f"{project.layers}.py"}  # no sibling
        assert after["distributions"][project.dist] == "1.0"  # reached through layers' import
    finally:
        for name in (lazy, f"sibling_{project.models}"):
            sys.modules.pop(name, None)
