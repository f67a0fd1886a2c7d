"""Triton kernels for the per-step work, one program per request as in Model Runner V2: inputs (positions,
`seq_lens`, `input_ids`), block-table gather, slot mappings (padding with -1 from the actual token count), and
the KV canary write and read-back. `TritonWorker` runs them over `TorchWorker`'s device state.

Rules: kernels read the persistent row-indexed state through `idx_mapping` and write preallocated buffers;
`query_start_loc` comes from one `torch.cumsum` on the device; nothing syncs the host except the KV check,
which must return a count. On a machine without a GPU they run on CPU tensors under the Triton interpreter:
`TRITON_INTERPRET=1` must be set before this module is imported (about 2 ms a program: tiny traces only).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvmap._torch import torch
from kvmap.batch import PAD_SLOT_ID
from kvmap.device import TorchWorker
from kvmap.kv_cache import KVCheckResult, KVMismatch
from kvmap.reference import readable_lo

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
def _slot_mapping_kernel(idx_ptr, n_ptr, qsl_ptr, nc_ptr, table_ptr, table_stride, block_size, out_ptr,
                         num_reqs, num_tokens, pad_end, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    if b == num_reqs:  # the extra program: PAD_SLOT_ID from the actual token count (vLLM #36580)
        for i in range(num_tokens, pad_end, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            tl.store(out_ptr + offs, tl.full((BLOCK,), -1, tl.int64), mask=offs < pad_end)
    else:
        row = tl.load(idx_ptr + b)
        n = tl.load(n_ptr + b)
        start = tl.load(qsl_ptr + b)
        nc = tl.load(nc_ptr + b)
        for i in range(0, n, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            mask = offs < n
            pos = (nc + offs).to(tl.int64)
            blk = tl.load(table_ptr + row * table_stride + pos // block_size, mask=mask, other=0)
            tl.store(out_ptr + start + offs, blk.to(tl.int64) * block_size + pos % block_size, mask=mask)


@triton.jit
def _canary(tok, pos, lane):
    """kv_cache.canary in int64 arithmetic: products wrap mod 2**64, which keeps the low 32 bits exact."""
    m = 0xFFFFFFFF
    x = ((tok.to(tl.int64) * 0x9E3779B1) & m) ^ ((pos.to(tl.int64) * 0x85EBCA77) & m)
    x = (x + lane.to(tl.int64) * 0xC2B2AE3D) & m
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & m
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & m
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
        blk = tl.load(table_ptr + row * table_stride + pos // block_size, mask=pmask, other=0)
        slot = blk.to(tl.int64) * block_size + pos % block_size
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


class TritonWorker(TorchWorker):
    """TorchWorker with the mapping phases and the KV canary as Triton kernels."""

    name = "triton"

    def prepare_inputs(self) -> None:
        t = torch()
        B, T = self._host_B, self._host_T
        qsl = self.o_query_start_loc
        t.cumsum(self.o_num_scheduled[:B], 0, out=qsl[1 : B + 1])
        if B:
            _prepare_inputs_kernel[(B,)](self.o_idx_mapping, self.o_num_scheduled, qsl, self.d_num_computed,
                                         self.d_token_ids, self.d_token_ids.stride(0), self.o_num_computed,
                                         self.o_seq_lens, self.o_positions, self.o_input_ids, BLOCK=BLOCK)
        self._B, self._T = B, T

    def gather_block_tables(self) -> None:
        B = self._B
        if not B:
            return
        for g, table in enumerate(self.d_block_tables):
            out = self.o_block_tables[g]
            _gather_block_table_kernel[(B,)](self.o_idx_mapping, self.d_num_blocks[g], table, table.stride(0), out,
                                             out.stride(0), self.o_num_blocks[g], BLOCK=BLOCK)

    def compute_slot_mappings(self) -> None:
        B, T = self._B, self._T
        pad_end = max(self._prev_T, T)
        for g, table in enumerate(self.d_block_tables):
            _slot_mapping_kernel[(B + 1,)](self.o_idx_mapping, self.o_num_scheduled, self.o_query_start_loc,
                                           self.o_num_computed, table, table.stride(0), self.state.block_sizes[g],
                                           self.o_slot_mapping[g], B, T, pad_end, BLOCK=BLOCK)
        self._prev_T = T

    # ------------------------------------------------------------------ KV canary

    def write_kv(self, kv) -> None:
        B = self._B
        if not B:
            return
        half = kv.geometry.lanes // 2
        for g, bits in enumerate(kv.torch_bits()):
            _kv_write_kernel[(B,)](self.o_input_ids, self.o_positions, self.o_slot_mapping[g], self.o_query_start_loc,
                                   bits, bits.stride(0), HALF=half, LANES=triton.next_power_of_2(half),
                                   WIDTH=8 * bits.element_size(), BLOCK=32)

    def verify_kv(self, kv, step: int, req_ids: list[str], res: KVCheckResult, max_examples: int) -> KVCheckResult:
        t = torch()
        import numpy as np

        B = self._B
        if not B:
            return res
        half = kv.geometry.lanes // 2
        nc_h, seq_h = self.host_batch()
        bad = t.zeros(B, dtype=t.int32, device=self.device)
        first = t.zeros(B, dtype=t.int64, device=self.device)
        for g, grp in enumerate(self.header.kv_cache_groups):
            lo_h = readable_lo(grp, nc_h)
            lo = t.from_numpy(lo_h).to(self.device)
            table, bits = self.d_block_tables[g], kv.torch_bits()[g]
            _kv_verify_kernel[(B,)](self.o_idx_mapping, lo, self.o_seq_lens, self.d_token_ids,
                                    self.d_token_ids.stride(0), table, table.stride(0), grp.block_size, bits,
                                    bits.stride(0), bad, first, HALF=half, LANES=triton.next_power_of_2(half),
                                    WIDTH=8 * bits.element_size(), BLOCK=32)
            res.checked += int((seq_h - lo_h).sum())
            bad_h = bad.cpu().numpy()
            res.mismatches += int(bad_h.sum())
            if bad_h.any():
                first_h = first.cpu().numpy()
                bs = grp.block_size
                for b in np.flatnonzero(bad_h)[: max(max_examples - len(res.examples), 0)]:
                    row = int(self.state.req_id_to_index[req_ids[b]])
                    p = int(first_h[b])
                    slot = int(self.state.block_tables[g][row, p // bs]) * bs + p % bs
                    res.examples.append(KVMismatch(step, req_ids[b], g, p, slot, int(self.state.token_ids[row, p]),
                                                   "bits of another token or position (or never written)"))
        return res


__all__ = ["TritonWorker", "PAD_SLOT_ID"]
