"""Hostile configs: what tests/flows/test_config.py does not already cover.

- YAML tags in the forms that test does not try (object/new, verbose !<tag:...>, a %TAG
  directive), each with a payload that would create a marker file; and the same through
  `pt2flow run`, which must exit 2 and leave nothing behind.
- Model names with path tricks beyond the ASCII ones (percent-encoded slashes, Unicode look-alike
  dots and slashes), all reported at once by `pt2flow run`.
- A factory that is not `module:callable`, naming a real module that would create a marker file
  when imported: rejected before any import, both by the config loader and by the stage that
  imports factories (stages.source.import_factory, a second line of defence).
- YAML structures that would hang or crash the loader: "billion laughs" aliases, self-referencing
  aliases, nesting deeper than Python's recursion limit.
"""

from __future__ import annotations

import json
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
import yaml

from pt2flow.flows.config.issues import ConfigError
from pt2flow.flows.config.load import MAX_CONFIG_DEPTH, MAX_CONFIG_NODES, load_config, parse_config
from pt2flow.flows.config.reading import safe_yaml
from pt2flow.stages.errors import StageError
from pt2flow.stages.source import import_factory
from tests.conftest import ROOT, run_cli

# ---------------------------------------------------------------------------------------------
# YAML tags

# Each payload, loaded with yaml.unsafe_load, creates {marker}; safe_load must refuse them all.
TAG_PAYLOADS = {
    "object-new": 'version: 1\nstore: !!python/object/new:os.system ["touch {marker}"]\nmodels: []\n',
    "apply-builtin-open": 'version: 1\nstorage_options: {{x: !!python/object/apply:builtins.open ["{marker}", "w"]}}\nmodels: []\n',
    "apply-subprocess": 'version: 1\nmodels:\n  - name: a\n    factory: !!python/object/apply:subprocess.check_call [[touch, "{marker}"]]\n',
    "verbose-tag": 'version: 1\nstore: !<tag:yaml.org,2002:python/object/apply:os.system> ["touch {marker}"]\nmodels: []\n',
    "tag-directive": '%TAG !py! tag:yaml.org,2002:python/\n---\nversion: 1\nstore: !py!object/apply:os.system ["touch {marker}"]\nmodels: []\n',
    "in-dims": 'version: 1\nmodels:\n  - name: a\n    dims: {{b: !!python/object/apply:os.system ["touch {marker}"]}}\n',
}


