"""Small inline SVG charts for the report pages: no JavaScript and no CDN, so they render offline.

Every text that reaches the SVG is escaped; the functions return markup ready to embed in HTML.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

WIDTH, HEIGHT, PAD_L, PAD_B, PAD_T = 720, 220, 56, 34, 14
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")


def _fmt(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.1f}M"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:g}" if v == int(v) else f"{v:.1f}"


def _axes(y_max: float, x_labels: list[tuple[float, str]], x_title: str, y_title: str) -> list[str]:
    plot_h = HEIGHT - PAD_B - PAD_T
    out = [f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{HEIGHT - PAD_B}" class="axis"/>',
           f'<line x1="{PAD_L}" y1="{HEIGHT - PAD_B}" x2="{WIDTH}" y2="{HEIGHT - PAD_B}" class="axis"/>']
    for frac in (0.0, 0.5, 1.0):
        y = HEIGHT - PAD_B - frac * plot_h
        out.append(f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(y_max * frac)}</text>')
    for x, label in x_labels:
        out.append(f'<text x="{x:.1f}" y="{HEIGHT - PAD_B + 14}" text-anchor="middle">{escape(label)}</text>')
    out.append(f'<text x="{(PAD_L + WIDTH) / 2:.0f}" y="{HEIGHT - 4}" text-anchor="middle">{escape(x_title)}</text>')
    out.append(f'<text x="12" y="{PAD_T + plot_h / 2:.0f}" text-anchor="middle" '
               f'transform="rotate(-90 12 {PAD_T + plot_h / 2:.0f})">{escape(y_title)}</text>')
    return out


def _svg(parts: list[str], label: str) -> str:
    return (f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(label)}">'
            + "".join(parts) + "</svg>")


def histogram(bins: list[dict], *, highlight_at_or_below: float, x_title: str, y_title: str = "samples") -> str:
    """Bars for integer-aligned bins ({start, end, count}); bins at or below the threshold are drawn as bad."""
    if not bins:
        return '<p class="muted">no data yet</p>'
    y_max = max(b["count"] for b in bins) or 1
    plot_w, plot_h = WIDTH - PAD_L - 4, HEIGHT - PAD_B - PAD_T
    bar_w = plot_w / len(bins)
    parts = []
    for i, b in enumerate(bins):
        h = plot_h * b["count"] / y_max
        x, y = PAD_L + i * bar_w, HEIGHT - PAD_B - h
        cls = "bar bad" if b["start"] <= highlight_at_or_below else "bar"
        span = str(b["start"]) if b["start"] == b["end"] else f"{b['start']}-{b['end']}"
        parts.append(f'<rect class="{cls}" x="{x + 0.5:.1f}" y="{y:.1f}" width="{max(bar_w - 1, 0.5):.1f}" '
                     f'height="{h:.1f}"><title>{escape(span)}: {b["count"]}</title></rect>')
    step = max(1, len(bins) // 6)
    labels = [(PAD_L + (i + 0.5) * bar_w, str(bins[i]["start"])) for i in range(0, len(bins), step)]
    return _svg(parts + _axes(y_max, labels, x_title, y_title), f"histogram of {x_title}")


def _elapsed(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}" if h else (f"{m}m{s:02d}" if m else f"{s}s")


MARK_COLOURS = {"shard failed": "#d62728", "server unhealthy": "#d62728", "retry": "#e67e22", "relaunch": "#6a3d9a"}


def time_series(series: dict[str, list[float]], *, bin_s: float, x_title: str, y_title: str,
                ticks: Sequence[dict] = (), breaks: Sequence[dict] = (), marks: Sequence[dict] = ()) -> str:
    """One line per name over equal time bins; a legend below names the colours.

    `ticks` ({at, elapsed_s}) label the x axis at bin positions (elapsed time since the start); `breaks`
    ({at, idle_s}) are pauses cut out of the axis, drawn as a gap with their length; `marks` ({at_bin, kind,
    text}) are incidents, a numbered vertical line each (the number refers to the incident list).
    """
    if not series or bin_s <= 0:
        return '<p class="muted">no answers yet</p>'
    n = max(len(v) for v in series.values())
    y_max = max((max(v) for v in series.values() if v), default=0) or 1
    plot_w, plot_h = WIDTH - PAD_L - 4, HEIGHT - PAD_B - PAD_T
    dx = plot_w / max(n - 1, 1)
    cuts = sorted({int(b["at"]) for b in breaks})
    parts = []
    for k, (name, values) in enumerate(series.items()):
        # one polyline per stretch of work: a line across a cut-out pause would invent throughput
        for lo, hi in zip([0, *cuts], [*cuts, len(values)], strict=True):
            points = " ".join(f"{PAD_L + i * dx:.1f},{HEIGHT - PAD_B - plot_h * values[i] / y_max:.1f}"
                              for i in range(lo, hi))
            parts.append(f'<polyline fill="none" stroke="{PALETTE[k % len(PALETTE)]}" stroke-width="1.6" '
                         f'points="{points}"><title>{escape(name)}</title></polyline>')
    for b in breaks:
        x = PAD_L + (b["at"] - 0.5) * dx
        parts.append(f'<line class="break" x1="{x:.1f}" y1="{PAD_T}" x2="{x:.1f}" y2="{HEIGHT - PAD_B}"/>'
                     # at the bottom: the incident marks stack down from the top
                     f'<text class="break" x="{x + 3:.1f}" y="{HEIGHT - PAD_B - 4}">{escape(_elapsed(b["idle_s"]))} '
                     f'idle</text>')
    placed: list[tuple[float, float]] = []
    for number, m in enumerate(marks, 1):
        x = PAD_L + m["at_bin"] * dx
        # marks closer than a circle's width stack downwards instead of hiding each other
        y = PAD_T + 2 + 16 * sum(1 for px, _ in placed if abs(px - x) < 15)
        placed.append((x, y))
        colour = MARK_COLOURS.get(m["kind"], "#333")
        parts.append(f'<g class="mark"><title>{escape(m["text"])}</title>'
                     f'<line x1="{x:.1f}" y1="{PAD_T}" x2="{x:.1f}" y2="{HEIGHT - PAD_B}" stroke="{colour}" '
                     f'stroke-dasharray="3 2"/><circle cx="{x:.1f}" cy="{y}" r="7" fill="{colour}"/>'
                     f'<text x="{x:.1f}" y="{y + 3.5}" text-anchor="middle" fill="#fff">{number}</text></g>')
    segments = sorted(ticks, key=lambda t: t["at"]) or [{"at": 0, "elapsed_s": 0.0}]
    step = max(1, (n - 1) // 5)
    labels, last = [], None
    for i in sorted({int(t["at"]) for t in segments} | set(range(0, n, step))):
        seg = [t for t in segments if t["at"] <= i][-1]
        if last is not None and i - last < step / 2 and i not in cuts:
            continue
        labels.append((PAD_L + i * dx, _elapsed(seg["elapsed_s"] + (i - seg["at"]) * bin_s)))
        last = i
    legend = "".join(f'<span class="key"><i style="background:{PALETTE[k % len(PALETTE)]}"></i>{escape(name)}</span>'
                     for k, name in enumerate(series))
    return _svg(parts + _axes(y_max, labels, x_title, y_title), y_title) + f'<div class="legend">{legend}</div>'
