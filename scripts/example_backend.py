"""An example user backend: vLLM V1-style input preparation (numpy on the host), run by kvmap on real traces.

    kvmap replay traces/long_mixed.jsonl.gz --backend scripts/example_backend.py:V1StyleWorker
    kvmap validate traces/spec_decode.jsonl --deep --backend scripts/example_backend.py:V1StyleWorker

This is the code an engine developer would bring: three array functions that return what they compute, in a
`MappingOps`, composed into kvmap's `HostWorker`. kvmap keeps the persistent state (request rows, token rows,
block-table rows, updated from the trace every step), puts the batch in Model Runner V2's order, times each
phase, writes and reads back the KV cache through the slots returned here, and `validate --deep --backend`
compares every step with the reference, naming the first mismatch. Nothing here fills kvmap's buffers.

The mapping code is vLLM's V1 runner before #32951: `req_indices = np.repeat(arange, counts)`, per-token
offsets by the cumsum trick, `np.take` from the flattened token buffer, a gather of the batch's full
block-table rows, and the slot from the flattened batch table. `scripts/bench.py` uses it as its baseline.
Rules: cp = 1 only (no DCP, no kernel block split); int32 ids, int64 positions and slots, as kvmap's buffers.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kvmap.workers.host import HostWorker
from kvmap.workers.mappings import BatchTables, Inputs
from kvmap.workers.ops import MappingOps


def own_buffers(block_tables: list[np.ndarray], max_tokens: int) -> SimpleNamespace:
    """The baseline's own preallocated buffers (R rows, T tokens, G groups)."""
    R = block_tables[0].shape[0]
    return SimpleNamespace(
        arange=np.arange(max(max_tokens, R + 1), dtype=np.int64),  # [T] 0, 1, 2, ...
        idx_mapping=np.zeros(R, dtype=np.int32),  # [R] batch_idx -> req_state_idx
        query_start_loc=np.zeros(R + 1, dtype=np.int32),  # [R + 1] batch_idx -> first flat token
        seq_lens=np.zeros(R, dtype=np.int32),  # [R] batch_idx -> num_computed + num_scheduled
        positions=np.zeros(max_tokens, dtype=np.int64),  # [T] flat token -> position
        input_ids=np.zeros(max_tokens, dtype=np.int32),  # [T] flat token -> token id
        block_tables=[np.zeros_like(t) for t in block_tables],  # [G] x [R, W_g] batch_idx -> block ids
        slot_mapping=np.full((len(block_tables), max_tokens), -1, dtype=np.int64))  # [G, T] flat token -> slot


class V1Baseline:
    """V1-style mappings from rows and counts already in batch order, into its own buffers; each phase returns
    its slices."""

    def __init__(self, token_ids: np.ndarray, block_tables: list[np.ndarray], block_sizes: list[int],
                 num_computed: np.ndarray, out: SimpleNamespace) -> None:
        self.token_ids = token_ids  # [R, W] row -> tokens
        self.block_tables = block_tables  # [G] x [R, max_blocks_g] row -> block ids
        self.block_sizes = block_sizes  # [G]
        self.num_computed = num_computed  # [R] row -> num_computed_tokens
        self.out = out
        self.req_indices = out.arange[:0]  # [T] flat token -> batch_idx (this step's)

    def step(self, rows_list: list[int], counts_list: list[int]) -> int:
        """From the scheduler's lists, already in batch order, to finished arrays. Returns T."""
        inputs = self.prepare_inputs(np.array(rows_list, dtype=np.int32), np.array(counts_list, dtype=np.int32))
        self.gather_block_tables(inputs.idx_mapping)
        self.compute_slot_mappings(inputs.positions)
        return len(inputs.positions)

    def prepare_inputs(self, rows: np.ndarray, ns: np.ndarray) -> Inputs:
        o = self.out
        B = len(rows)
        o.idx_mapping[:B] = rows
        req_indices = np.repeat(o.arange[:B], ns)
        cu = np.cumsum(ns)
        T = int(cu[-1]) if B else 0
        o.query_start_loc[0] = 0
        o.query_start_loc[1 : B + 1] = cu
        query_pos = o.arange[:T] - np.repeat(cu - ns, ns)
        nc = self.num_computed[rows]
        positions = o.positions[:T]
        np.add(nc[req_indices], query_pos, out=positions)
        np.add(nc, ns, out=o.seq_lens[:B])
        flat = positions + rows[req_indices].astype(np.int64) * self.token_ids.shape[1]
        np.take(self.token_ids.ravel(), flat, out=o.input_ids[:T])
        self.req_indices = req_indices
        return Inputs(o.idx_mapping[:B], ns, nc, o.query_start_loc[: B + 1], o.seq_lens[:B], positions,
                      o.input_ids[:T])

    def gather_block_tables(self, rows: np.ndarray) -> list[np.ndarray]:
        B = len(rows)
        for table, batch_table in zip(self.block_tables, self.out.block_tables):
            np.take(table, rows, axis=0, out=batch_table[:B])  # full rows, as V1 commits them
        return [t[:B] for t in self.out.block_tables]

    def compute_slot_mappings(self, positions: np.ndarray) -> np.ndarray:
        T = len(positions)
        for g, (table, bs) in enumerate(zip(self.out.block_tables, self.block_sizes)):
            idx = self.req_indices * table.shape[1] + positions // bs
            np.add(table.ravel()[idx].astype(np.int64) * bs, positions % bs, out=self.out.slot_mapping[g, :T])
        return self.out.slot_mapping[:, :T]


class V1StyleOps(MappingOps):
    """The three mapping phases of the V1-style code above, over kvmap's request state."""

    def __init__(self, state, buffers, device: str = "cpu") -> None:
        super().__init__(state, buffers, device)
        self.num_blocks = state.num_blocks  # [G, R] row -> valid blocks (V1's num_blocks_per_row)
        self.base = V1Baseline(state.token_ids, state.block_tables, state.block_sizes, state.num_computed_tokens,
                               own_buffers(state.block_tables, buffers.max_num_tokens))

    def prepare_inputs(self, batch) -> Inputs:
        return self.base.prepare_inputs(batch.rows[batch.order], batch.num_scheduled_tokens[batch.order])

    def gather_block_tables(self, inputs: Inputs) -> BatchTables:
        rows = inputs.idx_mapping
        return BatchTables(self.base.gather_block_tables(rows), self.num_blocks[:, rows])

    def compute_slot_mappings(self, inputs: Inputs) -> np.ndarray:
        return self.base.compute_slot_mappings(inputs.positions)


class V1StyleWorker(HostWorker):
    """kvmap's host worker with the V1-style array functions."""

    name = "v1_style"
    ops_class = V1StyleOps
