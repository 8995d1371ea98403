"""The one table printer of eagle-tap: plain-text tables for terminals, Markdown tables for reports.

Here because every part prints tables (the collector's `shards stats`, the client's summary, the
trainer's eval and vocab reports, the demo and the benchmarks) and `capture_format` is the floor they
all stand on; standard library only. Cells arrive as text: each caller formats its own numbers.

    >>> print(text_table([("trained", "0.412"), ("untrained", "0.05")], header=("draft", "acc")))
    draft        acc
    trained    0.412
    untrained   0.05
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["markdown_table", "text_table"]


def text_table(rows: Sequence[Sequence[str]], *, header: Sequence[str] | None = None, align: str = "",
               indent: str = "", gap: int = 2) -> str:
    """rows (and header) as lines of columns padded to their widest cell, `gap` spaces apart.

    align holds `<` (left) or `>` (right) per column; by default the first column is left-aligned
    (labels) and the others right-aligned (numbers). A row may have fewer cells than the widest one.
    No line ends in spaces."""
    table = [list(header)] if header is not None else []
    table += [list(row) for row in rows]
    num_columns = max((len(row) for row in table), default=0)
    align = align or "<" + ">" * (num_columns - 1)
    if len(align) != num_columns or set(align) - {"<", ">"}:
        raise ValueError(f"align {align!r} must hold one of < or > for each of the {num_columns} columns")
    widths = [max((len(row[column]) for row in table if column < len(row)), default=0)
              for column in range(num_columns)]
    lines = []
    for row in table:
        cells = [f"{cell:{align[column]}{widths[column]}}" for column, cell in enumerate(row)]
        lines.append((indent + (" " * gap).join(cells)).rstrip())
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub Markdown table; a `|` inside a cell is written as `&#124;` so it cannot split the cell."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "&#124;") for cell in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *(line(row) for row in rows)])
