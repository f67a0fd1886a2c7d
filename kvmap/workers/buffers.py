"""Per-step inputs: the batch order, `idx_mapping` and every index mapping, built into preallocated buffers.

Rules:
- `InputBuffers` are allocated once at maximum size (max_num_seqs requests, max_num_batched_tokens tokens);
  each step hands out slices of them, so addresses stay fixed and the hot path allocates no buffers.
- One code path for prefill, chunked prefill and decode: request b's tokens are positions
  `num_computed_tokens[b] .. num_computed_tokens[b] + num_scheduled_tokens[b] - 1`.
- No per-token Python. Per-token arrays come from `np.repeat` of per-request bases plus `arange` (the one
  per-step temporary: numpy's repeat has no output argument); a step of pure decodes needs no expansion.
- Slots are computed from the persistent row-indexed block tables through `idx_mapping` (as MRV2's kernel
  does), not from the gathered batch table; the rule itself is `GroupLayout.slots` (layout.py), whose block
  span is the layout's `virtual_block_size`.
- Batch order is Model Runner V2's: a stable ascending sort by scheduled tokens; with speculative decoding,
  requests with drafts, then requests of exactly `1 + num_speculative_tokens` tokens, come first (#47381).
  `batch_order` is its one numpy form (the numba form is `kernels_cpu.batch_order`).
- Each function returns what it computed: this step's slices of the buffers (the hot ones through
  `InputBuffers.inputs`, `.tables`, `.slots`, which make each size's views once and keep them).
"""

from __future__ import annotations

import numpy as np

from kvmap.layout import PAD_SLOT_ID, group_layouts, null_history_groups
from kvmap.workers.mappings import BatchTables, Inputs, RankSlots
from kvmap.workers.state import WorkerState

VIEW_CACHE_MAX = 4096  # sizes of kept views per kind; past it the cache restarts (memory stays flat)


def batch_order(counts: np.ndarray, num_drafts: np.ndarray, num_speculative_tokens: int) -> np.ndarray:
    """Scheduler order -> batch order (indices into the scheduler-order arrays)."""
    if num_speculative_tokens == 0:
        return np.argsort(counts, kind="stable")
    # key (has no drafts, count != 1 + k, count); lexsort is stable and sorts by the last key first
    return np.lexsort((counts, counts != 1 + num_speculative_tokens, num_drafts == 0))


