"""Views of the benchmark stage's report and summary (stages/benchmark.py): a table (terminal,
Markdown), a one-line recommendation for the run summary and a latency-vs-size plot (SVG)."""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping, Sequence

from pt2flow.flows.report.plot import line_chart, line_chart_svg

# the baseline's name in a report (stages/benchmark.EAGER: stages/ is torch's side, not imported here)
EAGER = "eager"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 10 else f"{value:.0f}"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _size(value: int | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024  # type: ignore[assignment]
    return str(value)


def table(report: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per artifact its size, load time, peak memory, then p50 / p90 in ms at
    each size; the fastest at a size is marked with *, a noisy measurement says so, a failure
    shows its error's start."""
    labels = [p["label"] for p in report["points"]]
    best = {label: (choice or {}).get("artifact") for label, choice in report["recommendation"]["points"].items()}
    header = ["artifact", "size", "load ms", "peak MiB", *[f"{label} p50/p90 ms" for label in labels]]
    rows = []
    for name, artifact in report["artifacts"].items():
        cells = [
            name,
            _size(artifact.get("size_bytes")),
            _ms(artifact.get("load_ms")),
            _mb(artifact.get("peak_memory_mb")),
        ]
        for label in labels:
            entry = artifact["points"].get(label) or {}
            if entry.get("p50_ms") is None:
                cells.append(f"failed: {str(entry.get('error') or '?')[:40]}")
                continue
            mark = "*" if best.get(label) == name else ""
            mark += " (noisy)" if entry.get("noisy") else ""
            cells.append(f"{_ms(entry['p50_ms'])} / {_ms(entry['p90_ms'])}{mark}")
        rows.append(cells)
    return header, rows


def markdown(report: Mapping[str, Any], title: str = "") -> str:
    """The table as Markdown, then the recommendation in a sentence."""
    header, rows = table(report)
    lines = [f"**{title}**", ""] if title else []
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(
        lines + ["", recommendation_sentence(report["recommendation"], [p["label"] for p in report["points"]])]
    )


def recommendation_sentence(recommendation: Mapping[str, Any], labels: Sequence[str]) -> str:
    """ "onnx: fastest at 3 of 3 sizes (1.6-2.1x eager)" from a report's recommendation."""
    chosen = recommendation.get("artifact")
    noisy = recommendation.get("noisy") or {}
    if chosen is None:
        if noisy:
            reason = next(iter(noisy.values()))
            return f"no recommendation: timings noisy at {len(noisy)} of {len(labels)} sizes ({reason})"
        return "no artifact was timed"
    points = recommendation.get("points") or {}
    speedups = [
        c["speedup_vs_eager"] for c in points.values() if c and c["artifact"] == chosen and c.get("speedup_vs_eager")
    ]
    low, high = (_x(min(speedups)), _x(max(speedups))) if speedups else ("", "")
    slower = ", slower than eager" if speedups and max(speedups) < 1 else ""
    spread = "" if not speedups else f" ({low} eager{slower})" if low == high else f" ({low}-{high} eager{slower})"
    others = sorted({f"{c['artifact']} at {label}" for label, c in points.items() if c and c["artifact"] != chosen})
    tail = f"; {', '.join(others)}" if others else ""
    tied = [f"{'/'.join(c['tied_with'])} at {label}" for label, c in points.items() if c and c.get("tied_with")]
    if tied:  # within the benchmark's tie_margin of the pick there: as fast, on this machine's noise
        tail += f"; as fast (within the tie margin): {', '.join(tied)}"
    if noisy:
        tail += f"; noisy at {', '.join(noisy)} (none recommended there)"
    return f"recommended: {chosen}, fastest at {recommendation.get('wins', 0)} of {len(labels)} sizes{spread}{tail}"


def _x(value: float) -> str:
    return f"{value:.2g}x" if value < 10 else f"{value:.0f}x"


def summary_line(summary: Mapping[str, Any]) -> str:
    """The run summary's line for one model (its run document's `benchmark`)."""
    points = {
        label: {"artifact": best, "speedup_vs_eager": summary["speedup_vs_eager"].get(label)} if best else None
        for label, best in summary["best"].items()
    }
    wins = sum(1 for best in summary["best"].values() if best == summary["recommended"])
    sentence = recommendation_sentence(
        {"artifact": summary["recommended"], "wins": wins, "points": points, "noisy": summary.get("noisy")},
        summary["points"],
    )
    cost = (summary.get("accuracy") or {}).get(summary["recommended"])
    if cost:  # an int8 artifact: what it saves over the float ones, and what it gives up for it
        sentence += _gain_over_float(summary)
        shown = ", ".join(
            f"{metric} {value:.4g}" for metric in ACCURACY_SHOWN if (value := cost.get(metric)) is not None
        )
        sentence += f"; within its accuracy budget: {shown}"
    return sentence


def _gain_over_float(summary: Mapping[str, Any]) -> str:
    """ "; 2.6x faster than executorch": at the sizes where the recommended artifact (one judged by
    accuracy budgets) was fastest, its speed-up over the fastest float artifact there (neither
    eager nor judged by budgets), per float artifact it beat; "" when no float artifact was timed."""
    chosen, judged = summary["recommended"], set(summary.get("accuracy") or {})
    p50s = summary.get("p50_ms") or {}
    gains: dict[str, list[float]] = {}
    for label, best in summary["best"].items():
        own = (p50s.get(chosen) or {}).get(label)
        floats = [
            (p50, name)
            for name, timed in p50s.items()
            if name != "eager" and name not in judged and (p50 := (timed or {}).get(label))
        ]
        if best == chosen and own and floats:
            p50, name = min(floats)
            gains.setdefault(name, []).append(p50 / own)
    shown = [
        f"{_x(min(found))} faster than {name}"
        if _x(min(found)) == _x(max(found))
        else f"{_x(min(found))}-{_x(max(found))} faster than {name}"
        for name, found in gains.items()
    ]
    return f"; {', '.join(shown)}" if shown else ""


ACCURACY_SHOWN = ("top1_agreement", "sqnr_db", "cosine")  # the metrics the summary line quotes


def _series(summary: Mapping[str, Any]) -> tuple[list[str], dict[str, list[float | None]]]:
    """The sizes, and each artifact's p50 at each, eager (the baseline) first."""
    labels = list(summary["points"])
    names = sorted(summary["p50_ms"], key=lambda name: (name != EAGER, name))
    return labels, {name: [summary["p50_ms"][name].get(label) for label in labels] for name in names}


def plot(summary: Mapping[str, Any], title: str) -> str:
    """Latency (p50, log scale) against size, one line per artifact, as an inline SVG figure."""
    labels, series = _series(summary)
    note = f"recommended: {summary['recommended']}" if summary.get("recommended") else ""
    return line_chart(title, labels, series, unit=lambda v: f"{_ms(v)} ms", note=note)


def plot_file(summary: Mapping[str, Any], title: str) -> str:
    """The same plot as a standalone SVG document (its title inside, on white): a README's figure."""
    labels, series = _series(summary)
    return line_chart_svg(title, labels, series, unit=lambda v: f"{_ms(v)} ms", heading=True)
