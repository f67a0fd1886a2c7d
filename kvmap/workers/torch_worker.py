"""The torch backend: the mapping phases and the KV canary as plain tensor operations on a `DeviceMirror`.

Rules:
- `TorchOps` works on the mirror's device tensors (workers/device.py); each phase function returns its slices
  of the mirror's preallocated device buffers, and `HostWorker.mappings()` copies them back (for dumps and
  checks only). It runs on CPU tensors too, for checking; `TritonWorker` (triton_worker.py) replaces the
  mapping phases with Triton kernels over the same mirror. Both are checked bit for bit against the reference.
- `slots` is the torch form of the slot rule (cp = 1, DCP and the read-back), held against `GroupLayout.slot`;
  `null_history` the torch form of Model Runner V2's sliding-window nulling (`GroupLayout.null_history_blocks`).
"""

from __future__ import annotations

import numpy as np

from kvmap._torch import torch
from kvmap.kv.cache import KVCheckResult, KVGeometry, KVMismatch, PagedKVCache, RankedKVCache
from kvmap.layout import PAD_SLOT_ID, GroupLayout
from kvmap.workers.buffers import InputBuffers
from kvmap.workers.contract import StepBatch
from kvmap.workers.device import DeviceMirror
from kvmap.workers.host import HostWorker
from kvmap.workers.mappings import BatchTables, Inputs, RankSlots
from kvmap.workers.ops import MappingOps, host_verify_kv
from kvmap.workers.state import WorkerState


def slots(table, rows, pos, lay: GroupLayout, out=None):
    """`layout.GroupLayout.slot` for tensors, the torch worker's one form of the rule (cp = 1, DCP and the
    read-back): [n] request-state rows and [n] positions -> [n] int64 slots through the row-indexed `table`
    [R, W]: the row entry at `pos // virtual_block_size`, then `* block_size` plus the local offset;
    PAD_SLOT_ID where another rank holds the token, and everywhere in a group without a slot mapping."""
    t = torch()
    if out is None:
        out = t.empty_like(pos)
    if not lay.has_slots:
        return out.fill_(PAD_SLOT_ID)
    vbs, bs = lay.virtual_block_size, lay.block_size
    t.mul(rows, table.shape[1], out=out)
    out += t.div(pos, vbs, rounding_mode="floor")
    ids = table.view(-1).index_select(0, out).to(t.int64)
    if lay.cp_size == 1:
        return t.add(ids * bs, t.remainder(pos, bs), out=out)
    I, cp = lay.interleave, lay.cp_size
    off = pos % vbs
    local = t.div(off, I, rounding_mode="floor") % cp == lay.cp_rank
    slot = ids * bs + t.div(off, I * cp, rounding_mode="floor") * I + off % I
    return out.copy_(t.where(local, slot, t.full_like(slot, PAD_SLOT_ID)))


def local_seq_lens(seq, lay: GroupLayout, out):
    """`layout.GroupLayout.dcp_local_seq_len` for tensors: (s // (cp * I)) * I + clamp(s % (cp * I) - rank * I,
    0, I)."""
    I, cp = lay.interleave, lay.cp_size
    rem = (seq % (cp * I) - lay.cp_rank * I).clamp(0, I)
    return out.copy_(torch().div(seq, cp * I, rounding_mode="floor") * I + rem)


def null_history(table, num_computed_tokens, lay: GroupLayout):
    """`layout.GroupLayout.null_history_blocks` for tensors, in place: row b of the gathered `table` [B, W] gets
    the null block 0 in its first `max(num_computed_tokens[b] - R, 0) // block_size` entries."""
    t = torch()
    n0 = t.div((num_computed_tokens.to(t.int64) - lay.num_retained_tokens).clamp_(min=0), lay.block_size,
               rounding_mode="floor")
    cols = t.arange(table.shape[1], device=table.device)
    return table.masked_fill_(cols[None, :] < n0[:, None], 0)


