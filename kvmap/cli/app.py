"""The `kvmap` command line's root: the Typer app, the consoles, the one error handler, shared options.

Rules: one Typer app, one function per command (run_cmds.py, check_cmds.py). Every `KvmapError` is caught
once (`user_errors`) and printed as one line on stderr with its location; usage errors (an unknown option, a
bad value) are one line too (`KvmapGroup.main`), never Rich's boxed panel; the exit code is 2 for unusable
input or usage, 1 for "problems found" (validate) or KV mismatches. Tracebacks are for kvmap's own bugs only.
Flags show as flags in the help (no `<bool>` value). Consoles honour `COLUMNS`; piped without it they are 120
wide; file names and request ids are never read as markup, and messages are never wrapped when piped.
"""

from __future__ import annotations

import errno
import functools
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from kvmap.cli.root_help import draw, first_paragraph, fit_width
from kvmap.errors import KvmapError
from kvmap.workers.registry import BUILTIN

from typer import Abort

try:  # typer >= 0.23 carries its own click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer on click
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError



class KvmapGroup(TyperGroup):
    """The root group: flags without a value type in the help, and every usage error as one line."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for cmd in (self, *self.commands.values()):
            for param in cmd.params:
                _flag_shows_no_type(param)
            cmd.get_help_option = _help_option_without_type(cmd.get_help_option)

    def format_help(self, ctx, formatter) -> None:
        """The root's help, drawn by root_help.draw (the one drawing; `kvmap --help` itself draws it before
        typer is imported) from the live options and commands. Subcommands keep typer's."""
        fit_consoles()
        options = [rec for p in self.get_params(ctx) if (rec := p.get_help_record(ctx)) is not None]
        commands = [(name, first_paragraph(cmd.short_help or cmd.help)) for name in self.list_commands(ctx)
                    if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        draw(out, ctx.command_path, first_paragraph(self.help), options, commands)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rc = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NoArgsIsHelpError as e:  # the help is already printed
            rc = e.exit_code
        except ClickException as e:
            from rich.text import Text

            fit_consoles()
            err.print(Text.assemble(("kvmap: error: ", "bold red"), usage_line(e)), soft_wrap=True,
                      highlight=False)
            rc = e.exit_code
        except Abort:
            err.print("kvmap: aborted")
            rc = 1
        if not standalone_mode:
            return rc
        sys.exit(rc if isinstance(rc, int) else 0)


METAVARS = {int: "N", float: "N", str: "TEXT"}  # short value names keep the help's text column wide at 80


def _flag_shows_no_type(param) -> None:
    if param is None or param.metavar is not None or getattr(param, "param_type_name", "") != "option":
        return
    if getattr(param, "is_flag", False):
        param.metavar = ""  # the help's type column shows nothing for a flag (not `<bool>`)
        return
    desc = getattr(param, "type_descriptor", None)  # typer >= 0.23; older typer keeps click's own names
    if desc is not None:
        param.metavar = "FILE" if getattr(desc, "is_path", False) else METAVARS.get(getattr(desc, "annotation", None))


def _help_option_without_type(get_help_option):
    def wrapped(ctx):
        opt = get_help_option(ctx)
        _flag_shows_no_type(opt)
        return opt

    return wrapped


def usage_line(e: ClickException) -> str:
    """`option --warmup: 'x' is not a valid integer (see 'kvmap replay --help')` on one line."""
    from kvmap.errors import format_location

    param = getattr(e, "param", None)
    names = [o for o in getattr(param, "opts", []) if o.startswith("--")] or getattr(param, "opts", [])[:1]
    message = getattr(e, "message", None) or e.format_message()
    if param is not None and getattr(param, "param_type_name", "") == "option" and names:
        msg = f"{format_location(field=names[0])}: {message}"
    else:
        msg = e.format_message()
    ctx = getattr(e, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return " ".join(msg.split()) + hint


app = typer.Typer(
    name="kvmap",
    cls=KvmapGroup,
    help="Replay, time, check and explain how vLLM scheduler decisions become paged-KV GPU input tensors.",
    no_args_is_help=True,
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="rich",
)


class LazyConsole:
    """Standard output's or standard error's Rich console, made the first time something is drawn with it:
    importing Rich is about 0.05 s of a command, and a replay piped into a file never needs it (its summary is
    drawn without Rich, kvmap/run/plain.py). It has everything the Rich console has, plus `plain_width()`
    (where Rich would draw without colour or terminal control, the width it would draw at; else None) and
    `write_lines` (lines written whole, as Rich writes them there)."""

    def __init__(self, stderr: bool = False) -> None:
        self._stderr = stderr
        self._console = None

    def _stream(self):
        return sys.stderr if self._stderr else sys.stdout

    @property
    def rich(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=self._stderr)
            fit_width(self._console)
        return self._console

    def fit(self) -> None:
        if self._console is not None:
            fit_width(self._console)

    @property
    def is_terminal(self) -> bool:
        return self.plain_width() is None and self.rich.is_terminal

    def plain_width(self) -> int | None:
        from kvmap.run.plain import plain_width

        return plain_width(self._stream())

    def write_lines(self, lines: list[str]) -> None:
        stream = self._stream()
        stream.write("".join(line + "\n" for line in lines))
        stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.rich, name)


out = LazyConsole()
err = LazyConsole(stderr=True)


def fit_consoles() -> None:
    """Both consoles' width by root_help.fit_width (the terminal's, else `COLUMNS`, else PIPED_WIDTH)."""
    for c in (out, err):
        c.fit()


def _version(value: bool) -> None:
    if value:
        from kvmap import __version__

        print(f"kvmap {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", is_eager=True,
                                          callback=_version)] = False,
) -> None:
    """Replay, time, check and explain how vLLM scheduler decisions become paged-KV GPU input tensors."""
    if ctx.invoked_subcommand is None:
        raise UsageError("missing command", ctx=ctx)


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


