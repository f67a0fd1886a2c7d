"""The `kvmap` command line's root: the Typer app, the consoles, the one error handler, shared options.

Rules: one Typer app, one function per command (run_cmds.py, check_cmds.py). Every `KvmapError` is caught
once (`user_errors`) and
printed as one line on stderr with its location; the exit code is 2 for unusable input or usage, 1 for
"problems found" (validate) or KV mismatches. Tracebacks are for kvmap's own bugs only.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from kvmap.errors import KvmapError
from kvmap.workers.registry import BUILTIN

app = typer.Typer(
    name="kvmap",
    help="Replay, time, check and explain how vLLM scheduler decisions become paged-KV GPU input tensors.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="rich",
)
out = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    """Replay, time, check and explain how vLLM scheduler decisions become paged-KV GPU input tensors."""
    if version:
        from kvmap import __version__

        out.print(f"kvmap {__version__}")
        raise typer.Exit(0)


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C, so every temporary output is removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame) -> None:
    raise Terminated(signum)


def _silence_stdout() -> None:
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvmapError as e:
            err.print(f"[bold red]kvmap: error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as a shell tool does
            _silence_stdout()
            raise typer.Exit(128 + 13) from None
        except KeyboardInterrupt:
            err.print("kvmap: interrupted")
            raise typer.Exit(130) from None
        except Terminated as t:  # SIGTERM / SIGHUP: outputs were cleaned up on the way out
            err.print(f"kvmap: terminated by signal {t.signum}")
            raise typer.Exit(128 + t.signum) from None

    return wrapper


def parse_steps(spec: str | None) -> tuple[int, int | None]:
    """`START:END`, `START:` or `:END` (END exclusive) -> (start, stop)."""
    if not spec:
        return 0, None
    try:
        a, _, b = spec.partition(":")
        if not _:
            raise ValueError
        start = int(a) if a.strip() else 0
        stop = int(b) if b.strip() else None
    except ValueError:
        raise KvmapError(f"expected START:END (e.g. 100:200, 100: or :50), got {spec!r}", field="--steps") from None
    if start < 0 or (stop is not None and stop <= start):
        raise KvmapError(f"needs 0 <= START < END, got {spec!r}", field="--steps")
    return start, stop


BACKEND_HELP = " | ".join(f"{b.name} ({b.summary})" for b in BUILTIN.values())
TraceArg = Annotated[Optional[Path], typer.Argument(help="Trace file (.jsonl or .jsonl.gz). Default: the "
                                                         "bundled worked example.", show_default=False)]
StepsOpt = Annotated[Optional[str], typer.Option("--steps", help="Only time steps START:END (END exclusive); "
                                                  "earlier steps are still replayed.")]
BackendOpt = Annotated[Optional[str], typer.Option("--backend", "-b", help=f"Worker implementation: {BACKEND_HELP}; "
                                                   "or your own as module:Class or file.py:Class (a subclass of "
                                                   "kvmap.workers.contract.Worker), or a kvmap.backends entry point.",
                                                   show_default=False)]


class spinner:
    def __init__(self, enabled: bool, what: str) -> None:
        self.enabled = enabled and err.is_terminal
        self.what = what

    def __enter__(self):
        if not self.enabled:
            return None
        self.status = err.status(self.what)
        self.status.start()
        return lambda step: self.status.update(f"{self.what}: step {step}")

    def __exit__(self, *exc):
        if self.enabled:
            self.status.stop()


class progress_bar:
    """A Rich progress bar over the trace's steps (counted by lines), updated outside timed regions."""

    def __init__(self, enabled: bool, trace) -> None:
        self.enabled = enabled and err.is_terminal
        self.trace = trace

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        total = sum(1 for _ in self.trace.raw_steps())
        self.bar = Progress(TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            console=err, transient=True)
        self.bar.start()
        task = self.bar.add_task("replay", total=total)
        return lambda step: self.bar.advance(task)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()


def main() -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    app()
