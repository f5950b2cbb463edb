"""A small plotting module: horizontal before/after bar charts as inline SVG, with round axis
ticks. The page that holds them stays self-contained: no scripts, nothing fetched."""

from __future__ import annotations

import math
from html import escape
from typing import Any
from collections.abc import Callable, Sequence

COLOR_BEFORE, COLOR_AFTER, COLOR_BAD = "#9aa5b1", "#2f6fde", "#d64545"
MUTED, INK, GRID = "#66707d", "#1d2430", "#e3e6ea"

# (label, before, after, regressed)
Row = tuple[str, Any, Any, bool]

# geometry in px
LABEL_W, PLOT_W, VALUE_W, BAR_H, GAP, TOP_PAD = 170, 320, 130, 10, 10, 24
GROUP_H = 2 * BAR_H + GAP


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def ticks(top: float, binary: bool = False) -> list[float]:
    """Round axis ticks from 0 to at least `top` (in powers of 1024 for sizes: 0, 5 KB, 10 KB...)."""
    if top <= 0:
        return [0.0, 1.0]
    unit = 1.0
    while binary and top / unit >= 1024:
        unit *= 1024
    scaled = top / unit
    step = 10 ** math.floor(math.log10(scaled / 4)) if scaled >= 4 else 10 ** math.floor(math.log10(scaled)) / 2
    for mult in (1, 2, 2.5, 5, 10):
        if scaled / (step * mult) <= 5:
            step *= mult
            break
    return [i * step * unit for i in range(math.ceil(scaled / step - 1e-9) + 1)]


def bar_chart(
    title: str, unit: Callable[[Any], str], rows: Sequence[Row], *, note: str = "", binary: bool = False
) -> str:
    """A horizontal grouped bar chart (before grey, after blue, a regression red) as an inline
    SVG in a <figure> with `title` (and `note`) as its caption."""
    rows = [r for r in rows if r[1] is not None or r[2] is not None]
    if not rows:
        return (
            f'<figure><figcaption>{_e(title)}</figcaption><svg xmlns="http://www.w3.org/2000/svg" width="460" height="40" role="img" aria-label="{_e(title)}: no data">'
            f'<text x="8" y="24" font-size="12" fill="{MUTED}">no records in either run</text></svg></figure>'
        )
    height = TOP_PAD + GROUP_H * len(rows) + 24
    width = LABEL_W + PLOT_W + VALUE_W
    top_value = max(v for r in rows for v in (r[1], r[2]) if v is not None) or 1.0
    axis = ticks(top_value, binary)
    scale_top = max(axis[-1], top_value)

    def x(value: float) -> float:
        return LABEL_W + PLOT_W * (value / scale_top if scale_top else 0)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="{_e(title)}" font-size="11">'
    ]
    parts += _legend()
    axis_y = TOP_PAD + GROUP_H * len(rows)
    for tick in axis:
        tx = x(tick)
        parts.append(f'<line x1="{tx:.1f}" y1="{TOP_PAD - 2}" x2="{tx:.1f}" y2="{axis_y}" stroke="{GRID}" />')
        parts.append(
            f'<text x="{tx:.1f}" y="{axis_y + 14}" text-anchor="middle" fill="{MUTED}">{_e(unit(tick))}</text>'
        )
    for i, row in enumerate(rows):
        parts += _bars(TOP_PAD + i * GROUP_H, row, unit, x)
    parts.append(f'<line x1="{LABEL_W}" y1="{TOP_PAD - 2}" x2="{LABEL_W}" y2="{axis_y}" stroke="{MUTED}" />')
    parts.append("</svg>")
    caption = _e(title) + (f' <span class="muted">{_e(note)}</span>' if note else "")
    return f"<figure><figcaption>{caption}</figcaption>{''.join(parts)}</figure>"


def _legend() -> list[str]:
    return [
        f'<rect x="{LABEL_W + 4}" y="4" width="10" height="10" fill="{COLOR_BEFORE}" /><text x="{LABEL_W + 18}" y="13">before</text>',
        f'<rect x="{LABEL_W + 70}" y="4" width="10" height="10" fill="{COLOR_AFTER}" /><text x="{LABEL_W + 84}" y="13">after</text>',
        f'<rect x="{LABEL_W + 126}" y="4" width="10" height="10" fill="{COLOR_BAD}" /><text x="{LABEL_W + 140}" y="13">regression</text>',
    ]


def _bars(y0: float, row: Row, unit: Callable[[Any], str], x: Callable[[float], float]) -> list[str]:
    """One model: its label, then the before bar and the after bar (each with its value)."""
    name, a, b, bad = row
    shown = name if len(name) <= 26 else name[:25] + "…"
    parts = [
        f'<text x="{LABEL_W - 6}" y="{y0 + BAR_H + 4}" text-anchor="end"><title>{_e(name)}</title>{_e(shown)}</text>'
    ]
    for j, (value, color, which) in enumerate(
        ((a, COLOR_BEFORE, "before"), (b, COLOR_BAD if bad else COLOR_AFTER, "after"))
    ):
        y = y0 + j * BAR_H
        if value is None:
            parts.append(f'<text x="{LABEL_W + 2}" y="{y + BAR_H - 1}" fill="{MUTED}">n/a</text>')
            continue
        w = max(x(value) - LABEL_W, 1.0)
        parts.append(
            f'<rect x="{LABEL_W}" y="{y}" width="{w:.1f}" height="{BAR_H - 1}" fill="{color}"><title>{_e(name)} {which}: {_e(unit(value))}</title></rect>'
        )
        parts.append(f'<text x="{LABEL_W + w + 4:.1f}" y="{y + BAR_H - 1}" fill="{INK}">{_e(unit(value))}</text>')
    return parts


