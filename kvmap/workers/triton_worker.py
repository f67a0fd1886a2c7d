"""Triton kernels for the per-step work, one program per request as in Model Runner V2: inputs (positions,
`seq_lens`, `input_ids`), block-table gather and Model Runner V2's sliding-window nulling of the gathered rows
(`_null_history_kernel`), slot mappings (padding with -1 from the actual token count), and the KV canary write
and read-back. `TritonOps` runs them over a `DeviceMirror` (workers/device.py), each
phase returning its slices of the mirror's buffers.

Rules: kernels read the persistent row-indexed state through `idx_mapping` and write preallocated buffers;
`query_start_loc` comes from one `torch.cumsum` on the device; nothing syncs the host except the KV check,
which must return a count. On a machine without a GPU they run on CPU tensors under the Triton interpreter:
`TRITON_INTERPRET=1` must be set before this module is imported (about 2 ms a program: tiny traces only).
"""

from __future__ import annotations

import triton
import triton.language as tl

import numpy as np

from kvmap._torch import torch
from kvmap.kv import canary as C
from kvmap.kv.cache import KVCheckResult, KVGeometry, KVMismatch, PagedKVCache, RankedKVCache
from kvmap.layout import PAD_SLOT_ID
from kvmap.workers.buffers import InputBuffers
from kvmap.workers.contract import StepBatch
from kvmap.workers.device import DeviceMirror
from kvmap.workers.host import HostWorker
from kvmap.workers.mappings import BatchTables, Inputs, RankSlots
from kvmap.workers.ops import MappingOps
from kvmap.workers.state import WorkerState
from kvmap.workers.torch_worker import device_kernel_block_tables, host_batch, local_seq_lens, torch_verify_kv

BLOCK = 128  # tokens per loop iteration of a program