class InputBuffers:
    """Preallocated per-step buffers. N = max_num_seqs, T = max tokens in a step."""

    def __init__(self, state: WorkerState, max_num_tokens: int) -> None:
        N, T = state.max_num_reqs, max_num_tokens
        G = len(state.block_sizes)
        self.max_num_tokens = T
        self.idx_mapping = np.zeros(N, dtype=np.int32)  # [N] batch_idx -> req_state_idx
        self.num_scheduled_tokens = np.zeros(N, dtype=np.int32)  # [N]
        self.num_computed_tokens = np.zeros(N, dtype=np.int32)  # [N]
        self.query_start_loc = np.zeros(N + 1, dtype=np.int32)  # [N + 1]
        self.seq_lens = np.zeros(N, dtype=np.int32)  # [N]
        self.positions = np.zeros(T, dtype=np.int64)  # [T]
        self.input_ids = np.zeros(T, dtype=np.int32)  # [T]
        self.slot_mapping = np.full((G, T), PAD_SLOT_ID, dtype=np.int64)  # [G, T]
        self.block_tables = [np.zeros((N, w), dtype=np.int32) for w in state.max_num_blocks]  # [G] x [N, W_g]
        self.layouts = group_layouts(state.header)  # [G] rank 0's layouts: the cp = 1 slot mapping's rule
        self.num_blocks = np.zeros((G, N), dtype=np.int32)  # [G, N]
        # multi-rank (allocated only when used): [cp, G, T] every DCP rank's slots, [cp, N] local lengths,
        # [G] x [N, W_g * k_g] kernel block rows
        h = state.header
        cp = h.decode_context_parallel_size
        self.rank_slot_mapping = np.full((cp, G, T), PAD_SLOT_ID, dtype=np.int64) if cp > 1 else None
        self.dcp_local_seq_lens = np.zeros((cp, N), dtype=np.int32) if cp > 1 else None
        self.kernel_blocks_per_block = tuple(g.block_size // (g.kernel_block_size or g.block_size)
                                             for g in h.kv_cache_groups)
        self.kernel_block_tables = ([np.zeros((N, w * k), dtype=np.int32) for w, k in
                                     zip(state.max_num_blocks, self.kernel_blocks_per_block)]
                                    if h.has_kernel_split else None)
        # scratch
        self.arange = np.arange(max(T, N + 1), dtype=np.int64)  # [T] 0, 1, 2, ...
        self.tmp_tok = np.zeros(T, dtype=np.int64)  # [T]
        self.tmp_tok2 = np.zeros(T, dtype=np.int64)  # [T]
        self.tmp_req = np.zeros(N, dtype=np.int64)  # [N]
        self.tmp_req2 = np.zeros(N, dtype=np.int64)  # [N]
        self.tmp_blk = np.zeros(T, dtype=np.int32)  # [T] gathered block ids
        # [N, max W_g] entries nulled below the window (Model Runner V2, sliding-window groups only)
        W = max((state.max_num_blocks[g] for g in null_history_groups(h)), default=0)
        self.null_mask = np.zeros((N, W), dtype=bool)
        self.null_cols = np.arange(W, dtype=np.int64)  # [max W_g] 0, 1, 2, ... (column indices)
        self.order = np.zeros(N, dtype=np.int32)  # [N] batch_idx -> scheduler entry (compiled workers)
        self.sort_keys = np.zeros(N, dtype=np.int64)  # [N] sort key per scheduler entry
        self.sort_tmp = np.zeros(N, dtype=np.int32)  # [N] merge scratch
        # this step's slices: one `Inputs` (`views`) re-pointed when the step's B or T changes, from slices made
        # once per size (B -> the 5 per-request ones, T -> the 2 per-token ones); B -> BatchTables; T -> [G, T] slots
        self._req_views: dict[int, tuple] = {}
        self._tok_views: dict[int, tuple] = {}
        self._tables: dict[int, BatchTables] = {}
        self._slots: dict[int, np.ndarray] = {}
        self.views_B = self.views_T = 0  # the sizes `views` holds slices of
        self.views = Inputs(*self._req(0), self.positions[:0], self.input_ids[:0])  # this step's input slices

    def _req(self, B: int) -> tuple:
        v = self._req_views.get(B)
        if v is None:
            v = self._req_views[B] = (self.idx_mapping[:B], self.num_scheduled_tokens[:B],
                                      self.num_computed_tokens[:B], self.query_start_loc[: B + 1], self.seq_lens[:B])
        return v

    def inputs(self, B: int, T: int) -> Inputs:
        """The input slices of a step of B requests and T tokens (one object, valid until the next step)."""
        if T == self.views_T and B == self.views_B:  # most steps: the last step's sizes
            return self.views
        v = self.views
        if T != self.views_T:
            self.views_T = T
            tok = self._tok_views.get(T)
            if tok is None:
                if len(self._tok_views) > VIEW_CACHE_MAX:
                    self._tok_views.clear()
                tok = self._tok_views[T] = (self.positions[:T], self.input_ids[:T])
            v.positions, v.input_ids = tok
        if B != self.views_B:
            self.views_B = B
            v.idx_mapping, v.num_scheduled_tokens, v.num_computed_tokens, v.query_start_loc, v.seq_lens = self._req(B)
        return v

    def tables(self, B: int) -> BatchTables:
        """The gathered block-table slices of B requests."""
        v = self._tables.get(B)
        if v is None:
            v = self._tables[B] = BatchTables([t[:B] for t in self.block_tables], self.num_blocks[:, :B])
        return v

    def slots(self, T: int) -> np.ndarray:
        """[G, T] the cp = 1 slot mapping of T tokens."""
        v = self._slots.get(T)
        if v is None:
            if len(self._slots) > VIEW_CACHE_MAX:
                self._slots.clear()
            v = self._slots[T] = self.slot_mapping[:, :T]
        return v

    def rank_slots(self, num_ranks: int, B: int, T: int) -> RankSlots:
        """The first `num_ranks` computed DCP ranks' slots [num_ranks, G, T] and local lengths [num_ranks, B]."""
        return RankSlots(self.rank_slot_mapping[:num_ranks, :, :T], self.dcp_local_seq_lens[:num_ranks, :B])


def build_inputs(state: WorkerState, buf: InputBuffers, rows: np.ndarray, counts: np.ndarray,
                 order: np.ndarray) -> Inputs:
    """`idx_mapping`, `query_start_loc`, `seq_lens`, `positions`, `input_ids` into `buf`; returns their slices.

    Per-token values are one `np.repeat` of a per-request base plus `arange`: request b's tokens are
    `positions = (num_computed_tokens[b] - query_start_loc[b]) + t`, and their flat index into the token rows
    is that plus `row[b] * width`. A step of pure decodes (T == B) needs no expansion at all.
    """
    B = len(order)
    idx = buf.idx_mapping[:B]
    np.take(rows, order, out=idx)
    n = buf.num_scheduled_tokens[:B]
    np.take(counts, order, out=n)
    nc = buf.num_computed_tokens[:B]
    np.take(state.num_computed_tokens, idx, out=nc)
    qsl = buf.query_start_loc
    np.cumsum(n, out=qsl[1 : B + 1])
    T = int(qsl[B])
    np.add(nc, n, out=buf.seq_lens[:B])
    pos = buf.positions[:T]
    flat = buf.tmp_tok[:T]
    base = buf.tmp_req[:B]
    if T == B:
        pos[:] = nc
        np.multiply(idx, state.token_width, out=flat)
        flat += nc
    else:
        np.subtract(nc, qsl[:B], out=base)
        np.add(np.repeat(base, n), buf.arange[:T], out=pos)
        np.multiply(idx, state.token_width, out=buf.tmp_req2[:B])
        base += buf.tmp_req2[:B]
        np.add(np.repeat(base, n), buf.arange[:T], out=flat)
    np.take(state.token_ids.reshape(-1), flat, out=buf.input_ids[:T], mode="clip")
    return buf.inputs(B, T)


