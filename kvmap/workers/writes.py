"""Staged writes into the long-lived token rows and block-table rows (the pattern of vLLM's `StagedWriteTensor`).

Rules:
- Every write into `token_ids` or a group's `block_table` goes through one `StagedWrites`: a ragged write
  (`rows[i]`, `starts[i] .. starts[i] + counts[i] - 1`, values concatenated) or one row slice.
- With `record` on (device workers), each write is also kept as (table, rows, starts, counts, values) until
  `drain()`, so that only what changed crosses to the device, once per step. Host workers leave it off; the
  write itself is the same either way.
- Tables are named `TOKENS` or a group index (block tables).
"""

from __future__ import annotations

import numpy as np

TOKENS = -1  # the table id of token_ids; block tables are 0 .. num_groups - 1


def ragged_columns(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Columns of ragged segments: segment i covers `starts[i] .. starts[i] + counts[i] - 1`, concatenated."""
    seg_start = np.cumsum(counts) - counts  # [n] offset of each segment in the concatenation
    return np.arange(int(counts.sum())) - np.repeat(seg_start - starts, counts)


def ragged_write(table: np.ndarray, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                 values: np.ndarray, one_each: bool | None = None) -> None:
    """`table[rows[i], starts[i] : starts[i] + counts[i]] = values[segment i]` for all i, in one scatter.
    `one_each`: the caller knows whether every count is 1 (None: look)."""
    total = len(values)
    if total == 0:
        return
    if one_each is None:
        one_each = total == len(rows) and int(counts.min()) == 1
    if one_each:  # one value per row (the usual decode step)
        table[rows, starts] = values
        return
    table[np.repeat(rows, counts), ragged_columns(starts, counts)] = values


class StagedWrites:
    def __init__(self, token_ids: np.ndarray, block_tables: list[np.ndarray], record: bool = False) -> None:
        self.tables = {TOKENS: token_ids, **dict(enumerate(block_tables))}  # table id -> [R, W] int32
        self.record = record
        self.log: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._one = np.ones(1, dtype=np.int64)

    def write(self, table: int, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, values: np.ndarray,
              one_each: bool | None = None) -> None:
        ragged_write(self.tables[table], rows, starts, counts, values, one_each)
        if self.record:
            self.log.append((table, rows, starts, counts, values))

    def write_row(self, table: int, row: int, start: int, values) -> None:
        """`table[row, start : start + len(values)] = values` (a list is converted by numpy, in C)."""
        if self.record:
            values = np.asarray(values, dtype=np.int32)
            self.log.append((table, self._one * row, self._one * start, self._one * len(values), values))
        self.tables[table][row, start : start + len(values)] = values

    def drain(self) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """The recorded writes since the last drain, oldest first."""
        log, self.log = self.log, []
        return log
