"""Compiled forms (numba) of the forward rules whose numpy forms cost more in numpy's per-call overhead than in
work: the step's shape and padded tails (cudagraph.py), CommonAttentionMetadata with the decode/prefill split
(attention.py), FlashInfer's paged-KV arrays (flashinfer.py) and Model Runner V2's sampler indices (sampler.py).

Rules:
- One kernel per rule and step (or group): one loop over the batch, writing preallocated buffers, returning
  counts; each is held against its rule's scalar spec by tests (tests/test_forward_compiled.py), as the numpy
  forms are. The numba worker's `prepare_forward` calls them (forward/compiled.py); `step_rows` calls three of
  them in one call (a call from Python costs more than these loops over a step's rows), and only it and the
  kernels the pass calls on their own are exported ahead of time.
- Bounds checks stay on: the kernels index with lengths derived from the trace, so a bad length is an
  IndexError, never a read of other memory.
- Importing this module imports numba: load it through `kvmap.aot.load` (its ahead-of-time twin, or the JIT).
"""

from __future__ import annotations

import numba as nb

_jit = nb.njit(cache=True, nogil=True, boundscheck=True)


@_jit
def step_shape(query_start_loc, num_computed_tokens, prefill_len, idx_mapping, num_draft_tokens, mrv2, m, out):
    """The dispatch inputs of a step of R = len(idx_mapping) rows into out: [T, max_query_len, MRV2's
    decode_graph_eligible (1 or 0; 1 under V1)] (cudagraph.decode_graph_eligible, over
    num_computed_prefill_tokens = min(num_computed_tokens, prefill_len)). Returns them as one key,
    ((R * m + T) * m + max_query_len) * 2 + eligible (m > T: one key per shape)."""
    R = idx_mapping.shape[0]
    max_q = 0
    eligible = 1
    for b in range(R):
        q = query_start_loc[b + 1] - query_start_loc[b]
        max_q = max(max_q, q)
        if mrv2:
            p = prefill_len[idx_mapping[b]]
            c = min(num_computed_tokens[b], p)
            if c < p and not (q - num_draft_tokens[b] == 1 and c > 0):
                eligible = 0
    T = query_start_loc[R]
    out[0] = T
    out[1] = max_q
    out[2] = eligible
    return ((R * m + T) * m + max_q) * 2 + eligible


@_jit
def pad_tails(query_start_loc, seq_lens, slot_mapping, positions, R, T, Rp, Tp, n, pad_slot_id, qsl_out, sl_out,
              slots_out, positions_out, is_padding_out):
    """padded_tails.pad_tails into the buffers: query_start_loc [Rp + 1] (tail T), seq_lens [Rp] (tail 0),
    slot_mapping [G, n] (tail pad_slot_id), is_padding [Tp] (token >= T), positions [Tp] (tail 0; an empty
    positions_out: not written, MRV2)."""
    for b in range(Rp + 1):
        qsl_out[b] = query_start_loc[b] if b <= R else T
    for b in range(Rp):
        sl_out[b] = seq_lens[b] if b < R else 0
    for g in range(slot_mapping.shape[0]):
        for i in range(n):
            slots_out[g, i] = slot_mapping[g, i] if i < T else pad_slot_id
    for i in range(Tp):
        is_padding_out[i] = i >= T
    if positions_out.shape[0]:
        for i in range(Tp):
            positions_out[i] = positions[i] if i < T else 0


@_jit
def common_split(query_start_loc, seq_lens_cpu_upper_bound, num_computed_tokens, prompt_or_prefill_len, idx_mapping, n,
                 num_actual_tokens, v1, threshold, require_uniform, is_prefilling_out, out):
    """attention.common_metadata's scalars and flags with split_decodes_and_prefills (short extends as decodes),
    over the padded query_start_loc [n + 1] and seq_lens_cpu_upper_bound [n] and the unpadded R =
    len(idx_mapping) rows.
    is_prefilling_out: [n] under V1 (padded rows False), [R] under MRV2; `prompt_or_prefill_len` per request
    row (V1 num_prompt_tokens, MRV2 prefill_len). out: [max_query_len, max_seq_len, num_decodes, num_prefills,
    num_decode_tokens, num_prefill_tokens]; threshold < 0: no split (out[2:] untouched)."""
    R = idx_mapping.shape[0]
    max_q = 0
    for b in range(R):
        max_q = max(max_q, query_start_loc[b + 1] - query_start_loc[b])
        is_prefilling_out[b] = num_computed_tokens[b] < prompt_or_prefill_len[idx_mapping[b]]
    if v1:
        for b in range(R, n):
            is_prefilling_out[b] = False
    max_seq = 0
    for b in range(n):
        max_seq = max(max_seq, seq_lens_cpu_upper_bound[b])
    out[0] = max_q
    out[1] = max_seq
    if threshold < 0:
        return
    T = num_actual_tokens
    first = n  # the first prefill row (n: none)
    if n and not (max_q <= threshold and (not require_uniform or threshold <= 1)):  # n = 0: no split to find
        q0 = query_start_loc[1] - query_start_loc[0]
        if q0 > threshold:
            first = 0
        else:
            for b in range(n):
                q = query_start_loc[b + 1] - query_start_loc[b]
                if (q != q0 and q != 0) if require_uniform else q > threshold:
                    first = b
                    break
    d = T if first == n else query_start_loc[first]
    out[2] = first
    out[3] = n - first
    out[4] = d
    out[5] = T - d