def gather_block_tables(state: WorkerState, buf: InputBuffers, B: int) -> BatchTables:
    """Copy each batch request's block-table row; returns the slices. Whole rows from the contiguous state
    table: a row memcpy is cheaper than gathering a narrower strided view (numpy copies a non-contiguous source
    first)."""
    idx = buf.idx_mapping[:B]
    for g, table in enumerate(state.block_tables):
        np.take(state.num_blocks[g], idx, out=buf.num_blocks[g, :B])
        np.take(table, idx, axis=0, out=buf.block_tables[g][:B], mode="clip")
    return buf.tables(B)


def null_history(buf: InputBuffers, tables: BatchTables, num_computed_tokens: np.ndarray,
                 groups: tuple[int, ...]) -> BatchTables:
    """Model Runner V2's sliding-window rule on the gathered rows, in place: row b's entries
    `[0, null_history_blocks(num_computed_tokens[b]))` become the null block 0, in each listed group
    (`GroupLayout.null_history_lens`); returns the tables."""
    B = len(num_computed_tokens)
    n0 = buf.tmp_req[:B]
    for g in groups:
        t = tables.block_tables[g]
        buf.layouts[g].null_history_lens(num_computed_tokens, out=n0)
        mask = buf.null_mask[:B, : t.shape[1]]
        np.less(buf.null_cols[: t.shape[1]], n0[:, None], out=mask)
        np.putmask(t, mask, 0)
    return tables


def compute_slot_mappings(state: WorkerState, buf: InputBuffers, B: int, T: int) -> np.ndarray:
    """Every group's `slot_mapping` [G, T] (cp = 1): the row entry at `pos // block_size`, read from the persistent
    row-indexed table through `idx_mapping` (as MRV2's kernel does), then `GroupLayout.slots`."""
    pos, ids, tmp = buf.positions[:T], buf.tmp_blk[:T], buf.tmp_tok2[:T]
    for g, lay in enumerate(buf.layouts):
        if lay.has_slots:
            _gather_block_ids(state.block_tables[g], buf, lay, B, T, pos, tmp, ids)
        lay.slots(ids, pos, out=buf.slot_mapping[g, :T], tmp=tmp)
    return buf.slot_mapping[:, :T]


def _gather_block_ids(table: np.ndarray, buf: InputBuffers, lay, B: int, T: int, pos: np.ndarray, tmp: np.ndarray,
                      out: np.ndarray) -> None:
    """out [T]: the row entry at `pos // virtual_block_size` of each token's request row (through `idx_mapping`);
    tmp [T] int64 scratch."""
    flat, rowbase = buf.tmp_tok[:T], buf.tmp_req[:B]
    np.multiply(buf.idx_mapping[:B], table.shape[1], out=rowbase)
    flat[:] = rowbase if T == B else np.repeat(rowbase, buf.num_scheduled_tokens[:B])
    flat += lay.block_indices(pos, out=tmp)
    np.take(table.reshape(-1), flat, out=out, mode="clip")


def compute_rank_slot_mappings(state: WorkerState, buf: InputBuffers, layouts, B: int, T: int) -> np.ndarray:
    """Every computed DCP rank's `slot_mapping` [num_ranks, G, T] (layouts: [num_ranks][G] `GroupLayout`): the
    row entry at `pos // virtual_block_size` read through `idx_mapping`, then `GroupLayout.slots` (PAD_SLOT_ID
    where another rank holds the token)."""
    pos, ids, tmp = buf.positions[:T], buf.tmp_blk[:T], buf.tmp_tok2[:T]
    for g, table in enumerate(state.block_tables):
        if layouts[0][g].has_slots:
            _gather_block_ids(table, buf, layouts[0][g], B, T, pos, tmp, ids)
        for i, lays in enumerate(layouts):
            lays[g].slots(ids, pos, out=buf.rank_slot_mapping[i, g, :T])
    return buf.rank_slot_mapping[: len(layouts), :, :T]


def dcp_local_seq_lens(buf: InputBuffers, seq_layouts, B: int) -> np.ndarray:
    """[num_ranks, B] local lengths of every computed rank (seq_layouts: one sharded layout per rank)."""
    for i, lay in enumerate(seq_layouts):
        lay.dcp_local_seq_lens(buf.seq_lens[:B], out=buf.dcp_local_seq_lens[i, :B])
    return buf.dcp_local_seq_lens[: len(seq_layouts), :B]


def kernel_block_tables(buf: InputBuffers, layouts, B: int) -> list[np.ndarray]:
    """The gathered rows expanded to kernel block ids (manager id b -> b*k .. b*k+k-1), every group; returns
    the [G] x [B, W_g * k_g] slices."""
    out = []
    for g, lay in enumerate(layouts):
        out.append(buf.kernel_block_tables[g][:B])
        out[-1][:] = lay.kernel_rows(buf.block_tables[g][:B])
    return out
