"""A refusal the config expects, as a newcomer meets it (issue 44): a tiny Llama with a dynamic
cache, whose `.pte` the config does not require. pt2flow's own check refuses the prefill's
program before ExecuTorch is called (no maximum on the prompt axis), so the model is `partial`.

- `pt2flow run` shows that refusal as not required (○, `not required`), never as a failure to
  fix (no ✗ anywhere), with a failure-group line cut at a word boundary, plurals right and only
  the stages the config runs as columns.
- `pt2flow repro` writes a script that says the refusal is pt2flow's own check (what it checks,
  that ExecuTorch was not asked) and exits 3; `--call-library` makes ExecuTorch's own call. Run
  from another folder, it writes only into its own folder.
- `pt2flow get` of the model's archives writes them with open()'s mode, and
  docs/examples/generate_from_components.py on them prints a verdict per prompt, quietly.
"""

from __future__ import annotations

import json
import os
import stat
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, ROOT, cli_env, run_cli, run_in_process, write_config

pytestmark = pytest.mark.integration

pytest.importorskip("transformers")

MODEL = "tiny-llama-dynamic"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("expected")
    shutil.copy(ROOT / "configs" / "generative_models.py", folder / "generative_models.py")
    store = str(folder / "store")
    config = write_config(
        folder / "partial.yaml",
        [
            {
                "name": MODEL,
                "factory": "generative_models:tiny_llama",
                "generate": {"prompt_lens": [2], "max_new_tokens": 4, "cache": "dynamic"},
                "require": ["serialized"],
            }
        ],
        store=store,
        stages=["trace", "serialize", "executorch", "validate"],
        defaults={"executorch": {"partitioners": []}},
    )
    # the summary as the terminal gets it: the console script, cold
    text = subprocess.run(
        [str(BIN / "pt2flow"), "run", str(config)],
        capture_output=True,
        text=True,
        env=cli_env({"COLUMNS": "250"}),
        timeout=900,
        cwd=folder,
    )
    code, document = run_in_process(config)  # warm: the same verdicts, from the cache
    return {"folder": folder, "store": store, "text": text, "code": code, "document": document}


def test_the_refusal_is_not_required_and_the_model_partial(fleet: dict[str, Any]) -> None:
    assert fleet["text"].returncode == 0, fleet["text"].stderr[-3000:]
    assert fleet["code"] == 0, fleet["document"]
    (model,) = fleet["document"]["models"]
    assert model["status"] == "partial", model
    prefill = model["components"]["prefill"]["stages"]["executorch"]
    assert prefill["status"] == "failed" and prefill["error_class"] == "dynamic_shape", prefill
    assert prefill["error"].startswith("refused by pt2flow's own check before ExecuTorch was called"), prefill["error"]
    assert "dims: {NAME: {min: 1, max: 64}}" in prefill["error"]  # a form the config's schema accepts


def test_the_summary_shows_the_refusal_as_not_required(fleet: dict[str, Any]) -> None:
    out = fleet["text"].stdout
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    # nothing to fix: the only failure is one the config does not require (✗ is in the legends alone)
    assert not [line for line in out.splitlines() if line.startswith("✗") or (line.startswith("│") and "✗" in line)]
    table_row, matrix_row = [line for line in out.splitlines() if line.startswith(f"│ {MODEL} ")]
    assert "partial: pte not required" in table_row, out
    assert matrix_row.count("✓") == 1 and matrix_row.count("○") == 1, out  # serialized passed, pte not required
    assert "dynamic_shape @ executorch, not required" in rows["└ prefill"] and "○" in rows["└ prefill"], out
    header = next(line for line in out.splitlines() if "tr se" in line)
    assert "tr se ex va" in header and "ao" not in header and "fu" not in header, header  # the config's stages only
    assert "0 ok, 1 partial, 0 failed" in out and "○ failed, not required" in out, out
    assert ", 1 worker process" in out and "1 failure (1 not required) in 1 group by root cause" in out, out
    assert "(s)" not in out.replace("(s70)", ""), out  # no `failure(s)` / `group(s)`
    (group,) = [line for line in out.splitlines() if line.startswith("  [new, not required] 1 × dynamic_shape")]
    assert " · -" not in group, group  # no place in code to name: the line goes on to its models
    subject = group.split("at executorch: ", 1)[1].split(" · ", 1)[0].split(" — ", 1)[0]
    # the group's subject is the message's first 160 characters: shown cut after a whole word
    assert subject.endswith(" …") and len(subject) < 160, subject
    last_word = subject[:-2].split()[-1]
    assert last_word in prefill_words(fleet), (last_word, subject)
    assert f"○ {MODEL} pte [dynamic_shape]: not required, so {MODEL} is partial as its require: allows" in out, out


