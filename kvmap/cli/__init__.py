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
    if sys.argv[1:] == ["--help"]:
        from kvmap.cli.root_help import print_root_help

        print_root_help()
        return
    from kvmap.cli.app import main as run

    run()


__all__ = ["main"]
