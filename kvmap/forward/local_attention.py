"""Chunked-local attention's virtual batches, as vLLM 0.33's `make_local_attention_virtual_batches` makes them.

Job: for a `chunked_local` KV-cache group (attention within aligned chunks of C = attention_chunk_size tokens),
split every request into one virtual request per chunk its query touches, with that chunk's keys and pages.

Rules (issue 26 forward-pass notes, section 8.3; vllm/v1/attention/backends/utils.py 543-684, used by
`ChunkedLocalAttentionBuilder`, which never runs under CUDA graphs):
- Per row b with query q and sequence s: the first chunk gets `first = min(C - (s - q) % C, q)` query tokens,
  then full chunks of C, the last partial: `1 + cdiv(q - first, C)` virtual rows.
- Virtual key lengths: C, except each row's last chunk: `C + s % -C` (the tokens of the chunk so far).
- Virtual row v of row b starts its keys at `s - (r * C + last)`, r = virtual rows after v in b; its block
  table row is `block_table[b, start // bs + j]`, j < C / bs, indices clipped to the table width (a
  negative index, from an empty padded row, wraps as numpy's and torch's indexing do).
- New query_start_loc (int32), seq_lens (int32, also the host upper bound), max_query_len, max_seq_len;
  num_actual_tokens and slot_mapping unchanged; is_prefilling dropped (None), causal True.
- C must be a multiple of the block size bs (the group's kernel block size). One scalar spec
  (`virtual_batches_spec`) and one numpy form (`virtual_batches`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvmap.forward.attention import CommonAttentionMetadata

__all__ = ["virtual_batches", "virtual_batches_spec"]


def _result(cm, qsl, seq, table, max_q) -> CommonAttentionMetadata:
    return replace(cm, query_start_loc=qsl, seq_lens=seq, num_reqs=len(seq), max_query_len=max_q,
                   max_seq_len=int(seq.max()), block_table_tensor=table, is_prefilling=None,
                   seq_lens_cpu_upper_bound=seq, causal=True)


def virtual_batches_spec(cm: CommonAttentionMetadata, attention_chunk_size: int,
                         block_size: int) -> CommonAttentionMetadata:
    """Scalar spec: one virtual row at a time."""
    C = attention_chunk_size
    assert C % block_size == 0, (C, block_size)
    pages, width = C // block_size, cm.block_table_tensor.shape[1]
    qs, ks, rows = [], [], []
    for b in range(len(cm.seq_lens)):
        q = int(cm.query_start_loc[b + 1]) - int(cm.query_start_loc[b])
        s = int(cm.seq_lens[b])
        first = min(C - (s - q) % C, q)
        nv = 1 + -((q - first) // -C)
        last = C + s % -C
        for i in range(nv):
            qs.append(first if i == 0 else min(q - first - C * (i - 1), C))
            ks.append(last if i == nv - 1 else C)
            start = s - ((nv - 1 - i) * C + last)
            rows.append([int(cm.block_table_tensor[b, min(start // block_size + j, width - 1)])
                         for j in range(pages)])
    qsl = [0]
    for x in qs:
        qsl.append(qsl[-1] + x)
    return _result(cm, np.array(qsl, dtype=np.int32), np.array(ks, dtype=np.int32),
                   np.array(rows, dtype=np.int32).reshape(len(rows), pages), max(qs))


def virtual_batches(cm: CommonAttentionMetadata, attention_chunk_size: int,
                    block_size: int) -> CommonAttentionMetadata:
    """The entry point per step for a chunked_local group (numpy form); `block_size`: the group's kernel block
    size."""
    C = attention_chunk_size
    assert C % block_size == 0, (C, block_size)
    qsl_in = cm.query_start_loc
    q = (qsl_in[1:] - qsl_in[:-1]).astype(np.int32)  # [n]
    s = cm.seq_lens.astype(np.int32)  # [n]
    first = np.minimum(C - (s - q) % C, q)
    last = C + s % -C
    nv = 1 + -((q - first) // -C)  # [n] virtual rows per row
    cu = np.cumsum(nv)
    V = int(cu[-1])
    i = np.arange(V) - np.repeat(cu - nv, nv)  # [V] chunk index within its row
    r = np.repeat(nv, nv) - i - 1  # [V] chunks after it
    qv = np.repeat(q - first, nv)
    qv = np.where(i == 0, np.repeat(first, nv), np.minimum(qv - C * (i - 1), C)).astype(np.int32)
    kv = np.full(V, C, dtype=np.int32)
    kv[cu - 1] = last
    start = np.repeat(s, nv) - (r * C + np.repeat(last, nv))
    pages = C // block_size
    cols = (start // block_size)[:, None] + np.arange(pages)
    cols = cols.clip(max=cm.block_table_tensor.shape[1] - 1)
    table = cm.block_table_tensor[np.repeat(np.arange(len(s)), nv)[:, None], cols].astype(np.int32)
    qsl = np.zeros(V + 1, dtype=np.int32)
    np.cumsum(qv, out=qsl[1:])
    return _result(cm, qsl, kv, table, int(qv.max()))
