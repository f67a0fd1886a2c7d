"""FlashAttention's metadata of one KV-cache group, as vLLM 0.33's `FlashAttentionMetadataBuilder.build` makes it.

Job: the pass-through fields, `max_num_splits` and the DCP context fields. Triton attention
(`TritonAttentionMetadataBuilder`) passes the same common fields through: `triton_attn` below.

Rules (issue 26 forward-pass notes, section 6.1, 6.3; vllm/v1/attention/backends/flash_attn.py 518-1055):
- Pass-through: num_actual_tokens, max_query_len, query_start_loc, max_seq_len, seq_lens, block_table,
  slot_mapping, causal, from the group's CommonAttentionMetadata.
- `max_num_splits`: `flash_attn_max_num_splits_for_cuda_graph` (32 by default) when FA3's ahead-of-time
  scheduler is on (FA version 3), the cudagraph mode has FULL graphs and num_actual_tokens <= the largest
  capture size; 1 under VLLM_BATCH_INVARIANT; else 0 (FA's own heuristic).
- `scheduler_metadata` (FA3 only) comes from `get_scheduler_metadata`, a vllm_flash_attn CUDA op: NOT computed
  here (None), only its inputs are the fields above.
- DCP (size > 1): `dcp_context_kv_lens` = this rank's local share of (seq_len - query_len) per row (int32, [n]);
  context attention is skipped when every row's context (from seq_lens_cpu_upper_bound) is 0, and then
  `max_dcp_context_kv_len` = 0, else cdiv(max_seq_len, dcp * I) * I; when max_query_len > 1 the rows split
  into decodes and extends by `split_decodes_prefills_and_extends` (threshold 1) as num_decode_reqs,
  num_prefill_reqs (the extends), num_decode_tokens, num_prefill_tokens; all 0 otherwise.
- One scalar spec (`build_spec`) and one numpy form (`build`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmap.forward.attention import (CommonAttentionMetadata, split_decodes_prefills_and_extends,
                                     split_decodes_prefills_and_extends_spec)
from kvmap.layout import dcp_local_seq_len, dcp_local_seq_lens

__all__ = ["FlashAttentionMetadata", "TritonAttentionMetadata", "build", "build_spec", "max_num_splits",
           "triton_attn"]

MAX_NUM_SPLITS_FOR_CUDA_GRAPH = 32  # vllm/config/attention.py: flash_attn_max_num_splits_for_cuda_graph


@dataclass(slots=True)  # a step's result: not frozen (inputs.py)
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: np.ndarray  # [num_reqs + 1] int32, pass-through
    max_seq_len: int
    seq_lens: np.ndarray  # [num_reqs] int32, pass-through
    block_table: np.ndarray  # [num_reqs, width] int32, pass-through
    slot_mapping: np.ndarray  # [num_slots] int64, pass-through
    max_dcp_context_kv_len: int
    dcp_context_kv_lens: np.ndarray | None  # DCP: [num_reqs] int32, this rank's context tokens per row
    num_decode_reqs: int  # DCP split (0 without DCP or when max_query_len <= 1)
    num_prefill_reqs: int
    num_decode_tokens: int
    num_prefill_tokens: int
    max_num_splits: int
    scheduler_metadata: None  # FA3's get_scheduler_metadata is a CUDA op: not computed
    causal: bool = True


@dataclass(slots=True)  # a step's result: not frozen (inputs.py)
class TritonAttentionMetadata:
    """`TritonAttentionMetadataBuilder.build`: the common fields, passed through."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    max_seq_len: int
    seq_lens: np.ndarray  # [num_reqs] int32
    block_table: np.ndarray  # [num_reqs, width] int32
    slot_mapping: np.ndarray  # [num_slots] int64
    causal: bool = True


def triton_attn(cm: CommonAttentionMetadata) -> TritonAttentionMetadata:
    return TritonAttentionMetadata(cm.num_actual_tokens, cm.max_query_len, cm.query_start_loc, cm.max_seq_len,
                                   cm.seq_lens, cm.block_table_tensor, cm.slot_mapping, cm.causal)


