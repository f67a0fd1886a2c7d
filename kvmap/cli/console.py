"""The CLI's two consoles (standard output's and standard error's), and what is drawn on them while a command
works: a spinner, and a progress bar over the trace file.

Rules: a console is Rich's, made the first time something is drawn with it (a command that draws nothing
never imports Rich); asking whether it is a terminal imports Rich only where Rich could say yes. Widths follow
root_help.fit_width (the terminal's, else `COLUMNS`, else PIPED_WIDTH), set per command; a closed reader raises
BrokenPipeError (root_help.new_console), which the error handler turns into a quiet exit 141. Every name shown goes
through `safe`. The spinner and the bar show only at a terminal, and update outside timed regions.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvmap.cli.root_help import fit_width, new_console

__all__ = ["LazyConsole", "ProgressBar", "Spinner", "err", "fit_consoles", "out", "pass_bars", "safe"]

# variables by which Rich may call a stream that is not a tty a terminal
RICH_ENV = ("TTY_COMPATIBLE", "FORCE_COLOR", "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "JUPYTER_LINES")


class LazyConsole:
    """Standard output's or standard error's Rich console, made the first time something is drawn with it. It
    has everything the Rich console has."""

    def __init__(self, stderr: bool = False) -> None:
        self._stderr = stderr
        self._console = None

    def _stream(self):
        return sys.stderr if self._stderr else sys.stdout

    @property
    def rich(self):
        if self._console is None:
            self._console = new_console(self._stderr)
        return self._console

    def fit(self) -> None:
        if self._console is not None:
            fit_width(self._console)

    @property
    def is_terminal(self) -> bool:
        return self._may_be_terminal() and self.rich.is_terminal

    def _may_be_terminal(self) -> bool:
        """False only where Rich certainly sees no terminal: not a tty, and none of RICH_ENV set."""
        if any(k in os.environ for k in RICH_ENV):
            return True
        try:
            return self._stream().isatty()
        except (AttributeError, ValueError, OSError):
            return True

    def __getattr__(self, name: str):
        return getattr(self.rich, name)


out = LazyConsole()
err = LazyConsole(stderr=True)


def fit_consoles() -> None:
    """Both consoles' width by root_help.fit_width (the terminal's, else `COLUMNS`, else PIPED_WIDTH)."""
    for c in (out, err):
        c.fit()


def safe(text: str) -> str:
    """Control characters shown as escapes (the renderers' one rule, kvmap/render/text.py `safe`)."""
    from kvmap.render.text import safe as _safe

    return _safe(text)


class Spinner:
    def __init__(self, enabled: bool, what: str) -> None:
        self.enabled = enabled and err.is_terminal
        self.what = what

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.text import Text

        self.status = err.status(Text(safe(self.what)))
        self.status.start()
        return lambda step: self.status.update(Text(safe(f"{self.what}: step {step}")))

    def __exit__(self, *exc):
        if self.enabled:
            self.status.stop()


class ProgressBar:
    """A Rich progress bar over the trace file (by bytes read: no counting pass), updated outside timed regions.
    Shown before the slow start (numba's kernels load, or compile once into their cache, inside the first
    step), saying what is happening; `label` names the pass (a check replays the trace once per backend)."""

    def __init__(self, enabled: bool, trace, backend: str | None = None, label: str = "replaying") -> None:
        self.enabled = enabled and err.is_terminal
        self.trace = trace
        self.backend = backend
        self.label = label

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        from kvmap.workers.registry import default_backend

        compiled = (self.backend or default_backend()) == "numba"
        first = ("compiling kernels, once (seconds; cached for later runs)" if compiled and not _kernels_cached()
                 else "loading kernels" if compiled else "starting")
        if self.label != "replaying":
            first = f"{self.label}: {first}"
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                            TextColumn("step {task.fields[step]}"), TimeElapsedColumn(), console=err.rich,
                            transient=True)
        self.bar.start()
        task = self.bar.add_task(first, total=self.trace.size_bytes() or None, step="-")
        update, read, label = self.bar.update, self.trace.bytes_read, self.label

        def advance(step: int) -> None:
            update(task, completed=read(), step=step, description=label)

        return advance

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()


def _kernels_cached() -> bool:
    """Whether the CPU kernels are compiled: built at install (kvmap.aot's twins; their sources are checked at
    load), or in numba's cache (index files), looked up without importing numba."""
    import kvmap
    from kvmap.aot import twins_on_disk

    if twins_on_disk():
        return True
    where = os.environ.get("NUMBA_CACHE_DIR")
    folder = Path(where) if where else Path(kvmap.__file__).parent / "workers" / "__pycache__"
    return folder.is_dir() and any(folder.rglob("kernels_cpu.*.nbi"))


def pass_bars(enabled: bool, trace):
    """A progress bar per pass over `trace` (kvmap/validate/deep.py's `progress`): `bars(label, backend)` is a
    context giving the pass's `on_step` (None where nothing is drawn)."""
    return lambda label, backend=None: ProgressBar(enabled, trace, backend, label)
