"""`kvmap explain`: one step, request or token as plain data (build.py) and its Rich view (render.py)."""

from kvmap.explain.build import explain

__all__ = ["explain"]
