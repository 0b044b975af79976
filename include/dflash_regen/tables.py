"""The one table formatter of the logs and reports: fixed-width text tables (the quality gate's expectations, the
health and smoke gates' servers) and markdown tables (the capacity plan's scenarios, autotune's candidates). Each
caller gives its columns and rows; the layout is spelled here only."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    """A text table's column: its title, its width (None: the last column, as wide as each value), how a value is
    aligned ("<" or ">") and formatted (a format spec after the width: "," for thousands, ".2f", ".60" cuts a text
    to 60 characters), and the spaces before it."""

    title: str
    width: int | None = None
    align: str = "<"
    spec: str = ""
    gap: int = 1

    def head(self) -> str:
        return format(self.title, f"{self.align}{self.width}" if self.width else "")

    def cell(self, value: object) -> str:
        return format(value, f"{self.align}{self.width}{self.spec}" if self.width else self.spec)


def text_table(columns: Sequence[Column], rows: Iterable[Sequence], rule: int | None = None) -> str:
    """The header, a rule of dashes (as long as the header, or `rule` characters) and one line per row, each row's
    values in the columns' order."""
    def line(cells: Iterable[str]) -> str:
        return "".join((" " * c.gap if i else "") + text for i, (c, text) in enumerate(zip(columns, cells,
                                                                                           strict=True)))

    header = line(c.head() for c in columns)
    body = [line(c.cell(v) for c, v in zip(columns, row, strict=True)) for row in rows]
    return "\n".join([header, "-" * (rule or len(header)), *body])


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]], padded: bool = True) -> str:
    """A markdown table of text cells: each column padded to its widest cell (`padded`), else cells as they are and
    a `---` rule under each title."""
    body = [list(r) for r in rows]
    widths = [max(len(r[i]) for r in [head, *body]) if padded else 0 for i in range(len(head))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * max(w + 2, 3) for w in widths) + "|"
    return "\n".join([line(head), rule, *map(line, body)])