# one colour per line of a line chart (colour-blind safe: Okabe-Ito), in series order
SERIES_COLORS = ("#1d2430", "#0072b2", "#e69f00", "#009e73", "#cc79a7", "#d55e00", "#56b4e9", "#f0e442")
CHART_W, CHART_H, LEFT, RIGHT, BOTTOM = 560, 260, 64, 130, 36


def log_ticks(low: float, high: float) -> list[float]:
    """Round ticks of a log axis from the 1-2-5 value at or below `low` to the one at or above
    `high` (decades only when that gives more than 7)."""
    steps = [
        m * 10.0**e for e in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 2) for m in (1, 2, 5)
    ]
    start = max(i for i, v in enumerate(steps) if v <= low * 1.0001)
    stop = min(i for i, v in enumerate(steps) if v >= high / 1.0001)
    found = steps[start : max(stop, start + 1) + 1]
    if len(found) > 7:
        decades = [v for v in found if f"{v:.0e}".startswith("1")]
        found = [
            min(found[0], decades[0] / 10) if found[0] < decades[0] else decades[0],
            *[d for d in decades if d > found[0]],
            *([decades[-1] * 10] if decades[-1] < high else []),
        ]
    return [float(f"{v:.3g}") for v in found]


def line_chart(
    title: str,
    labels: Sequence[str],
    series: dict[str, Sequence[float | None]],
    *,
    unit: Callable[[Any], str],
    note: str = "",
) -> str:
    """Values against ordered categories (x: `labels`), one line per series, log-scaled y (values
    span orders of magnitude), as an inline SVG in a <figure> captioned `title` (and `note`).
    A None value breaks the line there."""
    caption = _e(title) + (f' <span class="muted">{_e(note)}</span>' if note else "")
    return f"<figure><figcaption>{caption}</figcaption>{line_chart_svg(title, labels, series, unit=unit)}</figure>"


def line_chart_svg(
    title: str,
    labels: Sequence[str],
    series: dict[str, Sequence[float | None]],
    *,
    unit: Callable[[Any], str],
    heading: bool = False,
) -> str:
    """line_chart's SVG alone (a file of its own: `heading` draws the title inside, on white)."""
    values = [v for points in series.values() for v in points if v is not None and v > 0]
    if not values or not labels:
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="460" height="40" role="img" aria-label="{_e(title)}: no data">'
            f'<text x="8" y="24" font-size="12" fill="{MUTED}">nothing was timed</text></svg>'
        )
    axis = log_ticks(min(values), max(values))
    lo, hi = math.log10(axis[0]), math.log10(max(axis[-1], max(values)))
    plot_w, plot_h = CHART_W - LEFT - RIGHT, CHART_H - TOP_PAD - BOTTOM

    def x(i: int) -> float:
        return LEFT + (plot_w * (i + 0.5) / len(labels))

    def y(value: float) -> float:
        return TOP_PAD + plot_h * (1 - (math.log10(value) - lo) / ((hi - lo) or 1.0))

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_W}" height="{CHART_H}" viewBox="0 0 {CHART_W} {CHART_H}" role="img" aria-label="{_e(title)}" font-size="11" font-family="sans-serif">'
    ]
    if heading:
        parts.append(
            f'<rect width="{CHART_W}" height="{CHART_H}" fill="white" /><text x="{LEFT}" y="14" font-size="12" font-weight="600" fill="{INK}">{_e(title)}</text>'
        )
    for tick in axis:
        ty = y(tick)
        parts.append(f'<line x1="{LEFT}" y1="{ty:.1f}" x2="{LEFT + plot_w}" y2="{ty:.1f}" stroke="{GRID}" />')
        parts.append(f'<text x="{LEFT - 6}" y="{ty + 4:.1f}" text-anchor="end" fill="{MUTED}">{_e(unit(tick))}</text>')
    for i, label in enumerate(labels):
        parts.append(
            f'<text x="{x(i):.1f}" y="{TOP_PAD + plot_h + 16}" text-anchor="middle" fill="{MUTED}">{_e(label)}</text>'
        )
    parts.append(
        f'<line x1="{LEFT}" y1="{TOP_PAD + plot_h}" x2="{LEFT + plot_w}" y2="{TOP_PAD + plot_h}" stroke="{MUTED}" />'
    )
    for n, (name, points) in enumerate(series.items()):
        color = SERIES_COLORS[n % len(SERIES_COLORS)]
        dash = ' stroke-dasharray="4 3"' if n >= len(SERIES_COLORS) else ""
        run: list[str] = []
        for i, value in enumerate(list(points) + [None]):
            if value is not None and value > 0:
                run.append(f"{x(i):.1f},{y(value):.1f}")
                parts.append(
                    f'<circle cx="{x(i):.1f}" cy="{y(value):.1f}" r="3" fill="{color}"><title>{_e(name)} at {_e(labels[i])}: {_e(unit(value))}</title></circle>'
                )
            elif run:
                parts.append(
                    f'<polyline points="{" ".join(run)}" fill="none" stroke="{color}" stroke-width="2"{dash} />'
                )
                run = []
        ly = TOP_PAD + 4 + n * 16
        parts.append(
            f'<line x1="{CHART_W - RIGHT + 12}" y1="{ly}" x2="{CHART_W - RIGHT + 30}" y2="{ly}" stroke="{color}" stroke-width="2"{dash} />'
        )
        parts.append(f'<text x="{CHART_W - RIGHT + 35}" y="{ly + 4}" fill="{INK}">{_e(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)
