"""Compiled CPU kernels (numba) for the per-step mappings: the `numba` backend.

Rules: each kernel is one loop over the batch, like Model Runner V2's Triton kernels (one program per request),
reading the persistent row-indexed state through `idx_mapping` and writing into the preallocated input buffers.
No allocation, no Python per request or token; one call per phase, so the fixed cost of a step is a few
microseconds. numba compiles on first use and caches the machine code next to this file (`cache=True`), so
only the first run on a machine pays the ~3 s compile. Importing this module imports numba: import it lazily.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_jit = nb.njit(cache=True, nogil=True, boundscheck=False)


@_jit
def prepare_inputs(rows, counts, order, num_computed_tokens, token_ids,
                   idx_mapping, num_scheduled_tokens, num_computed_out, query_start_loc, seq_lens,
                   positions, input_ids):
    """Batch row b takes scheduler entry order[b]; its tokens are positions nc .. nc + n - 1. Returns T."""
    t = 0
    query_start_loc[0] = 0
    for b in range(order.shape[0]):
        j = order[b]
        row = rows[j]
        n = counts[j]
        nc = num_computed_tokens[row]
        idx_mapping[b] = row
        num_scheduled_tokens[b] = n
        num_computed_out[b] = nc
        seq_lens[b] = nc + n
        for i in range(n):
            positions[t + i] = nc + i
            input_ids[t + i] = token_ids[row, nc + i]
        t += n
        query_start_loc[b + 1] = t
    return t


@_jit
def gather_block_table(idx_mapping, num_blocks, table, out, out_num_blocks):
    """out[b, :num_blocks[row]] = table[row, :num_blocks[row]] (entries past num_blocks are left stale)."""
    for b in range(idx_mapping.shape[0]):
        row = idx_mapping[b]
        nb_ = num_blocks[row]
        out_num_blocks[b] = nb_
        for k in range(nb_):
            out[b, k] = table[row, k]


@_jit
def slot_mapping(idx_mapping, num_scheduled_tokens, num_computed_tokens, table, block_size, out):
    """slot = table[row, pos // block_size] * block_size + pos % block_size, token by token."""
    t = 0
    pow2 = (block_size & (block_size - 1)) == 0
    shift = 0
    while (1 << shift) < block_size:
        shift += 1
    mask = block_size - 1
    for b in range(idx_mapping.shape[0]):
        row = idx_mapping[b]
        nc = num_computed_tokens[b]
        n = num_scheduled_tokens[b]
        if pow2:
            for i in range(n):
                p = nc + i
                out[t + i] = (np.int64(table[row, p >> shift]) << shift) | (p & mask)
        else:
            for i in range(n):
                p = nc + i
                out[t + i] = np.int64(table[row, p // block_size]) * block_size + p % block_size
        t += n


# ------------------------------------------------------------------------------------------- KV canary
# The same hash as kv_cache.canary (numpy), one value at a time: lowbias32 of a mix of token, position, lane.
_M32 = 0xFFFFFFFF


@_jit
def _canary(token, position, lane):
    x = ((np.uint64(token) * np.uint64(0x9E3779B1)) & _M32) ^ ((np.uint64(position) * np.uint64(0x85EBCA77)) & _M32)
    x = (x + np.uint64(lane) * np.uint64(0xC2B2AE3D)) & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _M32
    x ^= x >> np.uint64(16)
    return x


@_jit
def kv_write(input_ids, positions, slots, bits, mask):
    """bits: [2, num_slots, H*D] unsigned view of the cache; lane l of K is l, of V is H*D + l."""
    half = bits.shape[2]
    for t in range(slots.shape[0]):
        s = slots[t]
        if s < 0:  # PAD_SLOT_ID
            continue
        tok = input_ids[t]
        p = positions[t]
        for l in range(half):
            bits[0, s, l] = _canary(tok, p, l) & mask
            bits[1, s, l] = _canary(tok, p, half + l) & mask


@_jit
def kv_verify(idx_mapping, lo, seq_lens, token_ids, table, block_size, bits, mask, bad):
    """Read back positions lo[b] .. seq_lens[b] - 1 of every batch request through its block-table row.
    Writes up to len(bad) mismatches as (batch_idx, position, slot) rows; returns (checked, mismatches)."""
    half = bits.shape[2]
    checked = 0
    mismatches = 0
    for b in range(idx_mapping.shape[0]):
        row = idx_mapping[b]
        for p in range(lo[b], seq_lens[b]):
            s = np.int64(table[row, p // block_size]) * block_size + p % block_size
            tok = token_ids[row, p]
            checked += 1
            for l in range(2 * half):
                kv = 0 if l < half else 1
                if bits[kv, s, l - kv * half] != (_canary(tok, p, l) & mask):
                    if mismatches < bad.shape[0]:
                        bad[mismatches, 0] = b
                        bad[mismatches, 1] = p
                        bad[mismatches, 2] = s
                    mismatches += 1
                    break
    return checked, mismatches
