"""The whole-batch state operations, vectorized (numpy) or compiled (numba): one interface, two forms.

Rules: `WorkerState` calls these and never branches on which form it has. `VectorOps` writes tokens through
the state's `StagedWrites` (so device workers see every write); `CompiledOps` appends in one kernel call
straight into the token rows, so it is only for host workers (it refuses a recording `StagedWrites`).
Both return -1 or the index of the first request whose tokens would overflow `max_model_len`.
"""

from __future__ import annotations

import numpy as np


class VectorOps:
    def scatter(self, dst: np.ndarray, idx: np.ndarray, values: np.ndarray) -> None:
        dst[idx] = values

    def positions_fit(self, rows, counts, num_drafts, num_computed_tokens, capacity, total_len) -> bool:
        """Every scheduled position has a block, and every non-draft position a known token."""
        end = num_computed_tokens[rows] + counts
        return not (bool((end > capacity[rows]).any()) or bool((end - num_drafts > total_len[rows]).any()))

    def append_tokens(self, state, rows: np.ndarray, counts: np.ndarray, flat: np.ndarray) -> int:
        starts = state.total_len[rows]
        ends = starts + counts
        if len(ends) and int(ends.max()) > state.header.max_model_len:
            return int(np.argmax(ends > state.header.max_model_len))
        from kvmap.workers.writes import TOKENS

        state.writes.write(TOKENS, rows, starts, counts, flat, len(flat) == len(rows) and bool(counts.all()))
        state.total_len[rows] = ends
        return -1


class CompiledOps:
    def __init__(self, writes) -> None:
        from kvmap.aot import load

        assert not writes.record, "compiled appends bypass the staged-write log: host workers only"
        self.k = load("kvmap.workers.kernels_cpu")

    def scatter(self, dst: np.ndarray, idx: np.ndarray, values: np.ndarray) -> None:
        self.k.scatter(dst, idx, values)

    def positions_fit(self, rows, counts, num_drafts, num_computed_tokens, capacity, total_len) -> bool:
        return self.k.positions_fit(rows, counts, num_drafts, num_computed_tokens, capacity, total_len)

    def append_tokens(self, state, rows: np.ndarray, counts: np.ndarray, flat: np.ndarray) -> int:
        return self.k.append_tokens(state.token_ids, state.total_len, rows, counts, flat, state.header.max_model_len)
