"""The run summary's table and failure-group lines (flows/cli/summary.py, flows/report/failure_views.py),
rendered from run documents: stage columns are the stages the run had, a cut subject ends at a
word, counts read in the singular where they are one."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from pt2flow.flows.cli.summary import render_run
from pt2flow.flows.report.failure_views import render_run_groups
from pt2flow.flows.report.failures import SUBJECT_CHARS, subject_of
from pt2flow.flows.report.text import clipped, counted


def _rendered(render: Any, what: Any, *args: Any, **kwargs: Any) -> str:
    """What `render(what, console, *args, **kwargs)` prints on a wide console."""
    out = io.StringIO()
    render(what, Console(file=out, width=250), *args, **kwargs)
    return out.getvalue()


def _setup_failure() -> dict[str, Any]:
    """A run whose one model failed before its first stage (a store it could not write)."""
    return {
        "run_id": "20261130T173527Z-60075813",
        "store": "/nowhere/store",
        "summary": {"ok": 0, "failed": 1, "seconds": 8.3},
        "models": [
            {
                "name": "mlp",
                "status": "failed",
                "failed_stage": None,
                "error_class": "storage",
                "error": "the store cannot be written, so nothing ran",
                "stages": {},
                "artifacts": {"serialized": None, "compiled": None},
                "validation": None,
            }
        ],
        "workers": 1,
    }


def test_no_stage_column_a_run_did_not_have() -> None:
    out = _rendered(render_run, _setup_failure())
    header = next(line for line in out.splitlines() if "model" in line and "status" in line)
    assert "ao" not in header and "tr" not in header and "stages" not in out, out  # no stage ran: no stage column
    assert "0 ok, 1 failed" in out and ", 1 worker process" in out and "✗ mlp [storage] at setup:" in out
    given = _rendered(render_run, _setup_failure(), stages=("trace", "serialize"))
    assert "tr se" in given and "tr se ao" not in given, given  # the stages the caller says the run had


def test_a_cut_subject_ends_at_a_word_with_an_ellipsis() -> None:
    message = (
        "pt2flow's own check refused the program before ExecuTorch was called (ExecuTorch plans memory for the largest input, "
        "so pt2flow asks for a maximum on every dynamic dim); unbounded: input 'input_ids' dim 1 (s53)"
    )
    subject = subject_of(message)
    assert len(subject) == SUBJECT_CHARS and subject.endswith(" every dyna")  # the signature's cut: mid-word
    group = {
        "id": "87a4467870de",
        "status": "new",
        "count": 1,
        "error_class": "dynamic_shape",
        "stage": "executorch",
        "subject": subject,
        "where": "-",
        "models": ["tiny-t5/encoder"],
        "models_against": [],
    }
    out = _rendered(render_run_groups, [group], None)
    line = next(line for line in out.splitlines() if line.startswith("  [new] 1 × dynamic_shape at executorch: "))
    assert line.endswith("asks for a maximum on every … — tiny-t5/encoder"), line  # no place in code: no " · -"
    assert out.startswith("1 failure in 1 group by root cause"), out
    # a group of failures the model does not require is said to be one
    expected = _rendered(render_run_groups, [group], None, {("tiny-t5/encoder", "executorch")})
    assert "1 failure (1 not required) in 1 group" in expected and "  [new, not required] 1 × " in expected, expected
    two = _rendered(render_run_groups, [group, {**group, "id": "x", "count": 2, "status": "gone"}], None)
    assert two.startswith("1 failure in 1 group by root cause; 1 group of the previous run gone"), two


def test_counts_and_cuts_in_words() -> None:
    assert [counted(n, "model") for n in (0, 1, 2)] == ["0 models", "1 model", "2 models"]
    assert counted(1, "worker process", "worker processes") == "1 worker process"
    assert counted(3, "worker process", "worker processes") == "3 worker processes"
    assert clipped("short enough", 40) == "short enough"
    assert clipped("every dynamic dim needs a maximum", 20) == "every dynamic dim …"
    assert clipped("x" * 30, 10) == "x" * 9 + "…"  # one long word: cut, as nothing else can be
