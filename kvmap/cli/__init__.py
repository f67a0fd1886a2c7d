"""The `kvmap` command line: parse options, call the library, render. No computation lives here."""

from kvmap.cli import check_cmds, run_cmds  # noqa: F401  (register the commands)
from kvmap.cli.app import app, main

__all__ = ["app", "main"]
