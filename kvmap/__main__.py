"""`python -m kvmap` runs the command-line interface."""

from kvmap.cli import main

main()