@triton.jit
def _prepare_inputs_kernel(idx_ptr, n_ptr, qsl_ptr, num_computed_ptr, token_ids_ptr, token_stride,
                           nc_out_ptr, seq_lens_ptr, positions_ptr, input_ids_ptr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(idx_ptr + b)
    n = tl.load(n_ptr + b)
    start = tl.load(qsl_ptr + b)
    nc = tl.load(num_computed_ptr + row)
    tl.store(nc_out_ptr + b, nc)
    tl.store(seq_lens_ptr + b, nc + n)
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        mask = offs < n
        pos = nc + offs
        tl.store(positions_ptr + start + offs, pos.to(tl.int64), mask=mask)
        tok = tl.load(token_ids_ptr + row * token_stride + pos, mask=mask, other=0)
        tl.store(input_ids_ptr + start + offs, tok, mask=mask)


@triton.jit
def _gather_block_table_kernel(idx_ptr, num_blocks_ptr, table_ptr, table_stride, out_ptr, out_stride,
                               out_num_blocks_ptr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(idx_ptr + b)
    nb = tl.load(num_blocks_ptr + row)
    tl.store(out_num_blocks_ptr + b, nb)
    for k in range(0, nb, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < nb
        v = tl.load(table_ptr + row * table_stride + offs, mask=mask, other=0)
        tl.store(out_ptr + b * out_stride + offs, v, mask=mask)


@triton.jit
def _null_history_kernel(nc_ptr, out_ptr, out_stride, num_retained_tokens, block_size, BLOCK: tl.constexpr):
    """Program b: Model Runner V2's sliding-window rule on gathered row b, the null block 0 in its first
    `max(nc - R, 0) // block_size` entries (`GroupLayout.null_history_blocks`; R = num_retained_tokens > 0)."""
    b = tl.program_id(0)
    nc = tl.load(nc_ptr + b)
    n0 = tl.maximum(nc - num_retained_tokens, 0) // block_size
    for k in range(0, n0, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        tl.store(out_ptr + b * out_stride + offs, tl.zeros((BLOCK,), tl.int32), mask=offs < n0)


@triton.jit
def _store_pad_slots(out_ptr, num_tokens, pad_end, BLOCK: tl.constexpr):
    """out[num_tokens:pad_end] = PAD_SLOT_ID: the slot mapping kernels' extra program."""
    for i in range(num_tokens, pad_end, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.full((BLOCK,), -1, tl.int64), mask=offs < pad_end)


@triton.jit
def _slots(table_ptr, row, table_stride, pos, mask, block_size, cp_size, cp_rank, interleave, CP: tl.constexpr):
    """`layout.GroupLayout.slot` of a block of int64 positions of request-state row `row`: the Triton kernels'
    one form of the rule. CP false (cp = 1): row[pos // bs] * bs + pos % bs. CP true, as vLLM's
    `_compute_slot_mappings_kernel`: the row entry at pos // (bs * cp), the rank-local offset, and
    PAD_SLOT_ID where another rank holds the token."""
    if CP:
        vbs = block_size * cp_size
        blk = tl.load(table_ptr + row * table_stride + pos // vbs, mask=mask, other=0)
        off = pos % vbs
        local = (off // interleave) % cp_size == cp_rank
        slot = blk.to(tl.int64) * block_size + (off // (interleave * cp_size)) * interleave + off % interleave
        slot = tl.where(local, slot, -1)
    else:
        blk = tl.load(table_ptr + row * table_stride + pos // block_size, mask=mask, other=0)
        slot = blk.to(tl.int64) * block_size + pos % block_size
    return slot


@triton.jit
def _slot_mapping_kernel(idx_ptr, n_ptr, qsl_ptr, nc_ptr, table_ptr, table_stride, block_size, cp_size, cp_rank,
                         interleave, out_ptr, num_reqs, num_tokens, pad_end, CP: tl.constexpr, BLOCK: tl.constexpr):
    """Program b: request b's slots (`_slots`, CP a compile-time branch); the extra program b == num_reqs pads
    from the actual token count."""
    b = tl.program_id(0)
    if b == num_reqs:  # the extra program: PAD_SLOT_ID from the actual token count (vLLM #36580)
        _store_pad_slots(out_ptr, num_tokens, pad_end, BLOCK)
    else:
        row = tl.load(idx_ptr + b)
        n = tl.load(n_ptr + b)
        start = tl.load(qsl_ptr + b)
        nc = tl.load(nc_ptr + b)
        for i in range(0, n, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            mask = offs < n
            pos = (nc + offs).to(tl.int64)
            slot = _slots(table_ptr, row, table_stride, pos, mask, block_size, cp_size, cp_rank, interleave, CP)
            tl.store(out_ptr + start + offs, slot, mask=mask)


# kv/canary.py's constants, as compile-time constants of the kernels
_MUL_TOKEN = tl.constexpr(C.MUL_TOKEN)
_MUL_POSITION = tl.constexpr(C.MUL_POSITION)
_MUL_LANE = tl.constexpr(C.MUL_LANE)
_MIX_1 = tl.constexpr(C.MIX_1)
_MIX_2 = tl.constexpr(C.MIX_2)
_MASK_32 = tl.constexpr(C.MASK_32)


@triton.jit
def _canary(tok, pos, lane):
    """kv.canary.canary_value in int64 arithmetic: products wrap mod 2**64, which keeps the low 32 bits exact."""
    m = _MASK_32
    x = ((tok.to(tl.int64) * _MUL_TOKEN) & m) ^ ((pos.to(tl.int64) * _MUL_POSITION) & m)
    x = (x + lane.to(tl.int64) * _MUL_LANE) & m
    x = x ^ (x >> 16)
    x = (x * _MIX_1) & m
    x = x ^ (x >> 15)
    x = (x * _MIX_2) & m
    x = x ^ (x >> 16)
    return x


@triton.jit
def _signed_bits(x, WIDTH: tl.constexpr):
    half = 1 << (WIDTH - 1)
    return ((x + half) & ((1 << WIDTH) - 1)) - half


@triton.jit
def _kv_write_kernel(input_ids_ptr, positions_ptr, slots_ptr, qsl_ptr, bits_ptr, plane, HALF: tl.constexpr,
                     LANES: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Program b writes the K and V canaries of request b's tokens; slots < 0 are padding and skipped."""
    b = tl.program_id(0)
    start = tl.load(qsl_ptr + b)
    end = tl.load(qsl_ptr + b + 1)
    lanes = tl.arange(0, LANES)
    lmask = lanes < HALF
    for i in range(start, end, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        tmask = offs < end
        tok = tl.load(input_ids_ptr + offs, mask=tmask, other=0)
        pos = tl.load(positions_ptr + offs, mask=tmask, other=0)
        slot = tl.load(slots_ptr + offs, mask=tmask, other=-1)
        ok = tmask & (slot >= 0)
        m2 = ok[:, None] & lmask[None, :]
        addr = slot[:, None] * HALF + lanes[None, :]
        k = _signed_bits(_canary(tok[:, None], pos[:, None], lanes[None, :]), WIDTH)
        v = _signed_bits(_canary(tok[:, None], pos[:, None], HALF + lanes[None, :]), WIDTH)
        tl.store(bits_ptr + addr, k.to(bits_ptr.dtype.element_ty), mask=m2)
        tl.store(bits_ptr + plane + addr, v.to(bits_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _kv_verify_kernel(idx_ptr, lo_ptr, seq_lens_ptr, token_ids_ptr, token_stride, table_ptr, table_stride,
                      block_size, bits_ptr, plane, bad_ptr, first_bad_ptr, HALF: tl.constexpr,
                      LANES: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Program b reads back positions lo[b] .. seq_lens[b] - 1 through the block table; counts mismatches
    and keeps the first bad position."""
    b = tl.program_id(0)
    row = tl.load(idx_ptr + b)
    lo = tl.load(lo_ptr + b)
    hi = tl.load(seq_lens_ptr + b)
    lanes = tl.arange(0, LANES)
    lmask = lanes < HALF
    bad = 0
    first = 1 << 40
    for p0 in range(lo, hi, BLOCK):
        pos = (p0 + tl.arange(0, BLOCK)).to(tl.int64)
        pmask = pos < hi
        slot = _slots(table_ptr, row, table_stride, pos, pmask, block_size, 1, 0, 1, False)
        tok = tl.load(token_ids_ptr + row * token_stride + pos, mask=pmask, other=0)
        m2 = pmask[:, None] & lmask[None, :]
        addr = slot[:, None] * HALF + lanes[None, :]
        gk = tl.load(bits_ptr + addr, mask=m2, other=0).to(tl.int64)
        gv = tl.load(bits_ptr + plane + addr, mask=m2, other=0).to(tl.int64)
        wk = _signed_bits(_canary(tok[:, None], pos[:, None], lanes[None, :]), WIDTH)
        wv = _signed_bits(_canary(tok[:, None], pos[:, None], HALF + lanes[None, :]), WIDTH)
        diff = (((gk != wk) | (gv != wv)) & m2).to(tl.int32)
        row_bad = tl.max(diff, axis=1) > 0
        bad += tl.sum(row_bad.to(tl.int32), axis=0)
        first = tl.minimum(first, tl.min(tl.where(row_bad, pos, 1 << 40), axis=0))
    tl.store(bad_ptr + b, bad)
    tl.store(first_bad_ptr + b, first)


class TritonOps(MappingOps):
    """The mapping phases and the KV canary as Triton kernels over the mirror's device tensors."""

    def __init__(self, state: WorkerState, buffers: InputBuffers, device: str = "cpu") -> None:
        super().__init__(state, buffers, device)
        self.mirror = DeviceMirror(state, buffers, device)
        self._prev_T = 0  # the last step's token count: slots past the actual count are padded from it

    def prepare_inputs(self, batch: StepBatch) -> Inputs:
        t, d = torch(), self.mirror
        B = batch.num_reqs
        i = d.inputs(B, batch.num_tokens)
        t.cumsum(i.num_scheduled_tokens, 0, out=d.o_query_start_loc[1 : B + 1])
        if B:
            _prepare_inputs_kernel[(B,)](d.o_idx_mapping, d.o_num_scheduled, d.o_query_start_loc, d.d_num_computed,
                                         d.d_token_ids, d.d_token_ids.stride(0), d.o_num_computed, d.o_seq_lens,
                                         d.o_positions, d.o_input_ids, BLOCK=BLOCK)
        return i

    def gather_block_tables(self, inputs: Inputs) -> BatchTables:
        d = self.mirror
        B = len(inputs.idx_mapping)
        for g, table in enumerate(d.d_block_tables) if B else ():
            out = d.o_block_tables[g]
            _gather_block_table_kernel[(B,)](d.o_idx_mapping, d.d_num_blocks[g], table, table.stride(0), out,
                                             out.stride(0), d.o_num_blocks[g], BLOCK=BLOCK)
        return d.tables(B)

    def null_history(self, tables: BatchTables, inputs: Inputs, groups: tuple[int, ...]) -> BatchTables:
        B = len(inputs.idx_mapping)
        for g in groups if B else ():
            lay, out = self.buffers.layouts[g], tables.block_tables[g]
            _null_history_kernel[(B,)](inputs.num_computed_tokens, out, out.stride(0), lay.num_retained_tokens,
                                       lay.block_size, BLOCK=BLOCK)
        return tables

    def kernel_block_tables(self, tables: BatchTables, layouts) -> list:
        return device_kernel_block_tables(self.mirror, tables, layouts)

    def compute_slot_mappings(self, inputs: Inputs) -> object:
        d = self.mirror
        B, T = len(inputs.idx_mapping), len(inputs.positions)
        if len(self.state.kv_groups) < self.state.header.num_groups:  # a state group needs -1: per group
            self._slot_mappings(d.o_slot_mapping[None], [self.buffers.layouts], B, T)
            return d.o_slot_mapping[:, :T]
        pad_end = max(self._prev_T, T)
        for g, table in enumerate(d.d_block_tables):
            _slot_mapping_kernel[(B + 1,)](d.o_idx_mapping, d.o_num_scheduled, d.o_query_start_loc, d.o_num_computed,
                                           table, table.stride(0), self.buffers.layouts[g].block_size, 1, 0, 1,
                                           d.o_slot_mapping[g], B, T, pad_end, CP=False, BLOCK=BLOCK)
        self._prev_T = T
        return d.o_slot_mapping[:, :T]

    def compute_rank_slot_mappings(self, inputs: Inputs, rank_layouts, seq_layouts) -> RankSlots:
        d = self.mirror
        B, T = len(inputs.idx_mapping), len(inputs.positions)
        self._slot_mappings(d.o_rank_slot_mapping, rank_layouts, B, T)
        for i, lay in enumerate(seq_layouts):
            local_seq_lens(inputs.seq_lens, lay, out=d.o_dcp_local_seq_lens[i, :B])
        return d.rank_slots(len(rank_layouts), B, T)

    def _slot_mappings(self, out, rank_layouts, B: int, T: int) -> None:
        """Every computed rank's slots into out [num_ranks, G, T_max] (CP a compile-time branch), group by group;
        a group without a slot mapping is PAD_SLOT_ID up to the padded end."""
        d = self.mirror
        pad_end = max(self._prev_T, T)
        for i, lays in enumerate(rank_layouts):
            for g, table in enumerate(d.d_block_tables):
                lay = lays[g]
                if not lay.has_slots:
                    out[i, g, :pad_end].fill_(PAD_SLOT_ID)
                    continue
                _slot_mapping_kernel[(B + 1,)](d.o_idx_mapping, d.o_num_scheduled, d.o_query_start_loc,
                                               d.o_num_computed, table, table.stride(0), lay.block_size,
                                               lay.cp_size, lay.cp_rank, lay.interleave, out[i, g], B, T, pad_end,
                                               CP=lay.cp_size > 1, BLOCK=BLOCK)
        self._prev_T = T

    def new_kv_cache(self, geometry: KVGeometry) -> PagedKVCache:
        return self.mirror.new_kv_cache(geometry)

    def write_kv(self, worker: HostWorker, kv: PagedKVCache | RankedKVCache) -> None:
        d = self.mirror
        B = worker.batch.num_reqs
        if not B:
            return
        shards = kv.shards if isinstance(kv, RankedKVCache) else [kv]
        for i, shard in enumerate(shards):
            half = shard.geometry.lanes // 2
            slots = d.o_rank_slot_mapping[i] if isinstance(kv, RankedKVCache) else d.o_slot_mapping
            for g, bits in enumerate(shard.bits):
                if bits.shape[1] == 0:  # a state group holds no per-token KV
                    continue
                _kv_write_kernel[(B,)](d.o_input_ids, d.o_positions, slots[g], d.o_query_start_loc,
                                       bits, bits.stride(0), HALF=half, LANES=triton.next_power_of_2(half),
                                       WIDTH=8 * bits.element_size(), BLOCK=32)

    def verify_kv(self, worker: HostWorker, kv: PagedKVCache | RankedKVCache, into: KVCheckResult) -> None:
        st, d = self.state, self.mirror
        if isinstance(kv, RankedKVCache) or len(st.kv_groups) < st.header.num_groups:
            return torch_verify_kv(worker, d, kv, into)
        t = torch()
        B = worker.batch.num_reqs
        if not B:
            return
        step, req_ids, res = worker.current_step, worker.batch.batch_req_ids(), into
        half = kv.geometry.lanes // 2
        nc_h, seq_h = host_batch(worker)
        bad = t.zeros(B, dtype=t.int32, device=d.device)
        first = t.zeros(B, dtype=t.int64, device=d.device)
        for g, lay in enumerate(worker.layouts):
            lo_h = lay.readable_lo(nc_h)
            lo = t.from_numpy(lo_h).to(d.device)
            table, bits = d.d_block_tables[g], kv.bits[g]
            _kv_verify_kernel[(B,)](d.o_idx_mapping, lo, d.o_seq_lens, d.d_token_ids, d.d_token_ids.stride(0), table,
                                    table.stride(0), lay.block_size, bits, bits.stride(0), bad, first, HALF=half,
                                    LANES=triton.next_power_of_2(half), WIDTH=8 * bits.element_size(), BLOCK=32)
            res.checked += int((seq_h - lo_h).sum())
            bad_h = bad.cpu().numpy()
            res.mismatches += int(bad_h.sum())
            if bad_h.any():
                first_h = first.cpu().numpy()
                for b in np.flatnonzero(bad_h)[: res.room()]:
                    row = int(st.req_id_to_index[req_ids[b]])
                    p = int(first_h[b])
                    slot = lay.slot(st.block_tables[g][row], p)
                    res.examples.append(KVMismatch(step, req_ids[b], g, p, slot, int(st.token_ids[row, p]),
                                                   kv.describe(g, slot)))


class TritonWorker(HostWorker):
    """State mirrored on a torch device, the mapping phases and the KV canary as Triton kernels."""

    name = "triton"
    has_h2d = True
    ops_class = TritonOps


__all__ = ["TritonWorker", "PAD_SLOT_ID"]
