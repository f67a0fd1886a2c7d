"""A long run's arrays in as little memory as they allow: its per-step series kept on disk, mapped from the unlinked
temporary file they were spilled to (only the part being read is in memory, and only until it is let go), and
its large arrays each in a mapping of its own, returned to the system when freed.

Rules:
- `mapped` turns a file of rows into an array over a shared memory map of it (an ndarray like any other: any
  reader may index it, and writes reach the file). Pages come into memory as they are read.
- A reader that walks such an array a chunk at a time calls `release` after each chunk: the pages it brought in
  leave the process (`madvise(MADV_DONTNEED)`; a shared file mapping keeps what was written, and the next read
  maps the file's pages again). For an array in memory, `release` does nothing.
- `own_mappings` (once a replay's steps are done, so the hot path keeps glibc's own tuning) fixes glibc's mmap
  threshold at its default, 128 KiB: glibc otherwise raises it to the largest block freed so far, after which
  a long run's arrays and their temporaries come from the heap, whose room stays after they go. Elsewhere than
  glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import BinaryIO

import numpy as np


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 128 * 1024  # glibc's default: blocks this large or larger are mappings of their own


def own_mappings() -> None:
    """From now on every block of MMAP_THRESHOLD bytes or more is its own mapping (the module's rules)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library to ask, or not glibc's
        return
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def mapped(f: BinaryIO, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    """`shape` values of `dtype` from the start of `f` (flushed here), as an array over a shared map of the file;
    `f` may be closed afterwards (the map keeps its own handle)."""
    f.flush()
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    assert size > 0, shape  # mmap cannot map nothing: an empty series stays in memory
    return np.frombuffer(mmap.mmap(f.fileno(), size), dtype=dtype).reshape(shape)


def release(a: np.ndarray) -> None:
    """Let go of the pages of the memory map under `a` (a view of one: the whole map's); nothing for an array in
    memory."""
    base = a.base
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # numpy's hold on the buffer it was made from
        base = base.obj
    if isinstance(base, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):  # (a system without it keeps the pages)
        base.madvise(mmap.MADV_DONTNEED)