@_jit
def paged_kv(kv_lens, block_table, page_size, n, indptr_out, indices_out, last_page_len_out):
    """FlashInfer's paged_kv_indptr [n + 1], paged_kv_indices [indptr[n]] and paged_kv_last_page_len [n] over rows
    0..n (flashinfer.build's rule: each row's first ceil(kv / page_size) pages). Returns indptr[n]."""
    indptr_out[0] = 0
    for b in range(n):
        kv = kv_lens[b]
        nb_ = (kv + page_size - 1) // page_size
        s = indptr_out[b]
        if nb_ > 0:  # through the row's views: one bounds check per element, not two
            row, out = block_table[b], indices_out[s: s + nb_]
            for j in range(nb_):
                out[j] = row[j]
        indptr_out[b + 1] = s + nb_
        last_page_len_out[b] = kv - max(nb_ - 1, 0) * page_size
    return indptr_out[n]


@_jit
def mrv2_sampler(query_start_loc, idx_mapping, num_draft_tokens, has_drafts, num_new_sampled, cu_num_logits,
                 logits_indices, expanded_idx_mapping, expanded_local_pos):
    """sampler.mrv2_spec into the buffers: each request's d_b + S logit rows at the end of its query (d_b = 0
    for every row without drafts: `num_draft_tokens` is then not read). Returns L."""
    R = idx_mapping.shape[0]
    cu_num_logits[0] = 0
    k = 0
    for b in range(R):
        m = (num_draft_tokens[b] if has_drafts else 0) + num_new_sampled
        for j in range(m):
            logits_indices[k] = query_start_loc[b + 1] - m + j
            expanded_idx_mapping[k] = idx_mapping[b]
            expanded_local_pos[k] = j
            k += 1
        cu_num_logits[b + 1] = k
    return k


@_jit
def step_rows(query_start_loc, num_computed_tokens, prompt_or_prefill_len, idx_mapping, num_draft_tokens, has_drafts,
              num_new_sampled, mrv2, m, shape_out, cu_num_logits, logits_indices, expanded_idx_mapping,
              expanded_local_pos, seq_lens_cpu_upper_bound, threshold, require_uniform, is_prefilling_out, split_out):
    """The rules over a step's unpadded rows, in one call (forward/compiled.py `NumbaForward.run`): MRV2's
    sampler indices (`mrv2_sampler`, its L into shape_out[3]), the step's shape (`step_shape` into
    shape_out[:3], its key returned) and one split rule's `common_split` over R rows and T tokens (the counts
    of a step whose attention is not padded; an empty split_out: none)."""
    R = idx_mapping.shape[0]
    if mrv2:
        shape_out[3] = mrv2_sampler(query_start_loc, idx_mapping, num_draft_tokens, has_drafts, num_new_sampled,
                                    cu_num_logits, logits_indices, expanded_idx_mapping, expanded_local_pos)
    key = step_shape(query_start_loc, num_computed_tokens, prompt_or_prefill_len, idx_mapping, num_draft_tokens,
                     mrv2, m, shape_out)
    if split_out.shape[0]:
        common_split(query_start_loc, seq_lens_cpu_upper_bound, num_computed_tokens, prompt_or_prefill_len,
                     idx_mapping, R, query_start_loc[R], not mrv2, threshold, require_uniform, is_prefilling_out,
                     split_out)
    return key


# The ahead-of-time build (kvmap/aot.py): exported name -> (kernel, signature). The arrays are the host worker's
# buffers and the forward buffers (forward/compiled.py): int32 rows, int64 slots, positions and scalars.
AOT_EXPORTS = {
    "step_rows": ("step_rows", "i8(i4[:], i4[:], i4[:], i4[:], i4[:], b1, i8, b1, i8, i8[:], i4[:], i8[:], i8[:], "
                               "i4[:], i4[:], i8, b1, b1[:], i8[:])"),
    "pad_tails": ("pad_tails", "void(i4[:], i4[:], i8[:, :], i8[:], i8, i8, i8, i8, i8, i8, i4[:], i4[:], "
                               "i8[:, :], i8[:], b1[:])"),
    "common_split": ("common_split", "void(i4[:], i4[:], i4[:], i4[:], i4[:], i8, i8, b1, i8, b1, b1[:], i8[:])"),
    "paged_kv": ("paged_kv", "i8(i4[:], i4[:, ::1], i8, i8, i4[:], i4[:], i4[:])"),
}
AOT_SOURCES = ("forward/kernels.py",)
# the AOT build compiles this module with bounds checks (kvmap/aot.py `build`), as the JIT does
AOT_BOUNDSCHECK = True
