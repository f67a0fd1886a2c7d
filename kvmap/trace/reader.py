"""Read trace files: the header at once, the steps streamed, gzip or plain, with every error located.

Rules:
- Streaming: `Trace.steps()` yields one `Step` at a time; memory does not grow with the number of steps.
- `.jsonl` and gzip-compressed files (recognised by their magic bytes, whatever the name) are read alike; the
  magic is peeked from the one open handle (never a second open), and gzip is inflated here, chunk by chunk.
- Streams (`-`, `/dev/stdin`, a FIFO, a process substitution) are read exactly once: their bytes are spooled
  to an unlinked temporary file as they arrive, and every later pass reads the spool.
- Lines are bounded: line 1 at 16 MiB, a step line at 1/32 of the memory left (64 MiB .. 1 GiB); a stream
  is checked header first and spooled into at most half the free space of TMPDIR: an endless `/dev/zero`
  fails at once.
- A recording cut short (a gzip stream without its end, a final line without its newline that is not JSON)
  is not an error: every complete line is read, and the pass ends with one warning (`Trace.warn`, once per
  trace) saying how many steps were read and where it stopped. A blank line is one error, at its line.
- Error columns count characters of the line (not bytes), from 1.
- One decoding interface, `Trace.decode`, behind which two decoders stand: the typed decoder (typed.py) first,
  and when it steps aside the checked parser (`parse_step`), which names the problem. Both apply the same
  cross-field rules (invariants.py). Every consumer (replay, validate, explain, the catalog) reads `Step`s.
"""

from __future__ import annotations

import io
import json
import os
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from kvmap.errors import TraceError
from kvmap.trace.checks import Where, loads
from kvmap.trace.header import available_memory, parse_header
from kvmap.trace.parse import parse_step
from kvmap.trace import streams
from kvmap.trace.records import Step
from kvmap.trace.streams import (CHUNK, GZIP_MAGIC, HEADER_LIMIT, LINE_MAX, LINE_MIN, STDIN, _column, _Gunzip,
                                 _size, _source, _spool, read_rest)


