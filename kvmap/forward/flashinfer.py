"""FlashInfer's native-path metadata of one KV-cache group, as vLLM 0.33's `FlashInferMetadataBuilder.build` makes it.

Job: from a group's `CommonAttentionMetadata` and split, the paged-KV CSR arrays (`paged_kv_indptr`,
`paged_kv_indices`, `paged_kv_last_page_len`) and the arguments of the prefill and decode `plan()` calls.

Rules (issue 26 forward-pass notes, section 6.2; vllm/v1/attention/backends/flashinfer.py 1511-2002):
- `page_size` is the kernel block size and the block table the kernel table.
- KV lengths: `seq_lens_cpu_upper_bound` without spec decode, else `seq_lens`; under DCP the prefill rows
  (from num_decodes on) first drop their query (context only), then every row becomes this rank's local
  length (`get_dcp_local_seq_lens`: whole interleave runs round-robin, the remainder to the first ranks).
- Over all n rows: num_blocks = ceil(kv_len / page_size); `paged_kv_indptr = [0, cumsum(num_blocks)]`;
  `paged_kv_indices[indptr[b]:indptr[b + 1]] = block_table[b, :num_blocks[b]]`; `paged_kv_last_page_len =
  kv_len % page_size`, or page_size when that is 0 and kv_len > 0 (0 for empty padded rows). All int32.
- Prefill plan (rows num_decodes..n): `qo_indptr` rebased to 0, `paged_kv_indptr` NOT rebased, the whole
  indices array, `seq_lens` = FlashInfer's `get_seq_lens` = max(num_blocks - 1, 0) * page_size + last_page_len.
- Decode plan: the first N + 1 indptr entries and N last-page lengths, N = num_decode_tokens with one query
  token per request, or num_decodes with `q_len_per_req = num_decode_tokens // num_decodes` on FA2-native
  decode; `num_qo_heads` is multiplied by the DCP size. (Should N exceed n, vLLM's slices would reach stale
  entries of its persistent buffers; kvmap gives only the n + 1 defined ones.)
- Only the native paths: trtllm-gen and XQA (SM90+ with cubins) take the block table directly; the caller says
  which path runs. Each rule has a scalar spec (`build_spec`), a numpy form (`build`) and a numba form
  (`build_numba`: the three arrays by kernels.paged_kv, the numba worker's), held together by tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmap.forward.attention import CommonAttentionMetadata, Split
from kvmap.layout import dcp_local_seq_len, dcp_local_seq_lens

__all__ = ["DecodePlan", "FlashInferMetadata", "NumbaBuffers", "PrefillPlan", "build", "build_numba", "build_spec"]


@dataclass(slots=True)  # a step's result: not frozen (inputs.py)
class PrefillPlan:
    """The native prefill wrapper's `plan()` index arguments (rows num_decodes .. n)."""

    qo_indptr: np.ndarray  # [num_prefills + 1] int32, rebased query starts
    paged_kv_indptr: np.ndarray  # [num_prefills + 1] int32, NOT rebased: offsets into paged_kv_indices
    paged_kv_last_page_len: np.ndarray  # [num_prefills] int32
    seq_lens: np.ndarray  # [num_prefills] int32, get_seq_lens(indptr, last_page_len, page_size)
    page_size: int


@dataclass(slots=True)  # a step's result: not frozen (inputs.py)
class DecodePlan:
    """The native decode wrapper's `plan()` (`fast_plan_decode`) index arguments."""

    indptr: np.ndarray  # [N + 1] int32, the first N + 1 paged_kv_indptr entries
    last_page_len: np.ndarray  # [N] int32
    seq_lens: np.ndarray  # [N] int32, get_seq_lens(indptr, last_page_len, page_size)
    page_size: int
    q_len_per_req: int
    num_qo_heads_factor: int  # num_qo_heads is multiplied by this (the DCP size)


@dataclass(slots=True)  # a step's result: not frozen (inputs.py)
class FlashInferMetadata:
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int
    seq_lens_cpu: np.ndarray  # [n] int32, the KV lengths paged (DCP: rank-local, prefill rows context only)
    paged_kv_indptr: np.ndarray  # [n + 1] int32, row -> first entry of paged_kv_indices
    paged_kv_indices: np.ndarray  # [paged_kv_indptr[n]] int32, the rows' pages, concatenated
    paged_kv_last_page_len: np.ndarray  # [n] int32, tokens in each row's last page
    prefill: PrefillPlan | None
    decode: DecodePlan | None


def _seq_lens_cpu_spec(cm, sp, num_speculative_tokens, dcp_size, dcp_rank, interleave) -> list[int]:
    src = cm.seq_lens_cpu_upper_bound if num_speculative_tokens == 0 else cm.seq_lens
    kv = [int(x) for x in src[: cm.num_reqs]]
    if dcp_size > 1:
        if sp.num_prefills > 0:
            qsl = cm.query_start_loc
            for b in range(sp.num_decodes, cm.num_reqs):
                kv[b] -= int(qsl[b + 1]) - int(qsl[b])
        kv = [dcp_local_seq_len(x, dcp_size, dcp_rank, interleave) for x in kv]
    return kv


