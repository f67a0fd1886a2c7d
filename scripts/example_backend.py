"""An example user backend: vLLM V1-style input preparation (numpy on the host), run by kvmap on real traces.

    kvmap replay traces/long_mixed.jsonl.gz --backend scripts/example_backend.py:V1StyleWorker
    kvmap validate traces/spec_decode.jsonl --deep --backend scripts/example_backend.py:V1StyleWorker

This is the code an engine developer would bring: it subclasses `kvmap.workers.host.HostWorker`, which keeps
kvmap's persistent state (request rows, token rows, block-table rows, updated from the trace every step) and
preallocated per-step buffers, and fills in the four mapping phases with its own code. kvmap times each phase,
writes and reads back the KV cache through the slots it computes, and `validate --deep --backend` compares
every step with the reference, naming the first mismatch.

The mapping code is vLLM's V1 runner before #32951: `req_indices = np.repeat(arange, counts)`, per-token
offsets by the cumsum trick, `np.take` from the flattened token buffer, a gather of the batch's full
block-table rows, and the slot from the flattened batch table. `scripts/bench.py` uses it as its baseline.
"""

from __future__ import annotations

import numpy as np

from kvmap.workers.host import HostWorker


class V1Baseline:
    """V1-style mappings from rows and counts already in batch order, into buffers named as kvmap's
    `InputBuffers` (idx_mapping, query_start_loc, seq_lens, positions, input_ids, block_tables,
    slot_mapping, arange)."""

    def __init__(self, token_ids: np.ndarray, block_tables: list[np.ndarray], block_sizes: list[int],
                 num_computed: np.ndarray, out) -> None:
        self.token_ids = token_ids  # [R, W] row -> tokens
        self.block_tables = block_tables  # [G] x [R, max_blocks_g] row -> block ids
        self.block_sizes = block_sizes  # [G]
        self.num_computed = num_computed  # [R] row -> num_computed_tokens
        self.out = out
        self.B = self.T = 0
        self.req_indices = out.arange[:0]  # [T] flat token -> batch_idx

    def step(self, rows_list: list[int], counts_list: list[int]) -> int:
        """From the scheduler's lists, already in batch order, to finished arrays. Returns T."""
        self.prepare_inputs(np.array(rows_list, dtype=np.int32), np.array(counts_list, dtype=np.int32))
        self.gather_block_tables()
        self.compute_slot_mappings()
        return self.T

    def prepare_inputs(self, rows: np.ndarray, ns: np.ndarray) -> None:
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
        self.req_indices, self.B, self.T = req_indices, B, T

    def gather_block_tables(self) -> None:
        rows = self.out.idx_mapping[: self.B]
        for table, batch_table in zip(self.block_tables, self.out.block_tables):
            np.take(table, rows, axis=0, out=batch_table[: self.B])  # full rows, as V1 commits them

    def compute_slot_mappings(self) -> None:
        T = self.T
        pos = self.out.positions[:T]
        for g, (table, bs) in enumerate(zip(self.out.block_tables, self.block_sizes)):
            idx = self.req_indices * table.shape[1] + pos // bs
            np.add(table.ravel()[idx].astype(np.int64) * bs, pos % bs, out=self.out.slot_mapping[g, :T])


class V1StyleWorker(HostWorker):
    """kvmap's host state and buffers; the batch order and the mappings are the V1-style code above."""

    name = "v1_style"

    def __init__(self, header, device: str = "cpu") -> None:
        super().__init__(header, device)
        st = self.state
        self.base = V1Baseline(st.token_ids, st.block_tables, st.block_sizes, st.num_computed_tokens, self.buffers)

    def sort_batch(self) -> None:
        b = self.batch  # Model Runner V2's order (a stable sort by scheduled tokens), which kvmap dumps
        if self.header.num_speculative_tokens:
            k = self.header.num_speculative_tokens
            n, d = b.num_scheduled_tokens, b.num_draft_tokens
            b.order = np.lexsort((n, n != 1 + k, d == 0))
        else:
            b.order = np.argsort(b.num_scheduled_tokens, kind="stable")

    def prepare_inputs(self) -> None:
        b = self.batch
        self.base.prepare_inputs(b.rows[b.order], b.num_scheduled_tokens[b.order])
        self.buffers.num_scheduled_tokens[: b.num_reqs] = b.num_scheduled_tokens[b.order]
        self.buffers.num_computed_tokens[: b.num_reqs] = self.state.num_computed_tokens[b.rows[b.order]]
        b.num_tokens = self.base.T

    def gather_block_tables(self) -> None:
        self.base.gather_block_tables()
        n = self.batch.num_reqs  # kvmap's record also keeps each row's valid length
        self.buffers.num_blocks[:, :n] = self.state.num_blocks[:, self.buffers.idx_mapping[:n]]

    def compute_slot_mappings(self) -> None:
        self.base.compute_slot_mappings()
