"""Compiled CPU kernels (numba) for the KV canary: write one step's tokens through `slot_mapping`, read a
batch's readable context back through its block-table rows.

Rules: the canary is `kv.canary.canary_value` (its constants, tested bit for bit); `PAD_SLOT_ID` slots are
skipped. `slot_of` is the slot rule's one numba form (cp = 1 and DCP), used here by the read-back and by the
slot mapping kernels (workers/kernels_cpu.py); tests/test_layout.py holds it to `GroupLayout.slot`. Compiled
without numba's bounds checks, guarded as workers/kernels_cpu.py's kernels are: each kernel checks its indices'
ranges per call, row and slot and raises IndexError (`slot_of` reads `row[p // (block_size * cp)]`: its callers
check that). Importing this module imports numba: import it lazily.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvmap.kv.canary import MASK_32 as _M32
from kvmap.kv.canary import MIX_1, MIX_2, MUL_LANE, MUL_POSITION, MUL_TOKEN

_jit = nb.njit(cache=True, nogil=True, boundscheck=False)


@_jit
def canary(token, position, lane):
    """`canary.canary_value` in uint64 arithmetic (products masked to 32 bits, as the spec)."""
    x = ((np.uint64(token) * np.uint64(MUL_TOKEN)) & _M32) ^ ((np.uint64(position) * np.uint64(MUL_POSITION)) & _M32)
    x = (x + np.uint64(lane) * np.uint64(MUL_LANE)) & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(MIX_1)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(MIX_2)) & _M32
    x ^= x >> np.uint64(16)
    return x


@nb.njit(cache=True, nogil=True, boundscheck=False, inline="always")  # inlined: cp = 1 callers' constants fold
def slot_of(row, p, block_size, cp_size, cp_rank, interleave):
    """`layout.GroupLayout.slot` of position p through block-table row `row`: virtual block vb = p // (block_size
    * cp), offset off = p % that; local iff (off // I) % cp == rank, then slot = row[vb] * block_size
    + off // (I * cp) * I + off % I, else -1 (PAD_SLOT_ID). cp = 1, I = 1: row[p // bs] * bs + p % bs."""
    vbs = np.int64(block_size) * cp_size
    vb = p // vbs
    off = p - vb * vbs
    if (off // interleave) % cp_size != cp_rank:
        return np.int64(-1)
    return np.int64(row[vb]) * block_size + off // (interleave * cp_size) * interleave + off % interleave


@_jit
def kv_write(input_ids, positions, slots, bits, mask, written):
    """bits: [2, num_slots, H*D] unsigned view of the cache; lane l of K is l, of V is H*D + l.
    written: [num_slots] bool, set for every slot written."""
    half = bits.shape[2]
    if min(input_ids.shape[0], positions.shape[0]) < slots.shape[0] or bits.shape[0] < 2:
        raise IndexError("kv_write: fewer tokens than slots, or a cache without both K and V")
    num_slots = min(bits.shape[1], written.shape[0])
    for t in range(slots.shape[0]):
        s = slots[t]
        if s < 0:  # PAD_SLOT_ID
            continue
        if s >= num_slots:
            raise IndexError("kv_write: a slot past the cache")
        written[s] = True
        tok = input_ids[t]
        p = positions[t]
        for l in range(half):
            bits[0, s, l] = canary(tok, p, l) & mask
            bits[1, s, l] = canary(tok, p, half + l) & mask


@_jit
def kv_verify_dcp(idx_mapping, lo, seq_lens, token_ids, table, block_size, cp_size, cp_rank, interleave, bits,
                  mask, bad):
    """Read back positions lo[b] .. seq_lens[b] - 1 of every batch request that this DCP rank holds (all of them
    when cp = 1), at `slot_of` through its block-table row. Writes up to len(bad) mismatches as (batch_idx,
    position, slot) rows; returns (checked, mismatches)."""
    half = bits.shape[2]
    if min(lo.shape[0], seq_lens.shape[0]) < idx_mapping.shape[0] or bad.shape[1] < 3 or bits.shape[0] < 2 \
            or block_size < 1 or cp_size < 1 or interleave < 1:
        raise IndexError("kv_verify_dcp: bounds shorter than the batch, a cache without both K and V, or a bad layout")
    span = np.int64(table.shape[1]) * block_size * cp_size  # positions a table row holds
    checked = 0
    mismatches = 0
    for b in range(idx_mapping.shape[0]):
        row = idx_mapping[b]
        if row < 0 or row >= min(table.shape[0], token_ids.shape[0]) or lo[b] < 0 \
                or seq_lens[b] > min(token_ids.shape[1], span):
            raise IndexError("kv_verify_dcp: a row outside the state, or positions past its table row")
        trow = table[row]
        for p in range(lo[b], seq_lens[b]):
            s = slot_of(trow, p, block_size, cp_size, cp_rank, interleave)
            if s < 0:  # another rank holds this token
                continue
            if s >= bits.shape[1]:
                raise IndexError("kv_verify_dcp: a slot past the cache")
            tok = token_ids[row, p]
            checked += 1
            for l in range(2 * half):
                kv = 0 if l < half else 1
                if bits[kv, s, l - kv * half] != (canary(tok, p, l) & mask):
                    if mismatches < bad.shape[0]:
                        bad[mismatches, 0] = b
                        bad[mismatches, 1] = p
                        bad[mismatches, 2] = s
                    mismatches += 1
                    break
    return checked, mismatches


# The ahead-of-time build (kvmap/aot.py, at install): exported name -> (kernel, signature), one variant per
# unsigned view of the cache's dtype (u1: fp8, u2: bf16/fp16, u4: fp32), picked once by the cache.
AOT_EXPORTS = {
    "kv_write_u1": ("kv_write", "void(i4[::1], i8[::1], i8[::1], u1[:, :, ::1], u8, b1[::1])"),
    "kv_write_u2": ("kv_write", "void(i4[::1], i8[::1], i8[::1], u2[:, :, ::1], u8, b1[::1])"),
    "kv_write_u4": ("kv_write", "void(i4[::1], i8[::1], i8[::1], u4[:, :, ::1], u8, b1[::1])"),
    "kv_verify_dcp_u1": ("kv_verify_dcp", "UniTuple(i8, 2)(i4[::1], i8[::1], i4[::1], i4[:, ::1], i4[:,"
                              " ::1], i8, i8, i8, i8, u1[:, :, ::1], u8, i8[:, ::1])"),
    "kv_verify_dcp_u2": ("kv_verify_dcp", "UniTuple(i8, 2)(i4[::1], i8[::1], i4[::1], i4[:, ::1], i4[:,"
                              " ::1], i8, i8, i8, i8, u2[:, :, ::1], u8, i8[:, ::1])"),
    "kv_verify_dcp_u4": ("kv_verify_dcp", "UniTuple(i8, 2)(i4[::1], i8[::1], i4[::1], i4[:, ::1], i4[:,"
                              " ::1], i8, i8, i8, i8, u4[:, :, ::1], u8, i8[:, ::1])"),
}
AOT_SOURCES = ("kv/kernels.py", "kv/canary.py")