@pytest.mark.parametrize("name", sorted(TAG_PAYLOADS))
def test_python_tags_in_every_form_are_refused_and_never_run(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "pwned"
    config = tmp_path / "evil.yaml"
    config.write_text(TAG_PAYLOADS[name].format(marker=marker))
    with pytest.raises(ConfigError) as info:
        load_config(config)
    (issue,) = info.value.issues
    assert "could not determine a constructor for the tag" in issue.message
    assert not marker.exists()


@pytest.mark.parametrize("name", sorted(TAG_PAYLOADS))
def test_the_tag_payloads_are_live(tmp_path: Path, name: str) -> None:
    """An unsafe YAML loader does run each payload above, so the test above proves something."""
    marker = tmp_path / "ran"
    handle = yaml.unsafe_load(TAG_PAYLOADS[name].format(marker=marker))
    del handle
    assert marker.exists()


def test_pt2flow_run_refuses_a_tagged_config_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    config = tmp_path / "evil.yaml"
    config.write_text(
        "version: 1\nmodels:\n  - name: a\n    factory: tests.models:tiny_mlp\n"
        f'    kwargs: {{hidden: !!python/object/apply:os.system ["touch {marker}"]}}\n'
        "    inputs: {x: {shape: [3, 8]}}\n"
    )
    store = tmp_path / "store"
    proc = run_cli(["run", str(config), "--store", str(store), "--json"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    assert f"{config}:5: (top level): YAML error: could not determine a constructor for the tag" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not marker.exists()
    assert not store.exists()


# ---------------------------------------------------------------------------------------------
# model names

LOOKALIKE_NAMES = [
    "%2F",  # percent-encoded slash
    "..%2fetc",  # dot-dot plus an encoded slash
    "%2e%2e%2f",  # all encoded
    "%252e%252e",  # double-encoded
    "\uff0e\uff0e",  # FULLWIDTH FULL STOP twice (NFKC folds it to '..')
    "\u2024\u2024",  # ONE DOT LEADER twice
    "a\uff0fb",  # FULLWIDTH SOLIDUS
    "a\u2215b",  # DIVISION SLASH
    "x\u0000",  # trailing NUL
    "\u0000",  # a lone NUL
    "a/../b",
    "..\\..\\x",
    "C:evil",
    "x\r",
]


@pytest.mark.parametrize("name", LOOKALIKE_NAMES, ids=[repr(n) for n in LOOKALIKE_NAMES])
def test_lookalike_model_names_are_rejected(name: str) -> None:
    text = f"version: 1\nmodels:\n  - name: {json.dumps(name)}\n    factory: tests.models:tiny_mlp\n    inputs: {{x: {{shape: [3, 8]}}}}\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="cfg.yaml", base_dir=str(ROOT))
    (issue,) = info.value.issues
    assert issue.path == "models[0].name"
    assert "is not a valid model name" in issue.message


def test_pt2flow_run_reports_every_bad_name_and_creates_no_store(tmp_path: Path) -> None:
    names = ["../escape", "a/b", "nul\u0000byte", "%2e%2e"]
    body = "".join(
        f"  - name: {json.dumps(n)}\n    factory: tests.models:tiny_mlp\n    inputs: {{x: {{shape: [3, 8]}}}}\n"
        for n in names
    )
    config = tmp_path / "names.yaml"
    config.write_text("version: 1\nmodels:\n" + body)
    store = tmp_path / "store"
    proc = run_cli(["run", str(config), "--store", str(store)], timeout=120)
    assert proc.returncode == 2
    assert f"{len(names)} problems in the config" in proc.stderr
    for i in range(len(names)):
        assert f"models[{i}].name:" in proc.stderr
    assert not store.exists()
    assert not (tmp_path / "escape").exists()


# ---------------------------------------------------------------------------------------------
# factories that are not module:callable, naming a module that must never be imported

BAD_FORMS = [
    "{m}",  # no callable at all
    "{m}:make()",  # a call
    "{m}:make:extra",
    "{m}:make; import os",
    "{m}:__import__('os').system('id')",
    "{m}.:make",
    " {m}:make",
    "{m}:make ",
    "{m}:",
    "./{m}:make",
    "../{m}:make",
    "{m}/x:make",
    "{m}:make\u0000",
    "{m}:make.",
]


@pytest.fixture
def marker_module(tmp_path: Path):
    """A module beside the config that writes <name>.imported if it is ever executed."""
    name = f"hostile_factory_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    path.write_text(
        "from pathlib import Path\nPath(__file__).with_suffix('.imported').write_text('ran')\n\n\ndef make():\n    return None\n"
    )
    yield name, path.with_suffix(".imported")
    sys.modules.pop(name, None)


@pytest.mark.parametrize("form", BAD_FORMS, ids=[repr(f) for f in BAD_FORMS])
def test_bad_factory_forms_are_rejected_by_the_config_before_any_import(
    tmp_path: Path, marker_module, form: str
) -> None:
    module, imported = marker_module
    factory = form.format(m=module)
    text = (
        f"version: 1\nmodels:\n  - name: m\n    factory: {json.dumps(factory)}\n    inputs: {{x: {{shape: [3, 8]}}}}\n"
    )
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="cfg.yaml", base_dir=str(tmp_path))
    (issue,) = info.value.issues
    assert issue.path == "models[0].factory"
    assert "is not of the form 'package.module:callable'" in issue.message
    assert not imported.exists()
    assert module not in sys.modules


@pytest.mark.parametrize("form", BAD_FORMS, ids=[repr(f) for f in BAD_FORMS])
def test_bad_factory_forms_are_rejected_by_import_factory_before_any_import(
    tmp_path: Path, marker_module, form: str
) -> None:
    """The stage that imports factories checks the form itself (a model built without the config loader)."""
    module, imported = marker_module
    with pytest.raises(StageError) as info:
        import_factory(form.format(m=module), str(tmp_path))
    assert info.value.error_class == "config"
    assert "is not of the form 'module:callable'" in info.value.message
    assert not imported.exists()
    assert module not in sys.modules
    assert str(tmp_path) not in sys.path


def test_the_marker_module_is_live(tmp_path: Path, marker_module) -> None:
    """Importing the marker module for real does leave the marker: the tests above mean something."""
    module, imported = marker_module
    assert callable(import_factory(f"{module}:make", str(tmp_path)))
    assert imported.exists()


def test_pt2flow_validate_rejects_a_bad_factory_without_importing(tmp_path: Path, marker_module) -> None:
    module, imported = marker_module
    config = tmp_path / "c.yaml"
    config.write_text(
        f"version: 1\nmodels:\n  - name: m\n    factory: '{module}:make()'\n    inputs: {{x: {{shape: [3, 8]}}}}\n"
    )
    proc = run_cli(["validate", str(config)], timeout=120)
    assert proc.returncode == 2
    assert f"{config}:4: models[0].factory: '{module}:make()' is not of the form" in proc.stderr
    assert not imported.exists()


# ---------------------------------------------------------------------------------------------
# YAML structures that would hang or crash the loader


def _laughs(levels: int, where: str) -> str:
    """A 'billion laughs' document: each anchor is a list of ten aliases of the previous one."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]")
    block = "\n".join("      " + line for line in lines)
    if where == "storage_options":
        return (
            "version: 1\nstorage_options:\n  bomb:\n"
            + block.replace("      ", "    ", -1)
            + "\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [3, 8]}}\n"
        )
    return (
        "version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [3, 8]}}\n    kwargs:\n"
        + block
        + "\n"
    )


STRUCTURE_BOMBS = {
    "laughs-in-storage-options": (
        _laughs(9, "storage_options"),
        f"more than {MAX_CONFIG_NODES} values once YAML aliases are expanded",
    ),
    "laughs-in-kwargs": (_laughs(9, "kwargs"), f"more than {MAX_CONFIG_NODES} values once YAML aliases are expanded"),
    "recursive-kwargs": (
        "version: 1\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    kwargs: &k {a: *k}\n    inputs: {x: {shape: [3, 8]}}\n",
        "a YAML alias contains itself",
    ),
    "recursive-storage-options": (
        "version: 1\nstorage_options: {x: &s [1, *s]}\nmodels:\n  - name: m\n    factory: tests.models:tiny_mlp\n    inputs: {x: {shape: [3, 8]}}\n",
        "a YAML alias contains itself",
    ),
    "nested-past-the-cap": (
        "version: 1\nstore: " + "[" * (MAX_CONFIG_DEPTH + 5) + "]" * (MAX_CONFIG_DEPTH + 5) + "\nmodels: []\n",
        f"nested deeper than {MAX_CONFIG_DEPTH} levels",
    ),
    # refused as the scanner opens the 101st bracket (PyYAML alone took seconds to reach its RecursionError)
    "nested-past-pythons-limit": (
        "version: 1\nstore: " + "[" * 5000 + "]" * 5000 + "\nmodels: []\n",
        f"nested deeper than {MAX_CONFIG_DEPTH} levels",
    ),
    # block sequences nest without brackets: the composer's RecursionError refuses them
    "block-nested-past-pythons-limit": (
        "version: 1\nstore:\n  " + "- " * 5000 + "x\nmodels: []\n",
        "nested too deeply to parse",
    ),
}


# "quickly" as a bound on work, not on seconds (a shared machine's seconds vary): the parse and its
# checks make at most this many Python function calls. Measured: 5,000 to 135,000 for these
# documents; walking a billion-laughs document's expansion would take over 10**9.
CALL_BUDGET = 1_000_000


def python_calls(work: Callable[[], Any]) -> tuple[int, Exception | None]:
    """How many Python function calls `work()` makes (sys.setprofile's `call` events), and what it raised."""
    calls = 0

    def count(_frame: Any, event: str, _arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        work()
    except Exception as exc:  # noqa: BLE001 - the caller checks what was raised
        return calls, exc
    finally:
        sys.setprofile(None)
    return calls, None


@pytest.mark.parametrize("name", sorted(STRUCTURE_BOMBS))
def test_yaml_structure_bombs_are_rejected_quickly(name: str) -> None:
    text, fragment = STRUCTURE_BOMBS[name]
    calls, raised = python_calls(lambda: parse_config(text, source="bomb.yaml", base_dir=str(ROOT)))
    assert isinstance(raised, ConfigError), raised
    (issue,) = raised.issues
    assert fragment in issue.message
    assert 0 < calls < CALL_BUDGET, calls


def test_aliases_within_the_caps_still_work() -> None:
    text = textwrap.dedent(
        """\
        version: 1
        models:
          - name: a
            factory: tests.models:tiny_mlp
            inputs: &shared {x: {shape: [3, 8]}}
            kwargs: &kw {hidden: 4}
          - name: b
            factory: tests.models:tiny_mlp
            inputs: *shared
            kwargs: *kw
        """
    )
    pipeline = parse_config(text, source="ok.yaml", base_dir=str(ROOT))
    assert [m.name for m in pipeline.models] == ["a", "b"]
    assert pipeline.model("b").kwargs == {"hidden": 4}


def test_brackets_nested_to_the_cap_load_and_one_more_is_refused_at_its_line() -> None:
    """The scanner's bound (flows/config/problems.py ConfigLoader) never refuses what the walk
    after it accepts: MAX_CONFIG_DEPTH brackets under a top-level key load, one more does not."""

    def nested(levels: int) -> str:
        return "version: 1\nstore: " + "[" * levels + "]" * levels + "\nmodels: []\n"

    value = safe_yaml(nested(MAX_CONFIG_DEPTH), "cap.yaml")["store"]
    depth = 0
    while isinstance(value, list):
        value, depth = (value[0] if value else None), depth + 1
    assert depth == MAX_CONFIG_DEPTH
    with pytest.raises(ConfigError) as refused:
        safe_yaml(nested(MAX_CONFIG_DEPTH + 1), "cap.yaml")
    (issue,) = refused.value.issues
    assert issue.message == f"config rejected: nested deeper than {MAX_CONFIG_DEPTH} levels" and issue.line == 2
