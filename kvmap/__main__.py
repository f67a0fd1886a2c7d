"""`python -m kvmap` runs the command-line interface."""

from kvmap.cli.app import main

main()