def device_kernel_block_tables(d: DeviceMirror, tables: BatchTables, layouts) -> list:
    """The gathered device rows expanded to kernel ids: manager id b -> b*k .. b*k+k-1 (layout.kernel_row)."""
    t = torch()
    B = tables.num_blocks.shape[1]
    out = []
    for g, lay in enumerate(layouts):
        k = lay.kernel_blocks_per_block
        rows = tables.block_tables[g]
        ar = t.arange(k, dtype=t.int32, device=rows.device)
        out.append(d.o_kernel_block_tables[g][:B])
        out[-1].copy_((rows[:, :, None] * k + ar).reshape(B, rows.shape[1] * k))
    return out


class TorchOps(MappingOps):
    """The mapping phases as plain tensor operations on the mirror's device tensors."""

    def __init__(self, state: WorkerState, buffers: InputBuffers, device: str = "cpu") -> None:
        super().__init__(state, buffers, device)
        self.mirror = DeviceMirror(state, buffers, device)
        self._prev_T = 0  # the last step's token count: slots past the actual count are padded from it

    def prepare_inputs(self, batch: StepBatch) -> Inputs:
        t, d = torch(), self.mirror
        B, T = batch.num_reqs, batch.num_tokens
        i = d.inputs(B, T)
        t.index_select(d.d_num_computed, 0, i.idx_mapping, out=i.num_computed_tokens)
        t.cumsum(i.num_scheduled_tokens, 0, out=d.o_query_start_loc[1 : B + 1])
        t.add(i.num_computed_tokens, i.num_scheduled_tokens, out=i.seq_lens)
        tr = d.t_token_req[:T]
        tr.copy_(t.repeat_interleave(d.arange[:B], i.num_scheduled_tokens, output_size=T))
        base = d.t_req[:B]
        t.sub(i.num_computed_tokens, i.query_start_loc[:B], out=base)
        t.index_select(base, 0, tr, out=i.positions)
        i.positions += d.arange[:T]
        row = d.t_row[:T]
        t.index_select(i.idx_mapping, 0, tr, out=row)
        flat = d.t_tmp[:T]
        t.mul(row, self.state.token_width, out=flat)
        flat += i.positions
        t.index_select(d.d_token_ids.view(-1), 0, flat, out=i.input_ids)
        return i

    def gather_block_tables(self, inputs: Inputs) -> BatchTables:
        t, d = torch(), self.mirror
        idx = inputs.idx_mapping
        B = len(idx)
        for g, table in enumerate(d.d_block_tables):
            t.index_select(table, 0, idx, out=d.o_block_tables[g][:B])
            t.index_select(d.d_num_blocks[g], 0, idx, out=d.o_num_blocks[g, :B])
        return d.tables(B)

    def null_history(self, tables: BatchTables, inputs: Inputs, groups: tuple[int, ...]) -> BatchTables:
        for g in groups:
            null_history(tables.block_tables[g], inputs.num_computed_tokens, self.buffers.layouts[g])
        return tables

    def compute_slot_mappings(self, inputs: Inputs) -> object:
        d = self.mirror
        T = len(inputs.positions)
        pos, row = inputs.positions, d.t_row[:T]
        for g, table in enumerate(d.d_block_tables):
            slots(table, row, pos, self.buffers.layouts[g], out=d.o_slot_mapping[g, :T])
        if self._prev_T > T:  # padding restarts at the actual count (vLLM #36580)
            d.o_slot_mapping[:, T : self._prev_T] = PAD_SLOT_ID
        self._prev_T = T
        return d.o_slot_mapping[:, :T]

    def compute_rank_slot_mappings(self, inputs: Inputs, rank_layouts, seq_layouts) -> RankSlots:
        """Every computed DCP rank's slots (`slots`), and the local lengths."""
        d = self.mirror
        B, T = len(inputs.idx_mapping), len(inputs.positions)
        pos, row = inputs.positions, d.t_row[:T]
        for g, table in enumerate(d.d_block_tables):
            for i, lays in enumerate(rank_layouts):
                slots(table, row, pos, lays[g], out=d.o_rank_slot_mapping[i, g, :T])
        for i, lay in enumerate(seq_layouts):
            local_seq_lens(inputs.seq_lens, lay, out=d.o_dcp_local_seq_lens[i, :B])
        return d.rank_slots(len(rank_layouts), B, T)

    def kernel_block_tables(self, tables: BatchTables, layouts) -> list:
        return device_kernel_block_tables(self.mirror, tables, layouts)

    def new_kv_cache(self, geometry: KVGeometry) -> PagedKVCache:
        return self.mirror.new_kv_cache(geometry)

    def write_kv(self, worker: HostWorker, kv: PagedKVCache | RankedKVCache) -> None:
        i = worker.inputs
        if isinstance(kv, RankedKVCache):
            for n, shard in enumerate(kv.shards):
                shard.write_device(i.input_ids, i.positions, worker.rank_slots.rank_slot_mapping[n], skip_pad=True)
            return
        kv.write_device(i.input_ids, i.positions, worker.slots,
                        skip_pad=len(self.state.kv_groups) < self.state.header.num_groups)

    def verify_kv(self, worker: HostWorker, kv: PagedKVCache | RankedKVCache, into: KVCheckResult) -> None:
        torch_verify_kv(worker, self.mirror, kv, into)


