"""The compiled host worker (`numba`, the default): the numpy worker's state and buffers, with the batch
order, the mapping phases, the hot state updates and the KV canary paths as numba kernels.

Rules: one kernel call per phase and group (workers/kernels_cpu.py, kv/kernels.py); the KV cache it makes
writes and reads back through the compiled kernels, so `--backend numpy` times no compiled code. The kernels
come from `kvmap.aot.load`: the ahead-of-time twin built at install (no numba import), or numba's JIT.
"""

from __future__ import annotations

from kvmap.kv.cache import KVCheckResult, KVGeometry, PagedKVCache, RankedKVCache
from kvmap.aot import load
from kvmap.trace import TraceHeader
from kvmap.workers.contract import make_rank_caches
from kvmap.workers.host import HostWorker
from kvmap.workers.state_ops import CompiledOps


class NumbaWorker(HostWorker):
    name = "numba"

    def __init__(self, header: TraceHeader, device: str = "cpu") -> None:
        super().__init__(header, device)
        self.k = load("kvmap.workers.kernels_cpu")
        self.backend_detail = ("kernels compiled ahead of time" if self.k.kind == "ahead-of-time"
                               else "kernels under numba's JIT, cached")
        self.state.ops = CompiledOps(self.state.writes)

    def sort_batch(self) -> None:
        b, buf = self.batch, self.buffers
        n = self.k.batch_order(b.num_scheduled_tokens, b.num_draft_tokens, self.header.num_speculative_tokens,
                               buf.order, buf.sort_keys, buf.sort_tmp)
        b.order = buf.order[:n]

    def prepare_inputs(self) -> None:
        b, buf, st = self.batch, self.buffers, self.state
        b.num_tokens = self.k.prepare_inputs(b.rows, b.num_scheduled_tokens, b.order, st.num_computed_tokens,
                                             st.token_ids, buf.idx_mapping, buf.num_scheduled_tokens,
                                             buf.num_computed_tokens, buf.query_start_loc, buf.seq_lens,
                                             buf.positions, buf.input_ids)

    def gather_block_tables(self) -> None:
        buf, st = self.buffers, self.state
        idx = buf.idx_mapping[: self.batch.num_reqs]
        for g, table in enumerate(st.block_tables):
            self.k.gather_block_table(idx, st.num_blocks[g], table, buf.block_tables[g], buf.num_blocks[g])
        if self.kernel_split:
            self.multirank_block_tables()

    def compute_slot_mappings(self) -> None:
        buf, st = self.buffers, self.state
        n = self.batch.num_reqs
        idx, ns, nc = buf.idx_mapping[:n], buf.num_scheduled_tokens[:n], buf.num_computed_tokens[:n]
        if self.multirank:
            return self._rank_slot_mappings(idx, ns, nc, n)
        for g, table in enumerate(st.block_tables):
            if g in st.kv_groups:
                self.k.slot_mapping(idx, ns, nc, table, self.layouts[g].block_size, buf.slot_mapping[g])
            else:  # a state group: no slot mapping
                buf.slot_mapping[g, : self.batch.num_tokens] = -1

    def _rank_slot_mappings(self, idx, ns, nc, n) -> None:
        buf, st = self.buffers, self.state
        for i, lays in enumerate(self.rank_layouts):
            for g, table in enumerate(st.block_tables):
                lay = lays[g]
                self.k.slot_mapping_dcp(idx, ns, nc, table, lay.block_size, lay.cp_size, lay.cp_rank,
                                        lay.interleave, lay.has_slots, buf.rank_slot_mapping[i, g])
            self.k.dcp_local_seq_lens(buf.seq_lens[:n], self.seq_layouts[i].cp_size, self.seq_layouts[i].cp_rank,
                                      self.seq_layouts[i].interleave, buf.dcp_local_seq_lens[i])

    def make_kv_cache(self, geometry: KVGeometry) -> PagedKVCache:
        return make_rank_caches(self, geometry, lambda g: PagedKVCache(self.header, g, use_kernels=True))

    def verify_kv(self, kv: PagedKVCache | RankedKVCache, into: KVCheckResult) -> None:
        shards = kv.shards if isinstance(kv, RankedKVCache) else [kv]
        if any(s.kernels is None for s in shards):  # a cache made elsewhere without kernels
            return super().verify_kv(kv, into)
        m, st = self.mappings(), self.state
        nc = m.num_computed_tokens.astype("int64")

        def check(i: int, shard: PagedKVCache) -> None:
            for g, lay in enumerate(self.rank_layouts[i]):
                if g not in st.kv_groups:  # state groups hold no per-token KV
                    continue
                shard.verify_rows(g, self.current_step, m.req_ids, m.idx_mapping, lay.readable_lo(nc), m.seq_lens,
                                  st.token_ids, st.block_tables[g], into, (lay.cp_size, lay.cp_rank, lay.interleave))

        if isinstance(kv, RankedKVCache):
            kv.verify(into, check)
        else:
            check(0, kv)
