"""Small inline SVG charts rendered on the server: a day of hourly values per team, no
JavaScript library. Bars for amounts (tokens), lines for latencies."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from markupsafe import Markup

__all__ = ["Series", "hourly_chart"]

_WIDTH, _HEIGHT = 560, 160
_LEFT, _RIGHT, _TOP, _BOTTOM = 52, 8, 14, 22
_COLOURS = ("#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2")


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    values: Sequence[float | None]  # one per hour, None where there is nothing
    dashed: bool = False


def _nice_ceiling(value: float) -> float:
    if value <= 0:
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0):
        if value <= step * magnitude:
            return step * magnitude
    return 10.0 * magnitude


def _label(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:g}M"
    if value >= 1e3:
        return f"{value / 1e3:g}k"
    return f"{value:g}"


def hourly_chart(
    title: str, hours: Sequence[int], series: Sequence[Series], *, unit: str, bars: bool
) -> Markup:
    """An SVG chart of ``series`` over ``hours`` (epoch hour starts, oldest first)."""
    plot_w = _WIDTH - _LEFT - _RIGHT
    plot_h = _HEIGHT - _TOP - _BOTTOM
    top = _nice_ceiling(max((v for s in series for v in s.values if v is not None), default=0.0))
    slot = plot_w / max(len(hours), 1)

    def y(value: float) -> float:
        return _TOP + plot_h - plot_h * value / top

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_WIDTH} {_HEIGHT}" '
        f'width="{_WIDTH}" height="{_HEIGHT}" role="img" aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
    ]
    for fraction in (0.0, 0.5, 1.0):
        ty = y(top * fraction)
        parts.append(
            f'<line x1="{_LEFT}" x2="{_WIDTH - _RIGHT}" y1="{ty:.1f}" y2="{ty:.1f}" '
            'stroke="#e5e7eb"/>'
            f'<text x="{_LEFT - 4}" y="{ty + 4:.1f}" text-anchor="end" font-size="10" '
            f'fill="#6b7280">{_label(top * fraction)}</text>'
        )
    for i, hour in enumerate(hours):
        if i % 6 == 0 or i == len(hours) - 1:
            label = time.strftime("%H:00", time.gmtime(hour))
            parts.append(
                f'<text x="{_LEFT + (i + 0.5) * slot:.1f}" y="{_HEIGHT - 6}" font-size="10" '
                f'text-anchor="middle" fill="#6b7280">{label}</text>'
            )
    width = slot * 0.8 / max(len(series), 1)
    for n, line in enumerate(series):
        colour = _COLOURS[n % len(_COLOURS)]
        if bars:
            for i, value in enumerate(line.values):
                if value:
                    x = _LEFT + i * slot + slot * 0.1 + n * width
                    parts.append(
                        f'<rect x="{x:.1f}" y="{y(value):.1f}" width="{width:.1f}" '
                        f'height="{_TOP + plot_h - y(value):.1f}" fill="{colour}">'
                        f"<title>{escape(line.name)}: {value:g} {unit}</title></rect>"
                    )
            continue
        points = [
            f"{_LEFT + (i + 0.5) * slot:.1f},{y(v):.1f}"
            for i, v in enumerate(line.values)
            if v is not None
        ]
        if points:
            dash = ' stroke-dasharray="4 3"' if line.dashed else ""
            parts.append(
                f'<polyline points="{" ".join(points)}" fill="none" stroke="{colour}" '
                f'stroke-width="1.5"{dash}><title>{escape(line.name)}</title></polyline>'
            )
    for n, line in enumerate(series):
        colour = _COLOURS[n % len(_COLOURS)]
        parts.append(
            f'<text x="{_LEFT + 4 + 150 * (n % 3)}" y="{_TOP - 3 + 11 * (n // 3)}" '
            f'font-size="10" fill="{colour}">{escape(line.name)} ({unit})</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - every text inside is escaped above
