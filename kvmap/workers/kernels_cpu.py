"""Compiled CPU kernels (numba) for the per-step mappings and the hot state updates: the `numba` backend.

Rules:
- Each kernel is one loop over the batch, like Model Runner V2's Triton kernels (one program per request),
  reading the persistent row-indexed state through `idx_mapping` and writing into the preallocated input
  buffers. No allocation, no Python per request or token; one call per phase, so the fixed cost of a step is a
  few microseconds.
- Compiled without numba's bounds checks, which made the mapping phases 20-58% slower on batches of 256 and
  1024 requests (docs/performance.md, "Bounds checks"). Each kernel checks the ranges of its indices itself
  instead, once per call and per row before its element loops, and raises IndexError when one is outside its
  array. The values come from state checked at the boundary, so this never fires on a trace; but a broken
  invariant is an error, never a read or write of other memory. tests/test_kernels_guarded.py holds every
  kernel's guards against the same kernel compiled with bounds checks.
- numba compiles on first use and caches the machine code next to this file (`cache=True`), so only the first
  run on a machine pays the compile (about 4 s here: `kvmap replay` took 6.1 s cold, 2.1 s warm). Importing
  this module imports numba: import it lazily.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from kvmap.kv.kernels import slot_of

_jit = nb.njit(cache=True, nogil=True, boundscheck=False)


@_jit
def batch_order(counts, num_drafts, num_speculative_tokens, order, keys, tmp):
    """MRV2's batch order into order[:n] (scheduler-entry indices): a stable sort by count, or with drafts
    (k > 0) by (has no drafts, count != 1 + k, count), as `batch.batch_order`. The entries with the smallest
    key (usually the decodes, most of the batch) are taken in one pass; the rest are sorted by insertion when
    few, by a bottom-up merge through `tmp` when many. Returns n."""
    n = counts.shape[0]
    if order.shape[0] < n or keys.shape[0] < n or tmp.shape[0] < n or (
            num_speculative_tokens > 0 and num_drafts.shape[0] < n):
        raise IndexError("batch_order: a buffer shorter than the batch")
    if n == 0:
        return 0
    lo = np.int64(1) << 62
    for i in range(n):
        key = np.int64(counts[i])
        if num_speculative_tokens > 0:
            key |= (np.int64(num_drafts[i] == 0) << 62) | (np.int64(counts[i] != 1 + num_speculative_tokens) << 61)
        keys[i] = key
        lo = min(lo, key)
    m = 0
    for i in range(n):
        if keys[i] == lo:
            order[m] = i
            m += 1
    r = m
    for i in range(n):
        if keys[i] != lo:
            order[r] = i
            r += 1
    L = n - m
    if L <= 48:
        for i in range(m + 1, n):
            v = order[i]
            kv = keys[v]
            j = i - 1
            while j >= m and keys[order[j]] > kv:
                order[j + 1] = order[j]
                j -= 1
            order[j + 1] = v
        return n
    # bottom-up merge of order[m:n] through tmp, copied back after each pass. (Swapping the two buffers
    # instead made numba's compile of this kernel 5-8x longer: 10-14 s of a first run, for no faster sort.)
    width = 1
    while width < L:
        for a in range(m, n, 2 * width):
            mid = min(a + width, n)
            hi = min(a + 2 * width, n)
            i, j, k = a, mid, a - m
            while i < mid and j < hi:
                if keys[order[j]] < keys[order[i]]:
                    tmp[k] = order[j]
                    j += 1
                else:
                    tmp[k] = order[i]
                    i += 1
                k += 1
            while i < mid:
                tmp[k] = order[i]
                i += 1
                k += 1
            while j < hi:
                tmp[k] = order[j]
                j += 1
                k += 1
        for q in range(L):
            order[m + q] = tmp[q]
        width *= 2
    return n


@_jit
def prepare_inputs(rows, counts, order, num_computed_tokens, token_ids,
                   idx_mapping, num_scheduled_tokens, num_computed_out, query_start_loc, seq_lens,
                   positions, input_ids):
    """Batch row b takes scheduler entry order[b]; its tokens are positions nc .. nc + n - 1. Returns T.

    A decode (n == 1) is two stores; a chunk copies through 1-D views, which LLVM turns into vector loops
    (indexing the 2-D token table inside the loop does not vectorize: 5x slower on prefill chunks)."""
    B = order.shape[0]
    if min(idx_mapping.shape[0], num_scheduled_tokens.shape[0], num_computed_out.shape[0], seq_lens.shape[0],
           query_start_loc.shape[0] - 1) < B:
        raise IndexError("prepare_inputs: an output shorter than the batch")
    t = 0
    query_start_loc[0] = 0
    for b in range(B):
        j = order[b]
        if j < 0 or j >= min(rows.shape[0], counts.shape[0]):
            raise IndexError("prepare_inputs: a batch entry outside the scheduled requests")
        row = rows[j]
        n = counts[j]
        if row < 0 or row >= min(num_computed_tokens.shape[0], token_ids.shape[0]):
            raise IndexError("prepare_inputs: a row outside the state")
        nc = num_computed_tokens[row]
        if n < 0 or nc < 0 or nc + n > token_ids.shape[1] or t + n > min(input_ids.shape[0], positions.shape[0]):
            raise IndexError("prepare_inputs: a request's tokens outside token_ids or the input buffers")
        idx_mapping[b] = row
        num_scheduled_tokens[b] = n
        num_computed_out[b] = nc
        seq_lens[b] = nc + n
        if n == 1:
            positions[t] = nc
            input_ids[t] = token_ids[row, nc]
        else:
            src = token_ids[row, nc : nc + n]
            dst = input_ids[t : t + n]
            pos = positions[t : t + n]
            for i in range(n):
                dst[i] = src[i]
            for i in range(n):
                pos[i] = nc + i
        t += n
        query_start_loc[b + 1] = t
    return t


@_jit
def gather_block_table(idx_mapping, num_blocks, table, out, out_num_blocks):
    """out[b, :num_blocks[row]] = table[row, :num_blocks[row]] (entries past num_blocks are left stale)."""
    if min(out.shape[0], out_num_blocks.shape[0]) < idx_mapping.shape[0]:
        raise IndexError("gather_block_table: an output shorter than the batch")
    for b in range(idx_mapping.shape[0]):
        row = idx_mapping[b]
        if row < 0 or row >= min(num_blocks.shape[0], table.shape[0]):
            raise IndexError("gather_block_table: a row outside the state")
        nb_ = num_blocks[row]
        if nb_ < 0 or nb_ > min(table.shape[1], out.shape[1]):
            raise IndexError("gather_block_table: a row's block count outside the table")
        out_num_blocks[b] = nb_
        for k in range(nb_):
            out[b, k] = table[row, k]


@_jit
def null_history(num_computed_tokens, num_retained_tokens, block_size, out):
    """Model Runner V2's sliding-window rule on the gathered rows: out[b, :max(nc - R, 0) // block_size] = 0, the
    null block (`GroupLayout.null_history_blocks`; R = num_retained_tokens > 0)."""
    if out.shape[0] < num_computed_tokens.shape[0] or block_size < 1:
        raise IndexError("null_history: a table shorter than the batch, or a block size under 1")
    for b in range(num_computed_tokens.shape[0]):
        n0 = max(np.int64(num_computed_tokens[b]) - num_retained_tokens, 0) // block_size
        if n0 > out.shape[1]:
            raise IndexError("null_history: a row's history past the table")
        for k in range(n0):
            out[b, k] = 0


@_jit
def slot_mapping(idx_mapping, num_scheduled_tokens, num_computed_tokens, table, block_size, out):
    """cp = 1: `slot_of` block by block: the slot of a block's first scheduled position, then a run of
    consecutive slots to the block's end (a vector loop; one table read and one division per block)."""
    B = idx_mapping.shape[0]
    if min(num_scheduled_tokens.shape[0], num_computed_tokens.shape[0]) < B or block_size < 1:
        raise IndexError("slot_mapping: counts shorter than the batch, or a block size under 1")
    span = np.int64(table.shape[1]) * block_size  # positions a table row holds (a product: no division per row)
    t = 0
    for b in range(B):
        row = idx_mapping[b]
        p = np.int64(num_computed_tokens[b])
        n = np.int64(num_scheduled_tokens[b])
        if row < 0 or row >= table.shape[0] or p < 0 or n < 0 or p + n > span or n > out.shape[0] - t:
            raise IndexError("slot_mapping: a row outside the table, or positions past its row or the output")
        trow = table[row]
        end = p + n
        while p < end:
            first = slot_of(trow, p, block_size, 1, 0, 1)
            stop = min(end, (p // block_size + 1) * block_size)
            run = out[t : t + (stop - p)]
            for q in range(stop - p):
                run[q] = first + q
            t += stop - p
            p = stop


@_jit
def slot_mapping_dcp(idx_mapping, num_scheduled_tokens, num_computed_tokens, table, block_size, cp_size, cp_rank,
                     interleave, has_slots, out):
    """One DCP rank's slots, token by token through `slot_of` (-1 where another rank holds the token); a group
    without a slot mapping gets -1 everywhere."""
    B = idx_mapping.shape[0]
    if min(num_scheduled_tokens.shape[0], num_computed_tokens.shape[0]) < B or block_size < 1 or cp_size < 1 \
            or interleave < 1 or cp_rank < 0 or cp_rank >= cp_size:
        raise IndexError("slot_mapping_dcp: counts shorter than the batch, or a layout out of range")
    span = np.int64(table.shape[1]) * block_size * cp_size if has_slots else np.int64(1) << 62
    t = 0
    for b in range(B):
        row = idx_mapping[b]
        p0 = np.int64(num_computed_tokens[b])
        n = np.int64(num_scheduled_tokens[b])
        if row < 0 or row >= table.shape[0] or p0 < 0 or n < 0 or p0 + n > span or n > out.shape[0] - t:
            raise IndexError("slot_mapping_dcp: a row outside the table, or positions past its row or the output")
        trow = table[row]
        for q in range(n):
            out[t] = slot_of(trow, p0 + q, block_size, cp_size, cp_rank, interleave) if has_slots else -1
            t += 1


@_jit
def dcp_local_seq_lens(seq_lens, cp_size, cp_rank, interleave, out):
    """out[b] = (s // (cp * I)) * I + clamp(s % (cp * I) - rank * I, 0, I), s = seq_lens[b]."""
    if out.shape[0] < seq_lens.shape[0] or cp_size < 1 or interleave < 1:
        raise IndexError("dcp_local_seq_lens: an output shorter than the batch, or a DCP size or interleave under 1")
    ci = cp_size * interleave
    for b in range(seq_lens.shape[0]):
        s = seq_lens[b]
        out[b] = s // ci * interleave + min(max(s % ci - cp_rank * interleave, 0), interleave)


@_jit
def scatter(dst, idx, values):
    """dst[idx[i]] = values[i]."""
    if values.shape[0] < idx.shape[0]:
        raise IndexError("scatter: fewer values than indices")
    for i in range(idx.shape[0]):
        if idx[i] < 0 or idx[i] >= dst.shape[0]:
            raise IndexError("scatter: an index outside the array")
        dst[idx[i]] = values[i]


@_jit
def positions_fit(rows, counts, num_drafts, num_computed_tokens, capacity, total_len):
    """Every scheduled position has a block in every group and is within max_model_len (capacity), and every
    position before the drafts holds a known token (total_len)."""
    if min(counts.shape[0], num_drafts.shape[0]) < rows.shape[0]:
        raise IndexError("positions_fit: counts shorter than the rows")
    n_rows = min(num_computed_tokens.shape[0], capacity.shape[0], total_len.shape[0])
    for i in range(rows.shape[0]):
        row = rows[i]
        if row < 0 or row >= n_rows:
            raise IndexError("positions_fit: a row outside the state")
        end = num_computed_tokens[row] + counts[i]
        if end > capacity[row] or end - num_drafts[i] > total_len[row]:
            return False
    return True


@_jit
def append_tokens(token_ids, total_len, rows, counts, flat, max_model_len):
    """After a step: token_ids[rows[i], total_len[rows[i]] :][: counts[i]] = segment i of flat, total_len grows.
    Checks every row first and writes nothing if one would pass max_model_len: returns its index, else -1."""
    if counts.shape[0] < rows.shape[0] or max_model_len > token_ids.shape[1]:
        raise IndexError("append_tokens: counts shorter than the rows, or max_model_len past token_ids")
    n_rows = min(total_len.shape[0], token_ids.shape[0])
    total = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        if row < 0 or row >= n_rows or counts[i] < 0 or total_len[row] < 0:
            raise IndexError("append_tokens: a row outside the state, or a negative count")
        if total_len[row] + counts[i] > max_model_len:
            return i
        total += counts[i]
    if total > flat.shape[0]:
        raise IndexError("append_tokens: counts past the flat tokens")
    t = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        start = total_len[row]
        n = counts[i]
        dst = token_ids[row, start : start + n]
        for k in range(n):
            dst[k] = flat[t + k]
        total_len[row] = start + n
        t += n
    return -1


# The ahead-of-time build (kvmap/aot.py, at install): exported name -> (kernel, signature). The signatures are
# the dtypes of the workers' buffers and state (workers/buffers.py, workers/state.py): C-contiguous int32 rows
# and counts, int64 positions and slots. AOT_SOURCES: the files this machine code is compiled from.
AOT_EXPORTS = {
    "batch_order": ("batch_order", "i8(i4[::1], i4[::1], i8, i4[::1], i8[::1], i4[::1])"),
    "prepare_inputs": ("prepare_inputs", "i8(i4[::1], i4[::1], i4[::1], i4[::1], i4[:, ::1], i4[::1], i4[::1], "
                                         "i4[::1], i4[::1], i4[::1], i8[::1], i4[::1])"),
    "gather_block_table": ("gather_block_table", "void(i4[::1], i4[::1], i4[:, ::1], i4[:, ::1], i4[::1])"),
    "null_history": ("null_history", "void(i4[::1], i8, i8, i4[:, ::1])"),
    "slot_mapping": ("slot_mapping", "void(i4[::1], i4[::1], i4[::1], i4[:, ::1], i8, i8[::1])"),
    "slot_mapping_dcp": ("slot_mapping_dcp", "void(i4[::1], i4[::1], i4[::1], i4[:, ::1], i8, i8, i8, i8, b1, "
                                             "i8[::1])"),
    "dcp_local_seq_lens": ("dcp_local_seq_lens", "void(i4[::1], i8, i8, i8, i4[::1])"),
    "scatter": ("scatter", "void(i4[::1], i4[::1], i4[::1])"),
    "positions_fit": ("positions_fit", "b1(i4[::1], i4[::1], i4[::1], i4[::1], i4[::1], i4[::1])"),
    "append_tokens": ("append_tokens", "i8(i4[:, ::1], i4[::1], i4[::1], i4[::1], i4[::1], i8)"),
}
AOT_SOURCES = ("workers/kernels_cpu.py", "kv/kernels.py")  # slot_of lives in kv/kernels.py
