"""Text out: messages and tables that read well at any width, and never take a name for markup.

Rules: every file name, request id or message kvmap prints goes through `say` or `safe` (control characters
escaped, never Rich markup); tables come from `fit_table` (full borders from WIDE columns, none below, key
columns whole). No numpy, no run data: every renderer uses these. Rich is imported when something is drawn
with it, not at load (the CLI's root help reads PIPED_WIDTH from here before Rich loads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

__all__ = ["PIPED_WIDTH", "WIDE", "fit_box", "fit_table", "safe", "say"]

PIPED_WIDTH = 120  # tables when stdout is not a terminal and COLUMNS is unset
WIDE = 100  # from this width tables have full borders (`fit_table`)


def say(console: Console, text: str | Text, style: str | None = None) -> None:
    """One message: never read as markup, control characters escaped, and never wrapped when piped (so that
    grep finds it whole); at a terminal Rich wraps it at word boundaries."""
    from rich.text import Text

    t = text if isinstance(text, Text) else Text(safe(text), style=style or "")
    console.print(t, soft_wrap=not console.is_terminal, highlight=False)


def safe(text: str) -> str:
    """Control characters (a newline or an escape in a file name or request id) shown as escapes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def fit_box(console: Console):
    """Full borders where they fit; below WIDE columns only a rule under the header."""
    from rich import box

    return box.HEAVY_HEAD if console.width >= WIDE else box.SIMPLE_HEAD


def fit_table(console: Console, title: str | Text, caption: str | Text | None = None) -> Table:
    """A table that keeps its key columns whole at 80 columns: below WIDE no borders and one space of padding
    (about 2 columns saved per column); mark key columns `no_wrap=True` and let the others fold."""
    from rich.table import Table
    from rich.text import Text

    wide = console.width >= WIDE
    title = Text(title) if isinstance(title, str) else title  # never markup: `[batch]` is text
    caption = Text(caption) if isinstance(caption, str) else caption
    return Table(title=title, caption=caption, title_justify="left", caption_justify="left", box=fit_box(console),
                 show_edge=wide, pad_edge=wide, padding=(0, 1) if wide else (0, 1, 0, 0))
