"""Output files: written whole or not at all, never over an input, and errors as one located line.

Rules:
- A regular file is written to a short temporary name beside the target (`.kvmap-XXXXXXXX.tmp`), with the
  permissions the umask gives a new file, and renamed into place only when complete: an error part-way (a bad
  step at line 5000, a full disk, SIGTERM) leaves the target as it was and no temporary file behind.
- `-` is standard output; an existing device or FIFO (`/dev/null`, `/dev/stdout`, a pipe) is written as a
  stream, never replaced by a file.
- `check_outputs` refuses an output that is the same file as an input or as another output (by device and
  inode, so links and other spellings of the path are caught) before anything runs.
- Every OS error (no space, permission, read-only, name too long, a missing folder) becomes a `KvmapError`
  naming the path: exit 2, no traceback.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from kvmap.errors import KvmapError

STDOUT = "-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.fstat(sys.stdin.fileno()) if str(path) == STDOUT else path.stat()  # input `-`: standard input
    except (OSError, ValueError, AttributeError):
        return None
    return st.st_dev, st.st_ino


def check_outputs(outputs: dict[str, str | Path | None], inputs: Iterable[str | Path] = ()) -> None:
    """Refuse outputs (option name -> path) that would overwrite an input or each other."""
    seen_in = {}
    for p in inputs:
        ident = _identity(Path(p))
        if ident is not None:
            seen_in[ident] = str(p)
    seen_out: dict[object, str] = {}
    for option, p in outputs.items():
        if p is None or str(p) == STDOUT:
            continue
        path = Path(p)
        ident = _identity(path)
        if ident is not None and stat.S_ISREG(path.stat().st_mode) and ident in seen_in:  # `< t.jsonl` too
            raise KvmapError(f"is the input trace {seen_in[ident]!r}: writing it would destroy the input; "
                             "choose another output name", path=str(p), field=option)
        key = ident if ident is not None else os.path.abspath(p)
        if key in seen_out and (ident is None or stat.S_ISREG(path.stat().st_mode)):
            raise KvmapError(f"is also the {seen_out[key]} output; give each output its own file", path=str(p),
                             field=option)
        seen_out[key] = option


def _os_error(e: OSError, path: Path) -> KvmapError:
    return KvmapError(f"cannot write: {e.strerror or e}", path=str(path))


@contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Open `path` for writing whole-or-nothing (see the module rules); text mode unless `mode` has "b"."""
    if str(path) == STDOUT:
        yield sys.stdout.buffer if "b" in mode else sys.stdout
        sys.stdout.flush()
        return
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise KvmapError("is a directory; give a file name", path=str(path))
    if st is not None and not stat.S_ISREG(st.st_mode):  # a device or FIFO: a stream, never replaced
        try:
            with open(path, mode) as f:
                yield f
        except OSError as e:
            raise _os_error(e, path) from None
        return
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise KvmapError(f"cannot write: folder {parent} does not exist", path=str(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kvmap-", suffix=".tmp", dir=parent)
    except OSError as e:
        raise _os_error(e, path) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    except OSError as e:
        _unlink(tmp)
        raise _os_error(e, path) from None
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


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


def bundled_traces() -> dict[str, Path]:
    """Bundled trace name (file name without .jsonl/.jsonl.gz) -> path."""
    d = bundled_traces_dir()
    if not d.is_dir():
        return {}
    out = {}
    for p in sorted(d.iterdir()):
        for ext in (".jsonl.gz", ".jsonl"):
            if p.name.endswith(ext):
                out[p.name[: -len(ext)]] = p
    return out


def resolve_trace(name: str | Path | None) -> Path:
    """A trace argument: a path, or the name of a bundled trace (`long_mixed`), or None for the worked example."""
    if name is None:
        return default_trace()
    p = Path(name)
    if p.exists() or str(name) == STDOUT or os.sep in str(name):
        return p
    bundled = bundled_traces()
    if str(name) in bundled:
        return bundled[str(name)]
    return p  # the reader names the missing file


def default_trace() -> Path:
    p = bundled_traces_dir() / "worked_example.jsonl"
    if not p.exists():
        raise KvmapError("no trace given and the bundled traces/ folder is not beside this kvmap "
                         "(install with `pip install -e .` from the repository, or name a trace)")
    return p