class Trace:
    """A trace file: its header (read at once) and its steps (streamed on demand, any number of times)."""

    def __init__(self, path: str | Path, warn: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self.name = str(path)
        self.warn = warn or _stderr_warning  # called once with the cut-short message, if the file is cut
        self.warned = False
        self.cut: str | None = None  # where and why the last complete pass stopped early
        self._spooled: BinaryIO | None = None
        self._typed: object = False  # the typed decoder, built on the first steps() (None without msgspec)
        self._position: Callable[[], int] | None = None  # the open pass's offset into the file, for progress
        self._line_limit = max(LINE_MIN, min(LINE_MAX, available_memory()[0] // 32))  # bytes of a step line
        if self.name != STDIN and not os.path.lexists(self.path):
            raise TraceError("no such file", path=self.name)
        f = _source(self.path, self.name)
        try:
            mode = os.fstat(f.fileno()).st_mode
        except OSError:
            mode = stat.S_IFIFO
        if stat.S_ISDIR(mode):
            f.close()
            raise TraceError("is a directory, not a trace file", path=self.name)
        if not stat.S_ISREG(mode) or self.name == STDIN:  # `-` shares its offset with the caller: read it once
            self._spooled = _spool(f, self.name, self._header, self._line_limit)
        else:
            f.close()
        with self._lines(report=False) as lines:
            first = next(lines, None)
            if first is None:
                raise TraceError("empty file: a trace starts with a header line", path=self.name, line=1)
            self.header = self._header(first[1])

    def _header(self, raw: bytes):
        return parse_header(self._json(raw, 1, None), Where(self.name, 1, None))

    def __del__(self) -> None:
        if self._spooled is not None:
            self._spooled.close()

    # ------------------------------------------------------------------ lines

    def _open(self) -> tuple[BinaryIO, _Gunzip | None]:
        if self._spooled is not None:
            raw = os.fdopen(os.dup(self._spooled.fileno()), "rb", buffering=0)
            raw.seek(0)
            f: BinaryIO = io.BufferedReader(raw, CHUNK)
        else:
            f = _source(self.path, self.name)
        if f.peek(2)[:2] != GZIP_MAGIC:
            return f, None
        gz = _Gunzip(f)
        return io.BufferedReader(gz, CHUNK), gz

    @contextmanager
    def _lines(self, report: bool = True) -> Iterator[Iterator[tuple[int, bytes]]]:
        """(line number, raw bytes) of the file's complete lines, for one pass; a cut end is warned about
        once (with `report`) when the pass reaches it."""
        f, gz = self._open()
        self._position = (gz.src if gz is not None else f).tell
        try:
            with f:
                yield self._numbered(f, gz, report)
        finally:
            self._position = None

    def size_bytes(self) -> int:
        """The file's size (compressed, for gzip; the spooled copy of a stream): the unit of `bytes_read`."""
        try:
            return os.fstat(self._spooled.fileno()).st_size if self._spooled is not None else self.path.stat().st_size
        except OSError:
            return 0

    def bytes_read(self) -> int:
        """How far the open pass has read into the file (read-ahead included), for progress bars."""
        try:
            return self._position() if self._position is not None else 0
        except (OSError, ValueError):
            return 0

    def _numbered(self, f: BinaryIO, gz: _Gunzip | None, report: bool) -> Iterator[tuple[int, bytes]]:
        line, limit, readline = 0, HEADER_LIMIT, f.readline
        piece = min(limit, streams.LINE_PIECE)  # a longer line is read on in pieces (streams.read_rest)
        try:
            while raw := readline(piece):
                if raw[-1] != 10 and len(raw) == piece < limit:
                    raw = read_rest(readline, raw, limit)
                line += 1
                if raw is None or raw[-1] != 10:  # no newline: the limit cut it, or the file's last line
                    if raw is None or len(raw) == limit:
                        raise TraceError(f"the line runs past {_size(limit)} without ending (the memory left "
                                         "allows no longer line)", kind="json", path=self.name, line=line)
                    if not self._parses(raw):  # complete only if it is JSON (no strict prefix of an object is)
                        self._stop(line, "the line is cut short" + (f" ({gz.stopped})" if gz and gz.stopped
                                                                     else ""), report)
                        return
                if line == 1:
                    limit = self._line_limit
                    piece = min(limit, streams.LINE_PIECE)
                yield line, raw
        except OSError as e:
            self._stop(line + 1, f"cannot read further ({e.strerror or e})", report)
            return
        if gz is not None and gz.stopped:
            self._stop(line + 1, gz.stopped, report)

    @staticmethod
    def _parses(raw: bytes) -> bool:
        try:
            loads(raw)
        except json.JSONDecodeError:
            return False
        return True

    def _stop(self, line: int, why: str, report: bool) -> None:
        if line <= 1:
            raise TraceError(f"no complete header line: {why}", kind="json", path=self.name, line=1)
        steps = line - 2
        read = f"{steps} complete step(s) read (steps 0..{steps - 1})" if steps else "no complete step read"
        self.cut = f"the trace ends early: {read}; it stopped at line {line}: {why}"
        if report and not self.warned:
            self.warned = True
            self.warn(f"{self.name}: {self.cut}")

    def _json(self, raw: bytes, line: int, step: int | None) -> object:
        try:
            return loads(raw)
        except json.JSONDecodeError as e:  # orjson's error is a subclass
            raise json_error(raw, e, self.name, line, step) from None

    # ------------------------------------------------------------------ passes

    def steps(self, start: int = 0, stop: int | None = None) -> Iterator[Step]:
        """Yield steps `start <= step < stop`. Earlier lines are skipped unparsed: a worker that needs their
        state must read from 0 (replay does, and records only the window)."""
        decode = self.decode
        first, end = start + 2, (stop + 2 if stop is not None else 1 << 62)  # in line numbers: step i is line i + 2
        with self._lines() as lines:
            next(lines)
            for line, raw in lines:
                if line >= end:
                    return
                if line >= first:
                    yield decode(raw, line, line - 2)

    def decode(self, raw: bytes, line: int, i: int) -> Step:
        """Step `i` from its line: the typed decoder (one pass, every value checked), and when it steps aside
        (anything off, or no msgspec) the checked path, which names the problem."""
        typed = self._typed_decoder()
        step = typed(raw, line, i) if typed is not None else None
        if step is None:
            where = Where(self.name, line, i)
            if not raw.strip():
                raise where.error("blank line (a trace has one JSON object on every line)", kind="json")
            obj = self._json(raw, line, i)
            step = parse_step(obj, self.header, where)
        return step

    def _typed_decoder(self):
        """The typed decoder (trace/typed.py) for this header, built once, on the first `steps()` (validate's
        raw passes never build it); None without msgspec."""
        if self._typed is False:
            from kvmap.trace.typed import typed_decoder

            self._typed = typed_decoder(self.header)
        return self._typed

    def raw_lines(self) -> Iterator[tuple[int, bytes]]:
        """(line number, raw bytes) of every complete step line, for tools that parse leniently (validate)."""
        with self._lines() as lines:
            next(lines)
            yield from lines

    def raw_steps(self) -> Iterator[tuple[int, str]]:
        """(line number, text) of every complete step line (undecodable bytes replaced)."""
        for line, raw in self.raw_lines():
            yield line, raw.decode("utf-8", "replace")


def json_error(raw: bytes, e: json.JSONDecodeError, path: str | None, line: int,
               step: int | None) -> TraceError:
    """A located error for a line (bytes, as read) that is not JSON, with the column in characters."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as u:
        what = "cannot start a character" if u.reason == "invalid start byte" else f"starts a character: {u.reason}"
        return TraceError(f"not UTF-8 text (byte 0x{raw[u.start]:02x} at column {_column(raw, u.start)} {what})",
                          kind="json", path=path, line=line, step=step)
    end = len(text.rstrip("\r\n"))
    pos = min(e.pos, end)  # a decoder's position counts characters; a cut line ends after its last one
    what = "truncated line" if pos >= len(text.rstrip()) else "not valid JSON"
    return TraceError(f"{what} ({e.msg} at column {pos + 1})", kind="json", path=path, line=line, step=step)


def _stderr_warning(message: str) -> None:
    try:
        sys.stderr.write(f"kvmap: warning: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def open_trace(path: str | Path) -> Trace:
    return Trace(path)