def build_spec(cm: CommonAttentionMetadata, sp: Split, page_size: int, num_speculative_tokens: int = 0,
               dcp_size: int = 1, dcp_rank: int = 0, interleave: int = 1,
               fa2_native_decode: bool = False) -> FlashInferMetadata:
    """Scalar spec: row by row, page by page."""
    n = cm.num_reqs
    kv = _seq_lens_cpu_spec(cm, sp, num_speculative_tokens, dcp_size, dcp_rank, interleave)
    indptr, indices, last = [0], [], []
    for b in range(n):
        nb = (kv[b] + page_size - 1) // page_size
        indptr.append(indptr[-1] + nb)
        indices += [int(cm.block_table_tensor[b, j]) for j in range(nb)]
        r = kv[b] % page_size
        last.append(page_size if r == 0 and kv[b] != 0 else r)

    def kv_len(ip, lp):
        return [max(ip[i + 1] - ip[i] - 1, 0) * page_size + lp[i] for i in range(len(lp))]

    prefill = decode = None
    i32 = np.int32
    if sp.num_prefills > 0:
        d = sp.num_decodes
        qo = [int(cm.query_start_loc[b]) - int(cm.query_start_loc[d]) for b in range(d, n + 1)]
        ip, lp = indptr[d: n + 1], last[d:n]
        prefill = PrefillPlan(np.array(qo, i32), np.array(ip, i32), np.array(lp, i32),
                              np.array(kv_len(ip, lp), i32), page_size)
    if sp.num_decodes > 0:
        N, q_len = sp.num_decode_tokens, 1
        if fa2_native_decode:
            N, q_len = sp.num_decodes, sp.num_decode_tokens // sp.num_decodes
        ip, lp = indptr[: N + 1], last[:N]
        decode = DecodePlan(np.array(ip, i32), np.array(lp, i32), np.array(kv_len(ip, lp), i32), page_size, q_len,
                            dcp_size)
    return FlashInferMetadata(sp.num_decodes, sp.num_prefills, sp.num_decode_tokens, sp.num_prefill_tokens,
                              np.array(kv, i32), np.array(indptr, i32), np.array(indices, i32).reshape(-1),
                              np.array(last, i32), prefill, decode)


def kv_source(seq_lens: np.ndarray, seq_lens_cpu_upper_bound: np.ndarray, num_speculative_tokens: int) -> np.ndarray:
    """The lengths FlashInfer pages before DCP's local share: the host upper bound without spec decode, else
    seq_lens."""
    return seq_lens_cpu_upper_bound if num_speculative_tokens == 0 else seq_lens


def _kv_lens(cm: CommonAttentionMetadata, sp: Split, num_speculative_tokens: int, dcp_size: int, dcp_rank: int,
             interleave: int) -> np.ndarray:
    """[n] int32 the KV lengths paged (a view when dcp_size == 1: never written)."""
    n = cm.num_reqs
    kv = np.asarray(kv_source(cm.seq_lens, cm.seq_lens_cpu_upper_bound, num_speculative_tokens)[:n],
                    dtype=np.int32)
    if dcp_size > 1:
        kv = kv.copy()
        if sp.num_prefills > 0:
            kv[sp.num_decodes:] -= np.diff(cm.query_start_loc[sp.num_decodes: n + 1])
        kv = dcp_local_seq_lens(kv, dcp_size, dcp_rank, interleave)
    return kv


def _metadata(cm: CommonAttentionMetadata, sp: Split, page_size: int, dcp_size: int, fa2_native_decode: bool,
              kv: np.ndarray, indptr: np.ndarray, indices: np.ndarray, last: np.ndarray) -> FlashInferMetadata:
    """The metadata around the three arrays (both fast forms). kv - (nb - 1) * page_size lies in 1..page_size
    for kv > 0 (the rule's remainder, page_size for 0) and is 0 for kv = 0, so FlashInfer's get_seq_lens of
    every row is kv itself."""
    n = cm.num_reqs
    prefill = decode = None
    if sp.num_prefills > 0:
        d = sp.num_decodes
        qsl = cm.query_start_loc[d: n + 1]
        prefill = PrefillPlan((qsl - qsl[0]).astype(np.int32), indptr[d: n + 1], last[d:n], kv[d:n], page_size)
    if sp.num_decodes > 0:
        N, q_len = sp.num_decode_tokens, 1
        if fa2_native_decode:
            N, q_len = sp.num_decodes, sp.num_decode_tokens // sp.num_decodes
        decode = DecodePlan(indptr[: N + 1], last[:N], kv[:N], page_size, q_len, dcp_size)
    return FlashInferMetadata(sp.num_decodes, sp.num_prefills, sp.num_decode_tokens, sp.num_prefill_tokens, kv,
                              indptr, indices, last, prefill, decode)


