"""check-compat's text and HTML reports (flows/report/compat.py) show every artifact the document
checked: the archive, the package and each deployment target's, in the document's order, with a
failing target's class and error. (Both once showed only the archive and the package, so a target
that no longer loaded appeared only in the summary's count.) The document is check-compat's
shape; tests/integration/test_targets.py renders a real one of every kind."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from pt2flow.flows.report.compat import checked_artifacts, compat_html, render_compat


def _check(sha: str, **fields: Any) -> dict[str, Any]:
    return {
        "sha256": sha * 64,
        "torch_version": "2.13.0",
        "archive_version": None,
        "loads": True,
        "runs": True,
        "matches": True,
        "max_abs_err": 1e-7,
        "error_class": None,
        "error": None,
        **fields,
    }


DOC = {
    "run_id": "r1",
    "runs": ["r1"],
    "selection": None,
    "store": "/s",
    "torch_version": "2.13.0",
    "built_with": ["2.13.0"],
    "summary": {"ok": 0, "failed": 1},
    "models": [
        {
            "name": "mlp",
            "status": "failed",
            "error_class": "incompatible",
            "note": None,
            "run_id": "r1",
            "archive": _check("a"),
            "compiled": _check("c"),
            "onnx": _check(
                "b",
                runs=False,
                matches=None,
                max_abs_err=None,
                error_class="incompatible",
                error="onnxruntime: opset 99 is not supported",
            ),
            "pte": _check("d"),
            "pytree_modules": ["tests.models"],
        }
    ],
}


def test_every_checked_kind_is_a_row_in_document_order() -> None:
    assert [kind for kind, _ in checked_artifacts(DOC["models"][0])] == ["archive", "compiled", "onnx", "pte"]
    console = Console(record=True, width=300)
    render_compat(DOC, console)
    text = console.export_text()
    rows = [
        line
        for line in text.splitlines()
        if "aaaaaaaaaaaa" in line or "cccccccccccc" in line or "bbbbbbbbbbbb" in line or "dddddddddddd" in line
    ]
    assert [next(k for k in ("archive", "compiled", "onnx", "pte") if f"{k} " in row) for row in rows] == [
        "archive",
        "compiled",
        "onnx",
        "pte",
    ]
    onnx = next(row for row in rows if "onnx bbbbbbbbbbbb" in row)
    assert "NO" in onnx and "incompatible" in onnx, onnx
    assert "mlp onnx: incompatible: onnxruntime: opset 99 is not supported" in text
    assert "0 compatible, 1 not" in text


def test_the_html_page_has_a_row_per_checked_kind_under_one_model_cell() -> None:
    page = compat_html(DOC)
    assert '<td rowspan="4">mlp</td>' in page
    for kind, letter in (("archive", "a"), ("compiled", "c"), ("onnx", "b"), ("pte", "d")):
        assert f"<td>{kind} <code>{letter * 12}</code></td>" in page, kind
    assert "onnxruntime: opset 99 is not supported" in page
