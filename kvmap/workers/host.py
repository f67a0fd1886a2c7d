"""The host workers' common base and the vectorized `numpy` backend.

Rules:
- `HostWorker` keeps the long-lived `WorkerState` (request, token and block-table rows) apart from the
  per-step `InputBuffers`, both preallocated at maximum size; each phase fills slices of the buffers.
- The numpy phases are whole-array operations (workers/buffers.py): no per-token Python. The compiled worker
  (numba_worker.py) replaces the mapping phases and the KV paths with kernels and keeps the rest.
- `readable_context` is the KV read-back's input: every (batch request, position, slot, token) this step
  may read, by the layout's window rule.
"""

from __future__ import annotations

import numpy as np

from kvmap.errors import TraceError
from kvmap.kv.cache import KVCheckResult, PagedKVCache, RankedKVCache
from kvmap.layout import rank_layouts, seq_layouts
from kvmap.trace import Step, TraceHeader
from kvmap.workers import buffers as B
from kvmap.workers.contract import StepBatch, Worker
from kvmap.workers.mappings import BatchMappings
from kvmap.workers.state import WorkerState
from kvmap.workers.writes import ragged_columns


class HostWorker(Worker):
    """State and buffers in host memory; the mapping phases are left to subclasses."""

    def __init__(self, header: TraceHeader, device: str = "cpu") -> None:
        super().__init__(header, device)
        self.state = WorkerState(header)
        self.buffers = B.InputBuffers(self.state, max(header.max_num_batched_tokens,
                                                      header.max_num_scheduled_tokens or 0))
        self.multirank = header.decode_context_parallel_size > 1
        self.kernel_split = header.has_kernel_split
        self._set_layouts()
        self._mappings: BatchMappings | None = None
        self._no_drafts = np.zeros(header.max_num_seqs, dtype=np.int32)

    def set_ranks(self, ranks) -> None:
        super().set_ranks(ranks)
        self._set_layouts()

    def _set_layouts(self) -> None:
        h = self.header
        self.rank_layouts = rank_layouts(h, self.ranks)  # [num_ranks][G]
        self.layouts = self.rank_layouts[0]  # the first computed rank's (the only one when cp = 1)
        # dcp_local_seq_lens: one sharded layout per computed rank
        self.seq_layouts = seq_layouts(h, self.ranks)

    def multirank_block_tables(self) -> None:
        """After the gather: the kernel block rows (a kernel split only)."""
        if self.kernel_split:
            B.kernel_block_tables(self.buffers, self.layouts, self.batch.num_reqs)

    def multirank_slot_mappings(self) -> None:
        """Every computed DCP rank's slots and local lengths (cp > 1 only)."""
        b = self.batch
        B.compute_rank_slot_mappings(self.state, self.buffers, self.rank_layouts, b.num_reqs, b.num_tokens)
        B.dcp_local_seq_lens(self.buffers, self.seq_layouts, b.num_reqs)

    @property
    def num_standin_tokens(self) -> int:
        return self.state.num_standin_tokens

    def update_states(self, step: Step) -> None:
        T = step.scheduler_output.total_num_scheduled_tokens
        if T > self.buffers.max_num_tokens:
            raise TraceError(f"{T} tokens exceed the header's token budget {self.buffers.max_num_tokens}",
                             line=step.line, step=step.step, field="total_num_scheduled_tokens")
        req_ids, rows, counts, drafts = self.state.update(step)
        self.set_batch(StepBatch(step, req_ids, rows, counts, drafts, num_tokens=T))

    def set_batch(self, batch: StepBatch) -> None:
        """Start a step from a batch directly (benchmarks: synthetic batches over state they wrote)."""
        self.batch = batch
        self._mappings = None

    def schedule(self, rows: list[int], counts: list[int], req_ids: list[str] | None = None) -> StepBatch:
        """A synthetic batch without drafts, in scheduler order (benchmarks)."""
        r = np.array(rows, dtype=np.int32)
        c = np.array(counts, dtype=np.int32)
        # T: host workers count it in prepare_inputs; device workers need it first (a trace carries it)
        T = int(c.sum()) if self.has_h2d else 0
        batch = StepBatch(None, req_ids, r, c, self._no_drafts[: len(r)], num_tokens=T)
        self.set_batch(batch)
        return batch

    def prepare_batch(self) -> None:
        """The batch order: V1's persistent batch when asked for, else this backend's MRV2 sort."""
        if self.v1_batch is None:
            return self.sort_batch()
        b = self.batch
        entry = {r: i for i, r in enumerate(b.req_ids)}
        order = self.v1_order(b.step)
        b.order = np.fromiter(map(entry.__getitem__, order), np.int32, len(order))

    def sort_batch(self) -> None:
        """Model Runner V2's order into `self.batch.order` (numpy; compiled backends override)."""
        b = self.batch
        b.order = B.batch_order(b.num_scheduled_tokens, b.num_draft_tokens, self.header.num_speculative_tokens)

    def append_sampled(self) -> None:
        b = self.batch
        assert b is not None and b.step is not None
        self.state.append_sampled(b.step, b.req_ids, b.rows)

    # ---------------------------------------------------------------------------------------- KV cache

    def write_kv(self, kv: PagedKVCache | RankedKVCache) -> None:
        buf, T = self.buffers, self.batch.num_tokens
        if isinstance(kv, RankedKVCache):  # each rank's shard through its own slots
            for i, shard in enumerate(kv.shards):
                shard.write(buf.input_ids[:T], buf.positions[:T], buf.rank_slot_mapping[i, :, :T])
            return
        kv.write(buf.input_ids[:T], buf.positions[:T], buf.slot_mapping[:, :T])

    def verify_kv(self, kv: PagedKVCache | RankedKVCache, into: KVCheckResult) -> None:
        req_ids = self.mappings().req_ids

        def check(i: int, shard: PagedKVCache) -> None:
            for g in self.state.kv_groups:  # state groups hold no per-token KV
                shard.verify_context(g, self.current_step, req_ids, *self.readable_context(g, i), into=into)

        if isinstance(kv, RankedKVCache):
            kv.verify(into, check)
        else:
            check(0, kv)

    def readable_context(self, group: int, rank_index: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                           np.ndarray]:
        """(batch_idx, position, slot, token id) arrays over every position this step's requests may read that
        the `rank_index`-th computed DCP rank holds (every position when cp = 1)."""
        lay = self.rank_layouts[rank_index][group]
        m, st = self.mappings(), self.state
        n = self.batch.num_reqs
        idx = m.idx_mapping[:n].astype(np.int64)
        nc = m.num_computed_tokens[:n].astype(np.int64)
        hi = m.seq_lens[:n].astype(np.int64)
        lo = lay.readable_lo(nc)
        counts = hi - lo
        breq = np.repeat(np.arange(n), counts)
        pos = ragged_columns(lo, counts)
        if lay.cp_size > 1:
            keep = lay.local_mask(pos)
            breq, pos = breq[keep], pos[keep]
        rows = idx[breq]
        blocks = st.block_tables[group][rows, pos // lay.virtual_block_size]
        return breq, pos, lay.slots(blocks, pos), st.token_ids[rows, pos]

    # ----------------------------------------------------------------------------------------- results

    def mappings(self) -> BatchMappings:
        if self._mappings is None:
            b = self.batch
            self._mappings = B.view(self.buffers, b.batch_req_ids(), b.num_reqs, b.num_tokens)
            if self.multirank or self.kernel_split:
                B.view_ranks(self._mappings, self.buffers, self.ranks, b.num_reqs, b.num_tokens)
        return self._mappings


class NumpyWorker(HostWorker):
    """The vectorized CPU worker: numpy on preallocated buffers, no per-token Python."""

    name = "numpy"

    def prepare_inputs(self) -> None:
        b = self.batch
        _, b.num_tokens = B.build_inputs(self.state, self.buffers, b.rows, b.num_scheduled_tokens, b.order)

    def gather_block_tables(self) -> None:
        B.gather_block_tables(self.state, self.buffers, self.batch.num_reqs)
        if self.kernel_split:
            self.multirank_block_tables()

    def compute_slot_mappings(self) -> None:
        if self.multirank:
            return self.multirank_slot_mappings()
        B.compute_slot_mappings(self.state, self.buffers, self.batch.num_reqs, self.batch.num_tokens)
