"""The recorded steps' figures as a replay goes: clock reads and counts, kept compact and handed over once.

Rules:
- No per-step Python objects are kept: a step appends its numbers to one flat `array("q")` block of `BLOCK`
  steps; a full block is turned at once into its final form (step, num_reqs, num_tokens, start from the
  replay's origin, each phase's time as the difference of two clock reads) and spilled to an unlinked
  temporary file, so memory stays flat however long the trace (a run shorter than a block never makes one);
  the step starts to a file of their own.
- The result's arrays are filled block by block from the spill at the end, so the run never holds its figures
  twice; once blocks were spilled, the phase times and step starts stay on disk, mapped (ondisk.py: a reader
  that walks them lets them go). The step starts are kept only when asked
  (`keep_start`: an output reads them, `--json` or `--trace-out`); otherwise `step_start_ns` is empty, and
  neither held nor spilled.
- The series only some outputs read (KV occupancy, batch composition: `Rows`) are held the same way: an open
  block of int32 rows (int64 once a value needs it), full blocks spilled; handed over as a map of the spill file
  when every value is int32 (they stay on disk: ondisk.py), else as one array made at its final size.
- Values are the same integers in any dtype: num_reqs and num_tokens are int16 or int32, steps int32, phase
  times int32, each when every value fits (a phase of 2.1 s or more keeps int64), step starts int64.
"""

from __future__ import annotations

import tempfile
from array import array
from typing import BinaryIO

import numpy as np

from kvmap.ondisk import mapped, release

BLOCK = 4096  # steps per block
_INT32_MAX = np.iinfo(np.int32).max
_INT16_MAX = np.iinfo(np.int16).max


