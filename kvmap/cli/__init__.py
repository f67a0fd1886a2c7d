from kvmap.cli.app import main

__all__ = ["main"]
