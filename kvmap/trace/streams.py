"""The bytes under a trace: its source (a file or standard input), gzip inflated chunk by chunk, streams spooled.

Rules:
- gzip is recognised by its magic bytes, whatever the name; concatenated members are one stream, zero padding
  after the last member is skipped (as gzip does), and a stream that ends early or turns corrupt ends the data
  with the reason kept (`_Gunzip.stopped`), every byte inflated before it kept.
- A stream (`-`, a FIFO, a process substitution) is read exactly once, into an unlinked temporary file, its
  header checked as soon as line 1 has arrived and its lines bounded as they arrive, so an endless or foreign
  stream fails at once: spooling stops just past a step line's limit, and the reader reports that line, located,
  as it does in a file; the spool takes at most half the free space of its folder.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from kvmap.errors import TraceError

try:  # ISA-L inflates gzip faster than zlib (docs/performance.md); zlib is the fallback
    from isal import isal_zlib as zlib
except ImportError:  # pragma: no cover
    import zlib

STDIN = "-"
CHUNK = 1 << 16
HEADER_LIMIT = 16 << 20  # bytes of line 1
PADDING_LIMIT = 1 << 20  # zero bytes after a gzip stream's end that a stream may carry
LINE_MIN, LINE_MAX = 64 << 20, 1 << 30  # a step line's limit: 1/32 of the memory left, within these
LINE_PIECE = 1 << 20  # a line longer than this is read in pieces of it (`read_rest`)
INFLATE_MAX = 1 << 20  # bytes inflated at a time from a file (64 KiB of gzip can hold 64 MiB)
GZIP_MAGIC = b"\x1f\x8b"


class _Inflater:
    """gzip members inflated chunk by chunk (`cat a.gz b.gz` is one stream); zero padding after the last
    member is skipped, as gzip does, without being kept. Raises zlib.error where the data turns corrupt,
    after returning everything inflated before it."""

    def __init__(self) -> None:
        self.z = zlib.decompressobj(wbits=31)
        self.padding = 0  # zero bytes seen after a member's end

    @property
    def complete(self) -> bool:
        return self.z.eof

    def inflate_some(self, data: bytes, max_out: int) -> tuple[bytes, zlib.error | None, bytes | None]:
        """(bytes inflated from `data`, at most `max_out` of them, the error where it turned corrupt or None,
        what is left to inflate: input not yet consumed, b"" when output may still be pending without more input
        (call again with b""), None when `data` is done)."""
        out, n = [], 0
        try:
            while True:
                if self.z.eof:  # a member ended: what follows is zero padding or the next member
                    if not data:
                        break
                    if not data.strip(b"\0"):
                        self.padding += len(data)
                        break
                    self.z = zlib.decompressobj(wbits=31)
                piece = self.z.decompress(data, max_out - n)
                out.append(piece)
                n += len(piece)
                data = self.z.unused_data if self.z.eof else self.z.unconsumed_tail
                if n >= max_out:
                    return b"".join(out), None, data
                if not data and not self.z.eof:  # all consumed, the output below the cap: nothing pending
                    break
        except zlib.error as e:
            return b"".join(out), e, None
        return b"".join(out), None, None


class _Gunzip(io.RawIOBase):
    """gzip members inflated from `src`; a stream that ends early (or turns corrupt) ends the data and
    records why in `stopped`, keeping every byte inflated before."""

    def __init__(self, src: BinaryIO) -> None:
        self.src = src
        self.inflater = _Inflater()
        self.pending = memoryview(b"")  # inflated, not yet handed out (a view: handing out copies nothing twice)
        self.rest: bytes | None = None  # read, not yet inflated (b"": output may be pending in the inflater)
        self.stopped: str | None = None
        self.done = False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self.pending and not self.done:
            self._inflate()
        n = min(len(b), len(self.pending))
        b[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n

    def _inflate(self) -> None:
        """At most `INFLATE_MAX` bytes more into `pending` (a highly compressed chunk inflates over calls)."""
        data = self.rest if self.rest is not None else self.src.read(CHUNK)
        if not data and self.rest is None:
            if not self.inflater.complete:
                self.stopped = "the gzip stream ends before its end marker (a recording cut short?)"
            self.done = True
            return
        out, error, self.rest = self.inflater.inflate_some(data, INFLATE_MAX)
        if not out and self.rest == b"":  # nothing was pending after all
            self.rest = None
        self.pending = memoryview(out)
        if error is not None:  # keep what inflated before the corrupt part
            self.stopped, self.done = f"the gzip data is corrupt ({error})", True


def _source(path: Path, name: str) -> BinaryIO:
    """An open binary handle: the file, or standard input for `-`."""
    if name == STDIN:
        return os.fdopen(os.dup(sys.stdin.fileno()), "rb", CHUNK)
    try:
        return open(path, "rb", CHUNK)  # a 64 KiB buffer: the default 8 KiB took a read call per line or two
    except IsADirectoryError:
        raise TraceError("is a directory, not a trace file", path=name) from None
    except OSError as e:
        raise TraceError(f"cannot read: {e.strerror or e}", path=name) from None


class _StreamCheck:
    """Watches a stream's bytes as they are spooled (inflated if gzip): hands over the first line as soon as
    it is complete, refuses a header that runs past its limit and stops at a step line that does (an endless
    `/dev/zero` ends the spool at once)."""

    def __init__(self, line_limit: int) -> None:
        self.parts: list[bytes] | None = []  # line 1 so far; None once it is complete
        self.z = None
        self.started = False
        self.run = 0  # bytes since the last newline
        self.line_limit = line_limit
        self.stop = False  # nothing readable follows: spool no further

    def feed(self, chunk: bytes) -> bytes | None:
        """The complete first line when this chunk completes it, else None."""
        if not self.started:
            self.started = True
            if chunk[:2] == GZIP_MAGIC:
                self.z = _Inflater()
        if self.z is None:
            return self._watch(chunk)
        first, rest = None, chunk
        while rest is not None and not self.stop:  # at most INFLATE_MAX bytes inflated at a time
            out, error, rest = self.z.inflate_some(rest, INFLATE_MAX)
            first = self._watch(out) or first
            if error is not None or self.z.padding > PADDING_LIMIT:  # the reader stops at the same place
                self.stop = True
        return first

    def _watch(self, chunk: bytes) -> bytes | None:
        """`feed` on bytes as the reader sees them (inflated)."""
        end = chunk.rfind(b"\n")
        self.run = self.run + len(chunk) if end < 0 else len(chunk) - end - 1
        first = None
        if self.parts is not None:
            head = chunk.find(b"\n")
            self.parts.append(chunk if head < 0 else chunk[: head + 1])
            if head >= 0:
                first, self.parts = b"".join(self.parts), None
        if self.parts is not None and self.run > HEADER_LIMIT:
            raise TraceError(f"a line runs past {_size(HEADER_LIMIT)} without ending: not a kvmap trace header",
                             kind="json", line=1)
        if self.run > self.line_limit:  # the reader finds this line over its limit, located, and stops there
            self.stop = True
        return first


def _spool(f: BinaryIO, name: str, check_header: Callable[[bytes], None], line_limit: int) -> BinaryIO:
    """Copy a stream into an unlinked temporary file (read once; nothing is left behind on any exit). The
    header is checked as soon as its line has arrived, so an endless or foreign stream fails at once, and
    the spool takes at most half the free space of its folder."""
    try:
        spool = tempfile.TemporaryFile(prefix="kvmap-")
        room = shutil.disk_usage(tempfile.gettempdir()).free // 2
        watch = _StreamCheck(line_limit)
        total = 0
        while chunk := f.read(CHUNK):
            spool.write(chunk)
            total += len(chunk)
            first = watch.feed(chunk)
            if first:
                check_header(first)
            if watch.stop:
                break
            if total > room:
                raise TraceError(f"the stream is larger than half the free space ({room >> 20} MiB) of "
                                 f"{tempfile.gettempdir()}, where it is kept for reading; set TMPDIR", path=name)
        spool.seek(0)
    except OSError as e:
        raise TraceError(f"cannot read the stream into a temporary file: {e.strerror or e}", path=name) from None
    except TraceError as e:
        raise e.located(path=name) from None
    finally:
        f.close()
    return spool


def read_rest(readline: Callable[[int], bytes], first: bytes, limit: int) -> bytes | None:
    """A line whose first `LINE_PIECE` bytes, `first`, came without its newline: the whole line as
    `readline(limit)` would give it (without its newline at the end of the data), or None when it runs past
    `limit` bytes without ending. Read in pieces, so that a line refused holds at most `limit` bytes, never
    those and their joined copy."""
    parts, n = [first], len(first)
    while n < limit:
        piece = readline(min(limit - n, LINE_PIECE))
        if not piece:
            break
        parts.append(piece)
        n += len(piece)
        if piece[-1] == 10:
            break
    if n == limit and parts[-1][-1] != 10:
        return None
    return b"".join(parts)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _column(raw: bytes, pos: int) -> int:
    """1-based character column of byte offset `pos` in `raw`."""
    return len(raw[:pos].decode("utf-8", "replace")) + 1
