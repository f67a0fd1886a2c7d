"""Output files: written whole or not at all.

Rule: every file kvmap writes goes to a temporary name beside the target and is renamed into place only when
complete, so an error part-way (a bad step at line 5000) leaves no half-written dump, JSON or trace.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from kvmap.errors import KvmapError


@contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO]:
    path = Path(path)
    if path.is_dir():
        raise KvmapError("is a directory; give a file name", path=str(path))
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise KvmapError(f"cannot write: folder {parent} does not exist", path=str(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_json(path: str | Path, obj: object) -> None:
    with atomic_open(path) as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def write_text(path: str | Path, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def bundled_traces_dir() -> Path:
    """traces/ of the source checkout kvmap runs from (an editable install or the repository itself)."""
    return Path(__file__).resolve().parent.parent / "traces"


def default_trace() -> Path:
    p = bundled_traces_dir() / "worked_example.jsonl"
    if not p.exists():
        raise KvmapError("no trace given and the bundled traces/ folder is not beside this kvmap "
                         "(install with `pip install -e .` from the repository, or name a trace)")
    return p
