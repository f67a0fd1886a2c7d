"""The `kvmap` command line: parse options, call the library, render. No computation lives here.

`main` is the entry point: `kvmap --help` is drawn before typer loads (cli/root_help.py); everything else
runs the Typer app, `kvmap.cli.app.app` (cli/app.py, which registers every command).

Before anything imports numpy, `main` gives OpenBLAS one thread unless the user chose a count
(`OPENBLAS_NUM_THREADS`, or `OMP_NUM_THREADS`, which OpenBLAS also reads): kvmap makes no BLAS call, and the
thread pool numpy's OpenBLAS starts at import spins on another core (its cost: docs/performance.md). Child
processes (`kvmap profile`, multi-process replay) inherit it.
"""

import os
import sys


def main() -> None:
    if "OPENBLAS_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
    if sys.argv[1:] in (["--help"], ["-h"]):
        from kvmap.cli.root_help import PIPE_CLOSED, print_root_help, silence_stdout

        try:
            print_root_help()
        except BrokenPipeError:  # the reader went away (`| head`): quietly, as a shell tool does
            silence_stdout()
            sys.exit(PIPE_CLOSED)
        return
    from kvmap.cli.app import main as run

    run()


__all__ = ["main"]
