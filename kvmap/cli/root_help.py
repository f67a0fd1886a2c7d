"""`kvmap --help` without typer: the consoles' width rule and what they do when the reader goes away, the root's
help text, options and commands, and the one drawing of the root help.

Rules: `draw` is the root help's only renderer. `KvmapGroup.format_help` calls it with the live app's options
and commands; `kvmap.cli.main` calls it with `OPTIONS` and `COMMANDS` below before anything imports typer
(typer and the command modules stay unloaded; its cost is in docs/performance.md, "Speed twins").
tests/test_startup.py holds the two outputs equal byte for byte, so these lists cannot drift from the app. This
module imports only the standard library (and kvmap/render/text.py's constants) at load, and rich when it draws.
A console whose reader went away (`| head`) raises BrokenPipeError (Rich's own ends the process with exit 1), so
that every command, and the help, ends quietly with PIPE_CLOSED.
"""

from __future__ import annotations

import errno
import os
import sys

from kvmap.render.text import PIPED_WIDTH

PIPE_CLOSED = 128 + 13  # the exit code when the reader of standard output went away: a shell's SIGPIPE code

HELP = "Replay, time, check and explain how vLLM scheduler decisions become paged-KV GPU input tensors."
OPTIONS = (("--version", "Print the version and exit."),
           ("--install-completion", "Install completion for the current shell."),
           ("--show-completion", "Show completion for the current shell, to copy it or customize the installation."),
           ("-h, --help", "Show this message and exit."))
# (name, the first paragraph of its docstring), in the app's order: the command modules' registration order
COMMANDS = (
    ("validate", "Check a trace for every inconsistency; exit 0 if valid, 1 if problems were found, 2 if "
                 "unusable."),
    ("explain", "Show how one step's scheduler decisions become rows, flat tokens, positions, blocks and KV "
                "slots."),
    ("record", "Record a trace from vLLM's real scheduler (no model, no GPU) driven by a workload file."),
    ("traces", "List the bundled traces: each name works as TRACE from any folder (`kvmap replay long_mixed`)."),
    ("replay", "Replay a trace step by step: every index mapping, a real paged KV cache, a timing summary."),
    ("profile", "Replay under Nsight Systems (NVTX + OS runtime, CUDA on a GPU) and show its NVTX ranges per "
                "phase beside kvmap's own timings."),
    ("report", "Re-render a saved run: what produced it (kvmap version, date, command line, host), then the same "
               "summary `kvmap replay` printed."),
    ("compare", "Per-phase ratios B / A of two saved runs of the same work (two backends, two machines, two "
                "versions)."),
)


def fit_width(console) -> None:
    """Width: the terminal's, else `COLUMNS`, else PIPED_WIDTH. Read per command, so that tests can set it."""
    console.width = None  # Rich reads the terminal, then COLUMNS
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console.width = PIPED_WIDTH


def new_console(stderr: bool = False):
    """A Rich console fitted by `fit_width`, that raises BrokenPipeError when its reader goes away."""
    from rich.console import Console

    console = Console(stderr=stderr)
    console.on_broken_pipe = _reader_went_away  # Rich's default: stdout to /dev/null and SystemExit(1)
    fit_width(console)
    return console


def _reader_went_away() -> None:
    raise BrokenPipeError(errno.EPIPE, "the reader of the output went away")


def silence_stdout() -> None:
    """Point standard output at /dev/null, so that nothing written after the reader went away fails again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def draw(console, prog: str, help_text: str, options, commands) -> None:
    """The root help as typer lays it out (usage, text, an Options and a Commands panel), with rich's panel and
    table: typer's rich help formatter imports rich.markdown, markdown_it and pygments, which kvmap never loads."""
    from rich.box import ROUNDED
    from rich.padding import Padding
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    def panel(title: str, rows) -> Panel:
        grid = Table(show_header=False, box=None, pad_edge=False, padding=(0, 2, 0, 0))
        grid.add_column(style="bold cyan", no_wrap=True)
        grid.add_column()
        for name, text in rows:
            grid.add_row(name, text)
        return Panel(grid, title=title, title_align="left", border_style="dim", box=ROUNDED)

    console.print(Padding(Text.assemble(("Usage: ", "yellow"), (f"{prog} ", "bold"), "[OPTIONS] COMMAND [ARGS]..."),
                          (1, 1, 0, 1)))
    console.print(Padding(help_text, (1, 1, 1, 1)), highlight=False)
    console.print(panel("Options", options), highlight=False)
    console.print(panel("Commands", commands), highlight=False)


def first_paragraph(text: str | None) -> str:
    return " ".join((text or "").split("\n\n")[0].split())


def print_root_help() -> None:
    """`kvmap --help`, drawn from the lists above (no typer)."""
    console = new_console()
    draw(console, "kvmap", HELP, OPTIONS, COMMANDS)
    console.print()  # the empty line click's help ends with (its formatter's buffer, echoed)
