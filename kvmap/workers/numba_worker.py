"""The compiled host backend (`numba`, the default): the batch order, the mapping phases, the hot state updates,
the KV canary paths and the forward parts (their numba forms, forward/compiled.py) as numba kernels, over the
host worker's state and buffers.

Rules: one kernel call per phase and group (workers/kernels_cpu.py, kv/kernels.py), each returning its slices of
the buffers; the KV cache it makes writes and reads back through the compiled kernels, so `--backend numpy`
times no compiled code. The kernels come from `kvmap.aot.load`: the ahead-of-time twin built at install (no
numba import), or numba's JIT.
"""

from __future__ import annotations

import numpy as np

from kvmap.aot import load
from kvmap.kv.cache import KVCheckResult, KVGeometry, PagedKVCache, RankedKVCache
from kvmap.workers.buffers import InputBuffers, kernel_block_tables
from kvmap.workers.contract import StepBatch
from kvmap.workers.host import HostWorker
from kvmap.workers.mappings import BatchTables, Inputs, RankSlots
from kvmap.workers.ops import MappingOps, host_verify_kv
from kvmap.workers.state import WorkerState
from kvmap.workers.state_ops import CompiledOps


class NumbaOps(MappingOps):
    """The mapping phases as numba kernels writing the preallocated host buffers."""

    def __init__(self, state: WorkerState, buffers: InputBuffers, device: str = "cpu") -> None:
        super().__init__(state, buffers, device)
        self.k = load("kvmap.workers.kernels_cpu")
        self.detail = ("kernels compiled ahead of time" if self.k.kind == "ahead-of-time"
                       else "kernels under numba's JIT, cached")
        state.ops = CompiledOps(state.writes)  # the hot state updates compiled too
        self._block_sizes = [lay.block_size for lay in buffers.layouts]  # [G] cp = 1

    def batch_order(self, num_scheduled_tokens: np.ndarray, num_draft_tokens: np.ndarray,
                    num_speculative_tokens: int) -> np.ndarray:
        buf = self.buffers
        n = self.k.batch_order(num_scheduled_tokens, num_draft_tokens, num_speculative_tokens, buf.order,
                               buf.sort_keys, buf.sort_tmp)
        return buf.order[:n]

    def prepare_inputs(self, batch: StepBatch) -> Inputs:
        st, buf = self.state, self.buffers
        T = self.k.prepare_inputs(batch.rows, batch.num_scheduled_tokens, batch.order, st.num_computed_tokens,
                                  st.token_ids, buf.idx_mapping, buf.num_scheduled_tokens, buf.num_computed_tokens,
                                  buf.query_start_loc, buf.seq_lens, buf.positions, buf.input_ids)
        B = len(batch.order)
        if T == buf.views_T and B == buf.views_B:  # the usual step: the last step's sizes (no call, no slicing)
            return buf.views
        return buf.inputs(B, T)

    def gather_block_tables(self, inputs: Inputs) -> BatchTables:
        buf, st = self.buffers, self.state
        idx = inputs.idx_mapping
        for g, table in enumerate(st.block_tables):
            self.k.gather_block_table(idx, st.num_blocks[g], table, buf.block_tables[g], buf.num_blocks[g])
        return buf.tables(len(idx))

    def null_history(self, tables: BatchTables, inputs: Inputs, groups: tuple[int, ...]) -> BatchTables:
        nc = inputs.num_computed_tokens
        for g in groups:
            lay = self.buffers.layouts[g]
            self.k.null_history(nc, lay.num_retained_tokens, lay.block_size, tables.block_tables[g])
        return tables

    def kernel_block_tables(self, tables: BatchTables, layouts) -> list:
        return kernel_block_tables(self.buffers, layouts, len(tables.num_blocks[0]))

    def compute_slot_mappings(self, inputs: Inputs) -> np.ndarray:
        buf, st = self.buffers, self.state
        i = inputs
        for g, table in enumerate(st.block_tables):
            if g in st.kv_groups:
                self.k.slot_mapping(i.idx_mapping, i.num_scheduled_tokens, i.num_computed_tokens, table,
                                    self._block_sizes[g], buf.slot_mapping[g])
            else:  # a state group: no slot mapping
                buf.slot_mapping[g, : len(i.positions)] = -1
        return buf.slots(len(i.positions))

    def compute_rank_slot_mappings(self, inputs: Inputs, rank_layouts, seq_layouts) -> RankSlots:
        buf, st, i = self.buffers, self.state, inputs
        for r, lays in enumerate(rank_layouts):
            for g, table in enumerate(st.block_tables):
                lay = lays[g]
                self.k.slot_mapping_dcp(i.idx_mapping, i.num_scheduled_tokens, i.num_computed_tokens, table,
                                        lay.block_size, lay.cp_size, lay.cp_rank, lay.interleave, lay.has_slots,
                                        buf.rank_slot_mapping[r, g])
            sl = seq_layouts[r]
            self.k.dcp_local_seq_lens(i.seq_lens, sl.cp_size, sl.cp_rank, sl.interleave, buf.dcp_local_seq_lens[r])
        return buf.rank_slots(len(rank_layouts), len(i.idx_mapping), len(i.positions))

    def new_kv_cache(self, geometry: KVGeometry) -> PagedKVCache:
        return PagedKVCache(self.state.header, geometry, use_kernels=True)

    def verify_kv(self, worker: HostWorker, kv: PagedKVCache | RankedKVCache, into: KVCheckResult) -> None:
        shards = kv.shards if isinstance(kv, RankedKVCache) else [kv]
        if any(s.kernels is None for s in shards):  # a cache made elsewhere without kernels
            return host_verify_kv(worker, kv, into)
        m, st = worker.mappings(), self.state
        nc = m.num_computed_tokens.astype("int64")

        def check(i: int, shard: PagedKVCache) -> None:
            for g, lay in enumerate(worker.rank_layouts[i]):
                if g not in st.kv_groups:  # state groups hold no per-token KV
                    continue
                shard.verify_rows(g, worker.current_step, m.req_ids, m.idx_mapping, lay.readable_lo(nc), m.seq_lens,
                                  st.token_ids, st.block_tables[g], into, (lay.cp_size, lay.cp_rank, lay.interleave))

        if isinstance(kv, RankedKVCache):
            kv.verify(into, check)
        else:
            check(0, kv)


class NumbaWorker(HostWorker):
    """The default worker: the host worker with numba's array functions."""

    name = "numba"
    ops_class = NumbaOps
    numba_forward = True