def prefill_words(fleet: dict[str, Any]) -> set[str]:
    (model,) = fleet["document"]["models"]
    return set(model["components"]["prefill"]["stages"]["executorch"]["error"].split())


def _script(path: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The reproducer in a plain Python process: no pt2flow on its path, another current folder."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


def test_repro_of_pt2flows_own_check_says_so_and_writes_only_beside_itself(
    fleet: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "repro"
    made = run_cli(["repro", MODEL, "-o", str(out), "--store", fleet["store"]])
    assert made.returncode == 0, made.stderr[-3000:]
    assert "that failure is pt2flow's own check, made before ExecuTorch was called" in made.stdout, made.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    said = _script(out / "repro.py", cwd=elsewhere)
    assert said.returncode == 3, (said.stdout, said.stderr[-3000:])
    lines = said.stdout.splitlines()
    assert lines[0] == (
        "This failure is pt2flow's own check, not an error of ExecuTorch: pt2flow refused the program itself,"
    ), said.stdout
    assert "so ExecuTorch was not asked" in lines[1], said.stdout
    assert lines[2].startswith("It checks that every dynamic dim of the program's inputs has a maximum"), said.stdout
    assert "unbounded: input 'input_ids' dim 1" in said.stdout and "--call-library" in said.stdout
    assert "did not reproduce" not in said.stdout and "does not reproduce" not in said.stdout
    assert said.stderr == "", said.stderr  # said before torch is imported: nothing else to read
    assert list(elsewhere.iterdir()) == []

    # ExecuTorch's own call, asked for: it lowers the program, and its .pte goes beside the script
    called = _script(out / "repro.py", "--call-library", cwd=elsewhere)
    assert called.returncode == 0, called.stderr[-3000:]
    assert called.stdout.splitlines()[-1] == (
        f"ExecuTorch itself accepted the program: the refusal was pt2flow's own check alone (its output is in {out})"
    ), called.stdout
    assert (out / "model.pte").stat().st_size > 0
    assert list(elsewhere.iterdir()) == []
    assert sorted(p.name for p in out.iterdir()) == ["model.pte", "program.pt2", "repro.py"]


def test_the_plain_generation_script_says_per_prompt_whether_the_tokens_match(
    fleet: dict[str, Any], tmp_path: Path
) -> None:
    """docs/examples/generate_from_components.py on what `get` wrote for the model's archives, in a
    fresh process without pt2flow: a verdict line per prompt with the tokens, then the JSON line,
    and nothing on stderr (no torchao, cpuinfo or deprecation lines)."""
    folder = tmp_path / "set"
    got = run_cli(["get", "--model", MODEL, "--artifact", "serialized", "-o", str(folder), "--store", fleet["store"]])
    assert got.returncode == 0, got.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {
        name: 0o666 & ~umask for name in ("prefill.pt2", "decode.pt2", "manifest.json")
    }
    script = ROOT / "docs" / "examples" / "generate_from_components.py"
    argv = [str(script), str(folder), "--factory", "generative_models:tiny_llama", "--path", str(fleet["folder"])]
    argv += ["--prompt-lens", "3,17"]
    code = f"import runpy, sys; sys.modules['pt2flow'] = None; sys.argv = {argv!r}; runpy.run_path({str(script)!r}, run_name='__main__')"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=elsewhere
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stderr == "", ran.stderr[-3000:]
    lines = ran.stdout.strip().splitlines()
    generated = json.loads(lines[-1])  # the JSON line stays the last one
    assert set(generated) == {"3", "17"} and all(run["match"] for run in generated.values()), generated
    assert lines[0] == "generative_models:tiny_llama generating greedily: eager against its serialized components"
    for line, length in zip(lines[1:-1], ("3", "17"), strict=True):
        tokens = generated[length]["eager"]
        assert line == f"prompt of {length} tokens: same tokens as eager ({len(tokens)} new): {tokens}", line
    assert len(generated["3"]["eager"]) == 4 and list(elsewhere.iterdir()) == []