# what writing an output can meet that is no fault of kvmap's or of its input (other OS errors stay tracebacks)
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS, errno.EBADF}


def user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        fit_consoles()
        try:
            return fn(*args, **kwargs)
        except KvmapError as e:
            from rich.text import Text

            err.print(Text.assemble(("kvmap: error: ", "bold red"), safe(str(e))), highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as a shell tool does
            _silence_stdout()
            raise typer.Exit(128 + 13) from None
        except OSError as e:  # the machine, not kvmap: a full disk or an I/O error under an output
            if e.errno not in WRITE_ERRNOS:
                raise
            what = f"{safe(str(e.filename))}: " if e.filename else "cannot write the output: "
            try:
                err.print(f"kvmap: error: {what}{e.strerror or e}", highlight=False, soft_wrap=True, markup=False)
            except OSError:  # standard error is the output that fails
                pass
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("kvmap: interrupted")
            raise typer.Exit(130) from None
        except Terminated as t:  # SIGTERM / SIGHUP: outputs were cleaned up on the way out
            err.print(f"kvmap: terminated by signal {t.signum}")
            raise typer.Exit(128 + t.signum) from None

    return wrapper


def safe(text: str) -> str:
    """Control characters shown as escapes (the renderers' one rule, kvmap/run/report.py `safe`)."""
    from kvmap.run.text import safe as _safe

    return _safe(text)


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
TraceArg = Annotated[Optional[Path], typer.Argument(help="Trace file (.jsonl or .jsonl.gz), or a bundled trace's "
                                                         "name (`kvmap traces`) from any folder. Default: the "
                                                         "bundled worked example.", show_default=False)]
StepsOpt = Annotated[Optional[str], typer.Option("--steps", metavar="START:END", help="Measure steps START:END "
                                                  "(END exclusive, either may be left out); earlier steps are still "
                                                  "replayed.")]
WarmupOpt = Annotated[int, typer.Option("--warmup", help="Steps replayed first and not counted: the N steps just "
                                         "before the --steps window (timed, excluded), or for a window from 0 its "
                                         "first N steps, by a throwaway worker (untimed).", min=0)]
BackendOpt = Annotated[Optional[str], typer.Option("--backend", "-b", metavar="NAME", help=f"Worker implementation: "
                                                   f"{BACKEND_HELP} (triton on CPU needs TRITON_INTERPRET=1); or "
                                                   "your own as module:Class or file.py:Class (a subclass of "
                                                   "kvmap.workers.contract.Worker), or a kvmap.backends entry point.",
                                                   show_default=False)]


class spinner:
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


class progress_bar:
    """A Rich progress bar over the trace file (by bytes read: no counting pass), updated outside timed regions.
    Shown before the slow start (numba's kernels load, or compile once into their cache, inside the first
    step), saying what is happening."""

    def __init__(self, enabled: bool, trace, backend: str | None = None) -> None:
        self.enabled = enabled and err.is_terminal
        self.trace = trace
        self.backend = backend

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        from kvmap.workers.registry import default_backend

        compiled = (self.backend or default_backend()) == "numba"
        first = ("compiling kernels, once (seconds; cached for later runs)" if compiled and not _kernels_cached()
                 else "loading kernels" if compiled else "starting")
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                            TextColumn("step {task.fields[step]}"), TimeElapsedColumn(), console=err.rich,
                            transient=True)
        self.bar.start()
        task = self.bar.add_task(first, total=self.trace.size_bytes() or None, step="-")
        update, read = self.bar.update, self.trace.bytes_read

        def advance(step: int) -> None:
            update(task, completed=read(), step=step, description="replaying")

        return advance

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()