class StepLog:
    """Per-step figures of the recorded steps: `add` per step, `arrays` once at the end."""

    def __init__(self, num_phases: int, keep_start: bool = True) -> None:
        self.keep_start = keep_start
        self.width = 3 + num_phases + 1  # step, num_reqs, num_tokens, then one clock read per phase boundary
        self.num_phases = num_phases
        self.origin = 0  # clock at the start of the run
        self.buf = array("q")  # the open block, row after row
        # the closed blocks, each as counts [3, k], phases [k, P]; their starts (if kept) in a file of their own
        self.spill: BinaryIO | None = None
        self.starts: BinaryIO | None = None
        self.sizes: list[int] = []  # steps of each closed block
        self.tops = [0, 0, 0]  # largest step, num_reqs, num_tokens
        self.phase_top = self.phase_bottom = 0  # largest and smallest phase time
        self.n = 0

    def add(self, step: int, num_reqs: int, num_tokens: int, ts: list[int]) -> None:
        buf = self.buf
        buf.append(step)
        buf.append(num_reqs)
        buf.append(num_tokens)
        buf.extend(ts)  # num_phases + 1 boundaries
        self.n += 1
        if len(buf) == BLOCK * self.width:
            self._spill(*self._close())

    def _close(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The open block in its final form: (counts [3, k], start [k], phases [k, P]), all int64."""
        rows = np.frombuffer(self.buf, dtype=np.int64).reshape(-1, self.width)
        start = rows[:, 3] - self.origin if self.keep_start else rows[:0, 3]
        counts, phases = rows[:, :3].T.copy(), np.diff(rows[:, 3:], axis=1)
        self.buf = array("q")
        if len(rows):
            self.tops = [max(a, int(b)) for a, b in zip(self.tops, counts.max(axis=1))]
            self.phase_top = max(self.phase_top, int(phases.max(initial=0)))
            self.phase_bottom = min(self.phase_bottom, int(phases.min(initial=0)))
        return counts, start, phases

    def _spill(self, counts: np.ndarray, start: np.ndarray, phases: np.ndarray) -> None:
        if self.spill is None:
            self.spill = tempfile.TemporaryFile(prefix="kvmap-steps-")
        for a in (counts, phases):
            self.spill.write(a.tobytes())
        if self.keep_start:
            if self.starts is None:
                self.starts = tempfile.TemporaryFile(prefix="kvmap-starts-")
            self.starts.write(start.tobytes())
        self.sizes.append(len(phases))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(steps [n], num_reqs [n], num_tokens [n], step_start_ns [n] (or [0]: not kept), phase_ns [n, num_phases]);
        the log is empty afterwards."""
        last = self._close()
        n, P = self.n, self.num_phases
        # steps (int32 or int64), num_reqs and num_tokens (int16 too)
        counts = [np.empty(n, dtype=_fitting(top, narrow=k > 0)) for k, top in enumerate(self.tops)]
        start = np.empty(n if self.keep_start else 0, dtype=np.int64) if self.starts is None else None
        dtype = _fitting(self.phase_top, self.phase_bottom)
        if self.spill is None:
            phases = np.empty((n, P), dtype=dtype)
        else:  # spilled: the phase times stay on disk (ondisk.py), phase after phase: a phase's are contiguous
            times = tempfile.TemporaryFile(prefix="kvmap-phases-")
            times.truncate(n * P * np.dtype(dtype).itemsize)
            phases = mapped(times, dtype, (P, n)).T
            times.close()
        at = 0
        if self.spill is not None:
            self.spill.seek(0)
            for k in self.sizes:
                blk = (np.fromfile(self.spill, np.int64, 3 * k).reshape(3, k), None,
                       np.fromfile(self.spill, np.int64, k * P).reshape(k, P))
                self._place(blk, counts, start, phases, at)
                at += k
            self.spill.close()
            self.spill, self.sizes = None, []
        self._place(last, counts, start, phases, at)
        if self.starts is not None:  # spilled: the starts stay on disk, the open block's after them
            self.starts.seek(0, 2)
            self.starts.write(last[1].tobytes())
            start = mapped(self.starts, np.int64, (n,))
            self.starts.close()
            self.starts = None
        self.n = 0
        return counts[0], counts[1], counts[2], start, phases

    @staticmethod
    def _place(blk, counts: list[np.ndarray], start: np.ndarray | None, phases: np.ndarray, at: int) -> None:
        """A block's rows into the arrays from row `at` (its starts unless they are on disk); what it wrote into
        an array on disk is let go."""
        c, s, p = blk
        k = len(p)
        for row, values in zip(counts, c):
            row[at : at + k] = values
        if s is not None and start is not None:
            start[at : at + len(s)] = s
        phases[at : at + k] = p
        release(phases)


def _fitting(top: int, bottom: int = 0, narrow: bool = False) -> type:
    """The narrowest of int32 and int64 (`narrow`, for counts: int16 too) that holds bottom..top."""
    if narrow and -_INT16_MAX <= bottom and top <= _INT16_MAX:
        return np.int16
    return np.int32 if -_INT32_MAX <= bottom and top <= _INT32_MAX else np.int64


def needs_int64(values: np.ndarray) -> bool:
    """Some value of `values` does not fit int32."""
    return bool(len(values)) and (values.max() > 2**31 - 1 or values.min() < -(2**31))


def extend_ints(arr: array, values: np.ndarray) -> array:
    """`arr` ("i", or "q" once a value needed it) with `values` appended: the same array, or its int64 copy when
    one of them does not fit int32 (as appending them one by one and widening at the first that does not)."""
    if arr.typecode == "i" and needs_int64(values):
        arr = array("q", arr)
    arr.frombytes(values.astype(np.int32 if arr.typecode == "i" else np.int64).tobytes())
    return arr


class Rows:
    """Rows of `width` integers, appended a row at a time or as arrays of rows (a series of the recorded steps: KV
    occupancy, batch composition), held as StepLog holds its figures: an open block of `BLOCK` rows, 4 bytes a
    value (8 once one needs it), each full block spilled to an unlinked temporary file; handed over once, as one
    array made at its final size (a series grown in memory leaves its old copies' room in the heap)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.buf = array("i")  # the open block, row after row (array("q") once a value needed it)
        self.spill: BinaryIO | None = None
        self.blocks: list[str] = []  # typecode of each spilled block ("i" or "q"), BLOCK rows each
        self.n = 0

    def extend(self, values) -> None:
        n = len(self.buf)
        try:
            self.buf.extend(values)
        except OverflowError:
            del self.buf[n:]  # the row's values before the one that did not fit
            self.buf = array("q", self.buf)
            self.buf.extend(values)
        self.n += 1
        if len(self.buf) == BLOCK * self.width:
            self._spill()

    def extend_many(self, values: np.ndarray) -> None:
        """Rows [n, width] (int64) appended as `extend` appends them one by one: the same blocks, the same
        widening (a block is int64 once one of its values needs it)."""
        at = 0
        while at < len(values):
            room = BLOCK - len(self.buf) // self.width
            part = values[at : at + room]
            self.buf = extend_ints(self.buf, part)
            self.n += len(part)
            at += len(part)
            if len(self.buf) == BLOCK * self.width:
                self._spill()

    def _spill(self) -> None:
        """The full open block to the spill file; a new block opens."""
        if self.spill is None:
            self.spill = tempfile.TemporaryFile(prefix="kvmap-series-")
        self.spill.write(self.buf.tobytes())
        self.blocks.append(self.buf.typecode)
        self.buf = array("i")

    def __len__(self) -> int:
        return self.n

    def take(self) -> np.ndarray:
        """[rows, width] int32 (int64 when a value needed it); the rows start over. Rows that were spilled stay
        on disk when every value is int32: the open block joins them in the file and the array maps it
        (ondisk.py: a reader takes them a chunk at a time and lets each go); else one array in memory."""
        wide = "q" in self.blocks or self.buf.typecode == "q"
        if self.spill is not None and not wide:
            self.spill.seek(0, 2)
            self.spill.write(self.buf.tobytes())
            out = mapped(self.spill, np.int32, (self.n, self.width))
            self.spill.close()
            self.__init__(self.width)
            return out
        out = np.empty((self.n, self.width), dtype=np.int64 if wide else np.int32)
        at = 0
        if self.spill is not None:
            self.spill.seek(0)
            for code in self.blocks:
                out[at : at + BLOCK] = np.fromfile(self.spill, np.int32 if code == "i" else np.int64,
                                                   BLOCK * self.width).reshape(BLOCK, self.width)
                at += BLOCK
            self.spill.close()
        out[at:] = np.frombuffer(self.buf, dtype=np.int32 if self.buf.typecode == "i" else np.int64).reshape(
            -1, self.width)
        self.__init__(self.width)
        return out


class DistinctIds:
    """How many distinct request ids were added, in 8 bytes an id: each id kept as its 64-bit `hash` (two ids
    count as one only if their hashes collide, about 1 in 10^8 for a million ids), deduplicated whenever the
    kept hashes double, so that ids added again and again (every step's scheduled ids) stay bounded."""

    def __init__(self) -> None:
        self.hashes = array("q")
        self.unique = 0  # distinct hashes at the last deduplication

    def update(self, ids) -> None:
        self.hashes.extend(map(hash, ids))
        if len(self.hashes) > 2 * self.unique + BLOCK:
            self._dedupe()

    def add(self, req_id: str) -> None:
        self.update((req_id,))

    def _dedupe(self) -> None:
        # sorted, each value once: np.unique's result without its numpy.ma import (as run/stats.py's percentiles)
        s = np.sort(np.frombuffer(self.hashes, dtype=np.int64)) if self.hashes else np.zeros(0, np.int64)
        kept = s[np.concatenate(([True], s[1:] != s[:-1]))] if len(s) else s
        self.hashes, self.unique = array("q", kept.tobytes()), len(kept)

    def __len__(self) -> int:
        self._dedupe()
        return self.unique
