"""Output for a file or a pipe, drawn without Rich: the summary's lines and tables exactly as Rich draws them
there (no colour, no terminal control), without importing Rich or laying out its tables. Both cost about
0.05-0.07 s of a 0.35-0.4 s `kvmap replay` piped into a file (measured; most of it Rich's import).

Rules:
- `plain_width(stream)` is the only judge of where this applies: a stream that is not a terminal, with none
  of the variables by which Rich decides otherwise (TTY_COMPATIBLE, FORCE_COLOR, TTY_INTERACTIVE, JUPYTER_*)
  set; it gives the width Rich draws at there (`COLUMNS` if it is a number, else PIPED_WIDTH). Anywhere
  else Rich draws.
- A table is stated once, as a `TableSpec`; text.py's `rich_table` makes Rich's table from it and
  `draw_table` here draws it, so the two never differ in content. `draw_table` draws only what Rich draws
  without wrapping (every cell, the title and the caption ASCII and on one line, the table within the width)
  and gives None for anything else, which Rich then draws. tests/test_plain.py holds the two drawings equal
  byte for byte, at every width.
- Lines are written whole, as Rich writes a soft-wrapped line to a pipe.
"""

from __future__ import annotations

import os

PIPED_WIDTH = 120  # tables when stdout is not a terminal and COLUMNS is unset
WIDE = 100  # from this width tables have full borders (text.py `fit_table`)
RICH_ENV = ("TTY_COMPATIBLE", "FORCE_COLOR", "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "JUPYTER_LINES")

# Rich's HEAVY_HEAD box (from WIDE columns, with edges) and SIMPLE_HEAD (below, no edges): per line its left
# edge, horizontal, divider and right edge (rich/box.py), for the lines a table here uses
_HEAVY = {"top": "┏━┳┓", "head": "┃ ┃┃", "head_row": "┡━╇┩", "mid": "│ ││", "row": "├─┼┤", "bottom": "└─┴┘"}
_SIMPLE = {"head": "    ", "head_row": " ── ", "mid": "    ", "row": "    "}


def plain_width(stream) -> int | None:
    """The width Rich would draw `stream` at without colour or terminal control, or None where Rich draws
    otherwise (a terminal, or the environment says so)."""
    if any(k in os.environ for k in RICH_ENV):
        return None
    try:
        if stream.isatty():
            return None
    except (AttributeError, ValueError, OSError):
        return None
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() else PIPED_WIDTH


class TableSpec:
    """A table's content and layout, drawn by Rich (text.py `rich_table`) or here (`draw_table`).
    `columns`: (header, justify "left" | "right", no_wrap, min_width or None); `rows`: (cells, style or None,
    end_section)."""

    __slots__ = ("title", "caption", "columns", "rows")

    def __init__(self, title: str, caption: str | None = None) -> None:
        self.title = title
        self.caption = caption
        self.columns: list[tuple[str, str, bool, int | None]] = []
        self.rows: list[tuple[tuple[str, ...], str | None, bool]] = []

    def add_column(self, header: str, justify: str = "left", no_wrap: bool = False,
                   min_width: int | None = None) -> None:
        self.columns.append((header, justify, no_wrap, min_width))

    def add_row(self, *cells: str, style: str | None = None, end_section: bool = False) -> None:
        self.rows.append((cells, style, end_section))


def draw_table(spec: TableSpec, width: int) -> list[str] | None:
    """The table's lines as Rich draws them at `width` (text.py `fit_table`'s layout), or None where Rich
    would wrap something."""
    texts = [spec.title, spec.caption or "", *(c[0] for c in spec.columns),
             *(cell for cells, _, _ in spec.rows for cell in cells)]
    if not all(t.isascii() and t.isprintable() for t in texts):
        return None  # wide characters, tabs or newlines: Rich measures and wraps them
    wide = width >= WIDE
    box = _HEAVY if wide else _SIMPLE
    n = len(spec.columns)
    # fit_table: padding (0, 1) with pad_edge from WIDE columns, else (0, 1, 0, 0) without
    pads = [(1, 1) if wide else (0, 1 if i < n - 1 else 0) for i in range(n)]  # (left, right) per column
    widths = []
    for i, (header, _, _, min_width) in enumerate(spec.columns):
        left, right = pads[i]
        w = max([len(header)] + [len(cells[i]) for cells, _, _ in spec.rows]) + left + right
        if min_width is not None:  # Rich clamps to min_width plus the padding without the edge rule
            w = max(w, min_width + (2 if wide else 1))
        widths.append(w)
    extra = (n - 1) + (2 if wide else 0)  # the dividers, and the edges when shown
    table_width = sum(widths) + extra
    if table_width > width or len(spec.title) > table_width or len(spec.caption or "") > table_width:
        return None

    def line(kind: str, cells=None) -> str:
        left, horizontal, divider, right = box[kind]
        if cells is None:
            parts = [horizontal * w for w in widths]
        else:
            parts = []
            for (_, justify, _, _), (pl, pr), w, text in zip(spec.columns, pads, widths, cells):
                room = w - pl - pr
                body = text.ljust(room) if justify == "left" else text.rjust(room)
                parts.append(" " * pl + body + " " * pr)
        inner = divider.join(parts)
        return left + inner + right if wide else inner

    out = [spec.title.ljust(table_width)]
    if wide:
        out.append(line("top"))
    out.append(line("head", [c[0] for c in spec.columns]))
    out.append(line("head_row"))
    for j, (cells, _, end_section) in enumerate(spec.rows):
        out.append(line("mid", cells))
        if end_section and j < len(spec.rows) - 1:  # Rich draws no rule after the last row
            out.append(line("row"))
    if wide:
        out.append(line("bottom"))
    if spec.caption:
        out.append(spec.caption.ljust(table_width))
    return out