def build(cm: CommonAttentionMetadata, sp: Split, page_size: int, num_speculative_tokens: int = 0,
          dcp_size: int = 1, dcp_rank: int = 0, interleave: int = 1,
          fa2_native_decode: bool = False) -> FlashInferMetadata:
    """The entry point per step and group (numpy form). `sp`: `attention.split(cm, "FLASHINFER", ...)`;
    `page_size`: the group's kernel block size; DCP: this rank's index and the interleave size."""
    n = cm.num_reqs
    kv = _kv_lens(cm, sp, num_speculative_tokens, dcp_size, dcp_rank, interleave)
    nb = (kv + (page_size - 1)) // page_size
    indptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(nb, out=indptr[1:])
    table = np.ascontiguousarray(cm.block_table_tensor[:n])
    # each row's first nb pages, concatenated: flat index = row * width + (i - indptr[row])
    shift = np.arange(0, n * table.shape[1], table.shape[1], dtype=np.int64) - indptr[:n]
    indices = table.ravel()[np.arange(int(indptr[n]), dtype=np.int64) + np.repeat(shift, nb)]
    last = kv - np.maximum(nb - 1, 0) * page_size
    return _metadata(cm, sp, page_size, dcp_size, fa2_native_decode, kv, indptr, indices.astype(np.int32, copy=False),
                     last)


class NumbaBuffers:
    """The numba form's outputs for one group, grown when a step needs more (valid until the next step)."""

    def __init__(self, kernels) -> None:
        self.k = kernels  # kvmap.forward.kernels, as kvmap.aot.load gives them
        self.indptr = np.zeros(1, dtype=np.int32)  # [n + 1]
        self.indices = np.zeros(0, dtype=np.int32)  # [n * width] at least
        self.last = np.zeros(0, dtype=np.int32)  # [n]


def build_numba(buf: NumbaBuffers, cm: CommonAttentionMetadata, sp: Split, page_size: int,
                num_speculative_tokens: int = 0, dcp_size: int = 1, dcp_rank: int = 0, interleave: int = 1,
                fa2_native_decode: bool = False) -> FlashInferMetadata:
    """`build` with the three arrays by one kernel (kernels.paged_kv) into `buf` (views of it: valid until the
    next step)."""
    kv = _kv_lens(cm, sp, num_speculative_tokens, dcp_size, dcp_rank, interleave)
    a = arrays_numba(buf, kv, cm.block_table_tensor, page_size, cm.num_reqs)
    return metadata_of(cm, sp, page_size, a, dcp_size, fa2_native_decode)


def arrays_numba(buf: NumbaBuffers, kv: np.ndarray, block_table: np.ndarray, page_size: int,
                 n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(kv [n], paged_kv_indptr [n + 1], paged_kv_indices [nnz], paged_kv_last_page_len [n]) by the kernel into
    `buf` (views valid until the next step). kv: [>= n] int32 the KV lengths paged (`_kv_lens`); block_table:
    [>= n, W] int32."""
    return views_numba(buf, kv, n, fill_numba(buf, kv, block_table, page_size, n))


def fill_numba(buf: NumbaBuffers, kv: np.ndarray, block_table: np.ndarray, page_size: int, n: int) -> int:
    """The kernel over rows 0..n into `buf` (grown when the step needs more); returns nnz = paged_kv_indptr[n]."""
    table = np.ascontiguousarray(block_table)  # the kernel's signature (a view: the rows' slice is)
    if len(buf.last) < n or len(buf.indices) < n * table.shape[1]:
        buf.indptr = np.zeros(n + 1, dtype=np.int32)
        buf.indices = np.zeros(n * table.shape[1], dtype=np.int32)
        buf.last = np.zeros(n, dtype=np.int32)
    return buf.k.paged_kv(kv, table, page_size, n, buf.indptr, buf.indices, buf.last)


def views_numba(buf: NumbaBuffers, kv: np.ndarray, n: int, nnz: int) -> tuple:
    """`arrays_numba`'s arrays after `fill_numba` returned nnz."""
    return kv[:n], buf.indptr[: n + 1], buf.indices[:nnz], buf.last[:n]


def metadata_of(cm: CommonAttentionMetadata, sp: Split, page_size: int, arrays: tuple, dcp_size: int = 1,
                fa2_native_decode: bool = False) -> FlashInferMetadata:
    """The metadata around `arrays_numba`'s arrays."""
    kv, indptr, indices, last = arrays
    return _metadata(cm, sp, page_size, dcp_size, fa2_native_decode, kv, indptr, indices, last)
