"""The padded tails of one step: the step's inputs at the padded shape its graph choice (cudagraph.py) gives.

Job: from a `BatchDescriptor` and the step's unpadded `query_start_loc`, `seq_lens`, `slot_mapping`, block
tables and positions, the arrays the padded step reads (`PaddedTails`), per runner.

Rules (issue 26 forward-pass notes, section 4.5):
- `query_start_loc` [num_reqs_padded + 1]: padded entries hold T; `seq_lens` [num_reqs_padded]: padded rows 0;
  block tables: padded rows `NULL_BLOCK_ID`; `is_padding`: token index >= T.
- Slots: V1 pads them to T_pad only under a FULL graph or when a backend writes the KV cache outside forward
  (FA, FlashInfer, Triton), else T (`num_slots`); MRV2 always to T_pad; the tail holds PAD_SLOT_ID.
- Positions: V1's tail 0; MRV2 writes none (its tail is stale), so `positions` is None.
- A scalar spec (`pad_tails_spec`, element by element) and one fast form (`pad_tails`, whole-array numpy; what
  needs no padding comes back as views of the inputs), held together by tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmap.forward.cudagraph import BatchDescriptor
from kvmap.layout import PAD_SLOT_ID

NULL_BLOCK_ID = 0  # vLLM's block id for padded block-table rows


@dataclass(slots=True)  # a step's result: not frozen (inputs.py)
class PaddedTails:
    """The step's inputs at the padded shape (issue 26 forward-pass notes, section 4.5), host arrays."""

    query_start_loc: np.ndarray  # [num_reqs_padded + 1] int32, tail = the unpadded total T
    seq_lens: np.ndarray  # [num_reqs_padded] int32, padded rows 0
    slot_mapping: np.ndarray  # [num_groups, num_slots] int64, PAD_SLOT_ID from T on
    block_tables: list[np.ndarray]  # [num_groups] x [num_reqs_padded, width_g] int32, padded rows NULL_BLOCK_ID
    is_padding: np.ndarray  # [num_tokens_padded] bool, token index >= T
    positions: np.ndarray | None  # V1: [num_tokens_padded] int64, tail 0; MRV2: None (tail stale, not written)


def num_slots(runner: str, desc: BatchDescriptor, separate_kv_update: bool) -> int:
    """V1: T_pad if FULL or a backend writes KV outside forward (FA, FlashInfer, Triton), else T. MRV2: T_pad."""
    if runner == "v1" and not (desc.pad_attn or separate_kv_update):
        return desc.num_tokens
    return desc.num_tokens_padded


def pad_tails_spec(runner: str, desc: BatchDescriptor, query_start_loc, seq_lens, slot_mapping, block_tables,
                   positions, separate_kv_update: bool = True) -> PaddedTails:
    """Scalar spec: element by element."""
    R, T, Rp, Tp = desc.num_reqs, desc.num_tokens, desc.num_reqs_padded, desc.num_tokens_padded
    qsl = [int(query_start_loc[b]) if b <= R else T for b in range(Rp + 1)]
    sl = [int(seq_lens[b]) if b < R else 0 for b in range(Rp)]
    n = num_slots(runner, desc, separate_kv_update)
    slots = [[int(g[i]) if i < T else PAD_SLOT_ID for i in range(n)] for g in slot_mapping]
    tables = []
    for t in block_tables:
        tables.append(np.array([[int(t[b, j]) if b < R else NULL_BLOCK_ID for j in range(t.shape[1])]
                                for b in range(Rp)], dtype=np.int32).reshape(Rp, t.shape[1]))
    pos = None if runner == "mrv2" else np.array([int(positions[i]) if i < T else 0 for i in range(Tp)],
                                                   dtype=np.int64)
    return PaddedTails(np.array(qsl, dtype=np.int32), np.array(sl, dtype=np.int32),
                       np.array(slots, dtype=np.int64).reshape(len(slot_mapping), n), tables,
                       np.array([i >= T for i in range(Tp)], dtype=bool), pos)


def pad_tails(runner: str, desc: BatchDescriptor, query_start_loc: np.ndarray, seq_lens: np.ndarray,
              slot_mapping: np.ndarray, block_tables: list[np.ndarray], positions: np.ndarray,
              separate_kv_update: bool = True) -> PaddedTails:
    """numpy form. Inputs unpadded: query_start_loc [R + 1] int32, seq_lens [R] int32, slot_mapping [G, T]
    int64, block_tables [G] x [R, W_g] int32, positions [T] int64. What needs no padding is returned as views of
    the inputs (valid while they are)."""
    R, T, Rp, Tp = desc.num_reqs, desc.num_tokens, desc.num_reqs_padded, desc.num_tokens_padded
    if Rp == R:  # no request padding: the inputs themselves (views)
        qsl, sl, tables = query_start_loc[: R + 1], seq_lens[:R], [t[:R] for t in block_tables]
    else:
        qsl = np.full(Rp + 1, T, dtype=np.int32)
        qsl[: R + 1] = query_start_loc[: R + 1]
        sl = np.zeros(Rp, dtype=np.int32)
        sl[:R] = seq_lens[:R]
        tables = []
        for t in block_tables:
            out = np.full((Rp, t.shape[1]), NULL_BLOCK_ID, dtype=np.int32)
            out[:R] = t[:R]
            tables.append(out)
    n = num_slots(runner, desc, separate_kv_update)
    if n == T:
        slots = slot_mapping[:, :T]
    else:
        slots = np.full((slot_mapping.shape[0], n), PAD_SLOT_ID, dtype=np.int64)
        slots[:, :T] = slot_mapping[:, :T]
    is_padding = np.arange(Tp) >= T
    pos = None
    if runner == "v1":
        pos = np.zeros(Tp, dtype=np.int64)
        pos[:T] = positions[:T]
    return PaddedTails(qsl, sl, slots, tables, is_padding, pos)