def host_batch(worker: HostWorker) -> tuple[np.ndarray, np.ndarray]:
    """(num_computed_tokens, seq_lens) of the batch, int64, from the host state: no device sync."""
    b = worker.batch
    nc = worker.state.num_computed_tokens[b.rows[b.order]].astype(np.int64)
    return nc, nc + b.num_scheduled_tokens[b.order]


def torch_verify_kv(worker: HostWorker, d: DeviceMirror, kv: PagedKVCache | RankedKVCache,
                    into: KVCheckResult) -> None:
    """Read back on the device; one host sync per group for the mismatch count (a check, not a step)."""
    st = worker.state
    if isinstance(kv, RankedKVCache) or len(st.kv_groups) < st.header.num_groups:
        return host_verify_kv(worker, kv, into)  # per rank, from the host mirror of the state
    t = torch()
    B = worker.batch.num_reqs
    nc_h, end_h = host_batch(worker)
    idx = worker.inputs.idx_mapping
    req_ids = worker.batch.batch_req_ids()
    for g, lay in enumerate(worker.layouts):
        lo_h = lay.readable_lo(nc_h)
        cnt_h = end_h - lo_h
        total = int(cnt_h.sum())
        if not total:
            continue
        lo = t.from_numpy(lo_h).to(idx.device)
        cnt = t.from_numpy(cnt_h).to(idx.device)
        breq = t.repeat_interleave(t.arange(B, device=idx.device), cnt, output_size=total)
        start = t.cumsum(cnt, 0) - cnt
        pos = t.arange(total, device=idx.device) - (start - lo)[breq]
        rows = idx[breq]
        slot = slots(d.d_block_tables[g], rows, pos, lay)
        toks = d.d_token_ids[rows, pos]
        bad = (kv.bits[g][:, slot] != kv.values_torch(toks, pos)).any(dim=2).any(dim=0)
        into.checked += total
        nbad = int(bad.sum())
        into.mismatches += nbad
        for i in (t.nonzero(bad)[: into.room(), 0].tolist() if nbad else ()):
            into.examples.append(KVMismatch(worker.current_step, req_ids[int(breq[i])], g, int(pos[i]),
                                            int(slot[i]), int(toks[i]), kv.describe(g, int(slot[i]))))


class TorchWorker(HostWorker):
    """State mirrored on a torch device, plain tensor operations."""

    name = "torch"
    has_h2d = True
    ops_class = TorchOps
