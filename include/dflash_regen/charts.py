"""Small inline SVG charts for the report pages: no JavaScript and no CDN, so they render offline.

Every text that reaches the SVG is escaped; the functions return markup ready to embed in HTML.
"""

from __future__ import annotations

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


def time_series(series: dict[str, list[float]], *, bin_s: float, x_title: str, y_title: str) -> str:
    """One line per name over equal time bins starting at 0; a legend below names the colours."""
    if not series or bin_s <= 0:
        return '<p class="muted">no data yet</p>'
    n = max(len(v) for v in series.values())
    y_max = max((max(v) for v in series.values() if v), default=0) or 1
    plot_w, plot_h = WIDTH - PAD_L - 4, HEIGHT - PAD_B - PAD_T
    dx = plot_w / max(n - 1, 1)
    parts = []
    for k, (name, values) in enumerate(series.items()):
        points = " ".join(f"{PAD_L + i * dx:.1f},{HEIGHT - PAD_B - plot_h * v / y_max:.1f}"
                          for i, v in enumerate(values))
        parts.append(f'<polyline fill="none" stroke="{PALETTE[k % len(PALETTE)]}" stroke-width="1.6" '
                     f'points="{points}"><title>{escape(name)}</title></polyline>')
    step = max(1, (n - 1) // 5)
    labels = [(PAD_L + i * dx, f"{i * bin_s:.0f}s") for i in range(0, n, step)]
    legend = "".join(f'<span class="key"><i style="background:{PALETTE[k % len(PALETTE)]}"></i>{escape(name)}</span>'
                     for k, name in enumerate(series))
    return _svg(parts + _axes(y_max, labels, x_title, y_title), y_title) + f'<div class="legend">{legend}</div>'