def max_num_splits(num_actual_tokens: int, cudagraph_mode: str, max_cudagraph_capture_size: int,
                   fa_version: int = 3, batch_invariant: bool = False,
                   splits_for_cuda_graph: int = MAX_NUM_SPLITS_FOR_CUDA_GRAPH) -> int:
    if batch_invariant:
        return 1
    full = cudagraph_mode in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
    if fa_version == 3 and full and num_actual_tokens <= max_cudagraph_capture_size:
        return splits_for_cuda_graph
    return 0


def build_spec(cm: CommonAttentionMetadata, cudagraph_mode: str, max_cudagraph_capture_size: int,
               fa_version: int = 3, dcp_size: int = 1, dcp_rank: int = 0,
               interleave: int = 1) -> FlashAttentionMetadata:
    """Scalar spec."""
    n, qsl = cm.num_reqs, cm.query_start_loc
    splits = max_num_splits(cm.num_actual_tokens, cudagraph_mode, max_cudagraph_capture_size, fa_version)
    if dcp_size == 1:
        return _metadata(cm, splits)
    q = [int(qsl[b + 1]) - int(qsl[b]) for b in range(n)]
    ctx = [int(cm.seq_lens[b]) - q[b] for b in range(n)]
    ctx_lens = np.array([dcp_local_seq_len(c, dcp_size, dcp_rank, interleave) for c in ctx], dtype=np.int32)
    skip = max(int(cm.seq_lens_cpu_upper_bound[b]) - q[b] for b in range(n)) == 0
    return _metadata(cm, splits, ctx_lens, skip, split_decodes_prefills_and_extends_spec, dcp_size, interleave)


def build(cm: CommonAttentionMetadata, cudagraph_mode: str, max_cudagraph_capture_size: int, fa_version: int = 3,
          dcp_size: int = 1, dcp_rank: int = 0, interleave: int = 1) -> FlashAttentionMetadata:
    """The entry point per step and group (numpy form): `cudagraph_mode` the resolved mode (not the step's),
    `max_cudagraph_capture_size` the largest capture size (0 without graphs), `fa_version` 2, 3 or 4."""
    n, qsl = cm.num_reqs, cm.query_start_loc
    splits = max_num_splits(cm.num_actual_tokens, cudagraph_mode, max_cudagraph_capture_size, fa_version)
    if dcp_size == 1:
        return _metadata(cm, splits)
    q = np.diff(qsl[: n + 1])
    ctx_lens = dcp_local_seq_lens(cm.seq_lens[:n] - q, dcp_size, dcp_rank, interleave)
    skip = int((cm.seq_lens_cpu_upper_bound[:n] - q).max()) == 0
    return _metadata(cm, splits, ctx_lens, skip, split_decodes_prefills_and_extends, dcp_size, interleave)


def _metadata(cm: CommonAttentionMetadata, splits: int, ctx_lens: np.ndarray | None = None, skip: bool = True,
              split=None, dcp_size: int = 1, interleave: int = 1) -> FlashAttentionMetadata:
    """What both forms share once the DCP context lengths are known (None: no DCP): the four-way split by
    `split` (that form's) when a query is longer than one token, and `max_dcp_context_kv_len` unless every
    request is all query."""
    max_ctx, counts = 0, (0, 0, 0, 0)
    if ctx_lens is not None:
        if cm.max_query_len > 1:
            s = split(cm.query_start_loc, cm.seq_lens_cpu_upper_bound, cm.num_reqs, cm.num_actual_tokens,
                      cm.max_query_len)
            counts = (s.num_decodes, s.num_extends, s.num_decode_tokens, s.num_extend_tokens)
        if not skip:
            parts = dcp_size * interleave
            max_ctx = (cm.max_seq_len + parts - 1) // parts * interleave
    return FlashAttentionMetadata(cm.num_actual_tokens, cm.max_query_len, cm.query_start_loc, cm.max_seq_len,
                                  cm.seq_lens, cm.block_table_tensor, cm.slot_mapping, max_ctx, ctx_lens, *counts,
                                  splits, None, cm.causal)
