"""Compiled kernels (numba) for the KV cache's occupancy after each step (run/occupancy.py): the numba form of its
per-step rules (occupancy.py keeps the numpy form), held against the brute-force references of
tests/test_kv_occupancy.py (eleven bundled traces) and tests/test_kv_occupancy_random.py (random runs).

Rules (occupancy.py's docstring says what each value means):
- `batch_kv`: a scheduled row holds `num_computed_tokens + num_scheduled_tokens` tokens of KV after the step;
  `computed` keeps the step's `num_computed_tokens` (a windowed group's readable start is measured from it).
- `group_values`: one group's `in_use` (distinct ids held), `shared` (ids held by more than one row) and, for a
  KV group, `held` per computed DCP rank, over the live rows. A windowed group (sliding_window: kind 1,
  chunked_local: kind 2) drops the blocks wholly before the readable start (`GroupLayout.readable_lo` //
  virtual block size, at most the row's blocks). The null block counts as held by no one. The ids are counted
  (shared, extra = entries that are not a distinct block) only when owners changed or the group is windowed,
  else the last count in `known` stands: a full-attention group otherwise only appends fresh blocks.
- held on a rank = the rows' stored tokens on that rank less a full block for every extra or dropped entry
  (vLLM shares and frees only full blocks).
Compiled with bounds checks (AOT_BOUNDSCHECK): the block ids come from a trace file. Importing this module imports
numba: load it through kvmap.aot.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_jit = nb.njit(cache=True, nogil=True, boundscheck=True)


@_jit
def batch_kv(rows, num_scheduled_tokens, num_computed_tokens, kv_len, computed):
    """For each scheduled row r: computed[r] = num_computed_tokens[r], kv_len[r] = that + its tokens."""
    for i in range(rows.shape[0]):
        r = rows[i]
        c = np.int64(num_computed_tokens[r])
        computed[r] = c
        kv_len[r] = c + num_scheduled_tokens[i]


@_jit
def rank_tokens(x, cp_size, cp_rank, interleave):
    """Of positions 0..x-1, those DCP rank `cp_rank` stores: interleave-sized runs dealt round robin."""
    cycle = interleave * cp_size
    part = x % cycle - cp_rank * interleave
    return (x // cycle) * interleave + min(max(part, 0), interleave)


@_jit
def _held_span(r, num_blocks, computed, kind, param, vbs):
    """(first, end) of the block-table entries row r holds: from the first block of a windowed group's readable
    start (`GroupLayout.readable_lo` // vbs, at most the row's blocks; 0 for other groups) to its blocks."""
    b = np.int64(num_blocks[r])
    if kind == 0:
        return np.int64(0), b
    c = computed[r]
    lo = max(c - param + 1, 0) if kind == 1 else c // param * param  # sliding_window, chunked_local
    return min(lo // vbs, b), b


@_jit
def _count_ids(table, num_blocks, live, computed, kind, param, vbs, null_block, counts, clear):
    """The held entries' ids counted into `counts` (saturating at 2), or put back to zero (`clear`): (shared,
    extra) = (ids held more than once, entries that are not a distinct id: repeats and the null block)."""
    shared = distinct = total = np.int64(0)
    for j in range(live.shape[0]):
        r = live[j]
        first, end = _held_span(r, num_blocks, computed, kind, param, vbs)
        for k in range(first, end):
            block = table[r, k]
            if clear:
                counts[block] = 0
                continue
            total += 1
            if block == null_block:
                continue
            seen = counts[block]
            distinct += seen == 0
            shared += seen == 1
            counts[block] = min(seen + 1, 2)
    return shared, total - distinct


@_jit
def group_values(out, col, table, num_blocks, live, kv_len, computed, kind, param, vbs, null_block, counts, known,
                 recount, ranks):
    """out[col] = in_use, out[col + 1] = shared, then out[col + 2 + k] = held on rank k for each row of `ranks`
    ([k] = block_size, cp_size, cp_rank, interleave; empty for a group without KV). known: [2] (shared, extra),
    read, and rewritten when counted. counts: [pool] uint8 scratch, all zero between calls."""
    entries = dropped = np.int64(0)
    for j in range(live.shape[0]):
        first, end = _held_span(live[j], num_blocks, computed, kind, param, vbs)
        entries += end - first
        dropped += first
    if recount or kind != 0:
        known[0], known[1] = _count_ids(table, num_blocks, live, computed, kind, param, vbs, null_block, counts,
                                        False)
        _count_ids(table, num_blocks, live, computed, kind, param, vbs, null_block, counts, True)
    extra = known[1]
    out[col] = entries - extra
    out[col + 1] = known[0]
    for k in range(ranks.shape[0]):
        block_size, cp_size, cp_rank, interleave = ranks[k, 0], ranks[k, 1], ranks[k, 2], ranks[k, 3]
        held = np.int64(0)
        for j in range(live.shape[0]):
            r = live[j]
            end = min(kv_len[r], np.int64(num_blocks[r]) * vbs)
            if cp_size > 1:
                end = rank_tokens(end, cp_size, cp_rank, interleave)
            held += end
        out[col + 2 + k] = held - (extra + dropped) * block_size


@_jit
def live_tokens(out, live, kv_len):
    """out[0] = live rows, out[1] = the KV tokens they hold, out[2] = 0 (reserve_final, filled in at the end)."""
    total = np.int64(0)
    for j in range(live.shape[0]):
        total += kv_len[live[j]]
    out[0] = live.shape[0]
    out[1] = total
    out[2] = 0


# The ahead-of-time build (kvmap/aot.py): the state's dtypes (rows, num_scheduled_tokens, num_computed_tokens,
# tables and num_blocks int32; the id-count scratch uint8; the tally's own arrays int64).
AOT_EXPORTS = {
    "batch_kv": ("batch_kv", "void(i4[::1], i4[::1], i4[::1], i8[::1], i8[::1])"),
    "group_values": ("group_values", "void(i8[::1], i8, i4[:, ::1], i4[::1], i8[::1], i8[::1], i8[::1], i8, i8, "
                                     "i8, i8, u1[::1], i8[::1], b1, i8[:, ::1])"),
    "live_tokens": ("live_tokens", "void(i8[::1], i8[::1], i8[::1])"),
}
AOT_SOURCES = ("run/occupancy_kernels.py",)
AOT_BOUNDSCHECK = True
