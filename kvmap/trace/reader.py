"""Read trace files: the header at once, the steps streamed, gzip or plain, with every error located.

Rules:
- Streaming: `Trace.steps()` yields one `Step` at a time; memory does not grow with the number of steps.
- `.jsonl` and gzip-compressed files (recognised by their magic bytes, whatever the name) are read alike.
- Each line goes through `fast_step` first and `parse_step` when the fast path steps aside.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvmap.errors import TraceError
from kvmap.trace.checks import Where, loads
from kvmap.trace.fast import fast_step
from kvmap.trace.header import parse_header
from kvmap.trace.parse import parse_step
from kvmap.trace.records import Step

def _open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


class Trace:
    """A trace file: its header (read at once) and its steps (streamed on demand, any number of times)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = str(path)
        if not self.path.exists():
            raise TraceError("no such file", path=self.name)
        if self.path.is_dir():
            raise TraceError("is a directory, not a trace file", path=self.name)
        with self._lines() as lines:
            first = next(lines, None)
            if first is None:
                raise TraceError("empty file: a trace starts with a header line", path=self.name, line=1)
            self.header = parse_header(self._json(first, 1, None), Where(self.name, 1, None))

    @contextmanager
    def _lines(self) -> Iterator[Iterator[str]]:
        """The file's raw lines, opened (and gunzipped) for one pass."""
        try:
            f = _open_text(self.path)
        except OSError as e:
            raise TraceError(f"cannot read: {e.strerror or e}", path=self.name) from None
        with f:
            yield _read_lines(f, self.name)

    def _json(self, raw: str, line: int, step: int | None) -> object:
        try:
            return loads(raw)
        except json.JSONDecodeError as e:  # orjson's error is a subclass
            what = "truncated line" if e.pos >= len(raw.rstrip()) else "not valid JSON"
            raise TraceError(f"{what} ({e.msg} at column {e.colno})", kind="json", path=self.name, line=line,
                             step=step) from None

    def steps(self, start: int = 0, stop: int | None = None) -> Iterator[Step]:
        """Yield steps `start <= step < stop`. Earlier lines are skipped unparsed: a worker that needs their
        state must read from 0 (replay does, and records only the window)."""
        with self._lines() as lines:
            next(lines)
            for i, raw in enumerate(lines):
                if stop is not None and i >= stop:
                    return
                if i < start:
                    continue
                line = i + 2
                where = Where(self.name, line, i)
                if not raw.strip():
                    raise where.error("blank line (a trace has one JSON object on every line)", kind="json")
                obj = self._json(raw, line, i)
                yield fast_step(obj, self.header, where) or parse_step(obj, self.header, where)

    def raw_steps(self) -> Iterator[tuple[int, str]]:
        """(line number, raw text) of every step line, for tools that parse leniently (validate)."""
        with self._lines() as lines:
            next(lines)
            for i, raw in enumerate(lines):
                yield i + 2, raw


def _read_lines(f: io.TextIOBase, name: str) -> Iterator[str]:
    try:
        yield from f
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile, OSError) as e:
        raise TraceError(f"cannot decode the file ({type(e).__name__}: {e})", kind="json", path=name) from None


def open_trace(path: str | Path) -> Trace:
    return Trace(path)
