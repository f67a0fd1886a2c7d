"""The one error handler every command runs under (`user_errors`), and the signals that unwind like Ctrl-C.

Rules: every `KvmapError` is caught once, here, and printed as one line on stderr with its location (exit 2
for unusable input, or the error's own code); a reader that went away (`| head`) ends the command quietly
(141); a full disk or an I/O error under an output is one line (exit 2), other OS errors stay tracebacks;
Ctrl-C is 130, SIGTERM and SIGHUP 128 + the signal, after every temporary output was removed on the way out.
Tracebacks are for kvmap's own bugs only.
"""

from __future__ import annotations

import errno
import functools
import sys

import typer

from kvmap.cli.console import err, fit_consoles, safe
from kvmap.errors import KvmapError

__all__ = ["Terminated", "on_signal", "user_errors"]

# what writing an output can meet that is no fault of kvmap's or of its input (other OS errors stay tracebacks)
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS, errno.EBADF}


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C, so every temporary output is removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def on_signal(signum, frame) -> None:
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
