"""The `kvmap` command line's root: the Typer app, its commands registered in one list, usage errors, `main`.

Rules: one Typer app, one function per command (run_cmds.py, check_cmds.py), registered here explicitly
(`COMMANDS`), never by importing a module for its side effect. Shared options live in options.py, the
consoles in console.py, the one error handler in guard.py. Every `KvmapError` is caught once (guard.py
`user_errors`) and printed as one line on stderr with its location; usage errors (an unknown option, a bad
value) are one line too (`KvmapGroup.main`), never Rich's boxed panel; the exit code is 2 for unusable input or
usage, 1 for "problems found" (validate) or KV mismatches. Tracebacks are for kvmap's own bugs only. Flags show
as flags in the help (no `<bool>` value). Consoles honour `COLUMNS`; piped without it they are 120 wide; file
names and request ids are never read as markup, and messages are never wrapped when piped.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from typer import Abort
from typer.core import TyperCommand, TyperGroup

from kvmap.cli import check_cmds, run_cmds
from kvmap.cli.console import err, fit_consoles, out
from kvmap.cli.guard import on_signal
from kvmap.cli.root_help import PIPE_CLOSED, draw, first_paragraph, silence_stdout

try:  # typer >= 0.23 carries its own click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer on click
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError


class PipeClosed(Exception):
    """The reader went away while help was drawn. Not an OSError: click's main turns a broken pipe into exit 1."""


class KvmapCommand(TyperCommand):
    """A command whose help ends quietly with PIPE_CLOSED when its reader goes away (`kvmap replay -h | head`)."""

    def format_help(self, ctx, formatter) -> None:
        try:
            super().format_help(ctx, formatter)
        except (BrokenPipeError, SystemExit):  # typer's Rich console ends a closed pipe with SystemExit(1)
            raise PipeClosed from None


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
        try:
            draw(out, ctx.command_path, first_paragraph(self.help), options, commands)
        except BrokenPipeError:
            raise PipeClosed from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rc = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NoArgsIsHelpError as e:  # the help is already printed
            rc = e.exit_code
        except PipeClosed:  # quietly, as a shell tool does
            silence_stdout()
            rc = PIPE_CLOSED
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
# the same rule by the click type's name (typer's own click, or click's), for a typer without type descriptors
TYPE_METAVARS = {**dict.fromkeys(("int", "integer", "int range", "integer range", "float", "float range"), "N"),
                 **dict.fromkeys(("str", "text"), "TEXT"), "path": "FILE"}


def _flag_shows_no_type(param) -> None:
    if param is None or param.metavar is not None or getattr(param, "param_type_name", "") != "option":
        return
    if getattr(param, "is_flag", False):
        param.metavar = ""  # the help's type column shows nothing for a flag (not `<bool>`)
        return
    desc = getattr(param, "type_descriptor", None)  # typer >= 0.23; older typer keeps click's own names
    if desc is not None:
        param.metavar = "FILE" if getattr(desc, "is_path", False) else METAVARS.get(getattr(desc, "annotation", None))
    else:
        param.metavar = TYPE_METAVARS.get(getattr(getattr(param, "type", None), "name", None))


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


CONTEXT = {"help_option_names": ["-h", "--help"]}  # `-h` is `--help`, on the root and on every command
app = typer.Typer(
    name="kvmap",
    cls=KvmapGroup,
    help="Replay, time, check and explain how vLLM scheduler decisions become paged-KV GPU input tensors.",
    no_args_is_help=True,
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    rich_markup_mode="rich",
    context_settings=CONTEXT,
)


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


# every command, in the help's order (root_help.COMMANDS): registered here, not by importing its module
COMMANDS = (check_cmds.validate, check_cmds.explain, check_cmds.record, check_cmds.traces,
            run_cmds.replay, run_cmds.profile, run_cmds.report, run_cmds.compare)
EXAMPLES = {**check_cmds.EXAMPLES, **run_cmds.EXAMPLES}
for _command in COMMANDS:
    app.command(cls=KvmapCommand, context_settings=CONTEXT, epilog=EXAMPLES.get(_command.__name__))(_command)


# Commands that hold nothing past their own return (every file they write is closed inside the command), so
# the process may end without Python's teardown; `record` (vLLM) and `profile` (nsys) end the usual way.
FAST_EXIT = {"replay", "validate", "explain", "report", "compare", "traces"}


def command_name(cmd) -> str:
    """A registered command's name on the command line (typer's rule: the function name, `_` as `-`)."""
    return cmd.name or cmd.callback.__name__.replace("_", "-")


def main() -> None:
    """Run the app. SIGTERM and SIGHUP unwind like Ctrl-C (temporary outputs removed). After a command in
    `FAST_EXIT`, flush and end the process at once: Python's teardown with numba's LLVM loaded is slow
    (docs/performance.md)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # build only the command asked for: typer turns every registered command's parameters into click's on each
    # start. Any other argument (an unknown or misspelt command, an option) builds them all, so suggestions and
    # errors are typer's own.
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