def _kernels_cached() -> bool:
    """Whether the CPU kernels are compiled: built at install (kvmap.aot's twins; their sources are checked at
    load), or in numba's cache (index files), looked up without importing numba."""
    import os

    import kvmap
    from kvmap.aot import twins_on_disk

    if twins_on_disk():
        return True
    where = os.environ.get("NUMBA_CACHE_DIR")
    folder = Path(where) if where else Path(kvmap.__file__).parent / "workers" / "__pycache__"
    return folder.is_dir() and any(folder.rglob("kernels_cpu.*.nbi"))


# Commands that hold nothing past their own return (every file they write is closed inside the command), so
# the process may end without Python's teardown; `record` (vLLM) and `profile` (nsys) end the usual way.
FAST_EXIT = {"replay", "validate", "explain", "report", "compare", "traces"}


def command_name(cmd) -> str:
    """A registered command's name on the command line (typer's rule: the function name, `_` as `-`)."""
    return cmd.name or cmd.callback.__name__.replace("_", "-")


def main() -> None:
    """Run the app. SIGTERM and SIGHUP unwind like Ctrl-C (temporary outputs removed). After a command in
    `FAST_EXIT`, flush and end the process at once: tearing the interpreter down with numba's LLVM loaded
    took 0.3-1 s of every `kvmap replay` on this machine (measured)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    # build only the command asked for: typer turns every registered command's parameters into click's on each
    # start (26-35 ms for all eight, 11-13 ms for one; measured). Any other argument (an unknown or misspelt
    # command, an option) builds them all, so suggestions and errors are typer's own.
    named = [c for c in app.registered_commands if len(sys.argv) > 1 and command_name(c) == sys.argv[1]]
    if named:
        app.registered_commands = named
    if len(sys.argv) < 2 or sys.argv[1] not in FAST_EXIT:
        app()
        return
    try:
        app()
        code = 0
    except SystemExit as e:
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: the stream was closed before kvmap started (`>&-`)
                stream.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass
    os._exit(code)


# every command registers itself on `app` when its module loads: importing kvmap.cli.app gives the whole CLI
from kvmap.cli import check_cmds, run_cmds  # noqa: E402,F401
