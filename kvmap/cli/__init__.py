"""The `kvmap` command line: parse options, call the library, render. No computation lives here.

`main` is the entry point: `kvmap --help` is drawn before typer loads (cli/root_help.py); everything else
runs the Typer app, `kvmap.cli.app.app` (cli/app.py, which loads every command module).
"""

import sys


def main() -> None:
    if sys.argv[1:] == ["--help"]:
        from kvmap.cli.root_help import print_root_help

        print_root_help()
        return
    from kvmap.cli.app import main as run

    run()


__all__ = ["main"]
