"""CommonAttentionMetadata of one KV-cache group and the decode/prefill split, as vLLM 0.33 builds them.

Job: from a step's padded inputs (`padded_tails.pad_tails`) build the per-group `CommonAttentionMetadata` fields
under vLLM's names, and split its rows into decodes, (extends) and prefills with the backend's
`reorder_batch_threshold` and `require_uniform`.

Rules (issue 26 forward-pass notes, section 5; vllm/v1/attention/backend.py 389-683, backends/utils.py 765-908):
- Counts: n = num_reqs_padded and T_pad when the step runs a FULL graph, else the unpadded R and T (both
  runners); `num_actual_tokens` is then T_pad despite its name. `max_query_len` is the unpadded maximum,
  `max_seq_len` the maximum of `seq_lens_cpu_upper_bound` (0 on padded rows).
- `is_prefilling`: V1 `num_computed_tokens < num_prompt_tokens`, length n, padded rows False; MRV2
  `num_computed_prefill_tokens < prefill_len` (prefill_len counts pre-preemption outputs), length R.
- `seq_lens_cpu_upper_bound` = seq_lens, 0 on padded rows; under MRV2 with async spec decode each row's
  `num_computed_tokens_correction` is added (MRV2 keeps the scheduler's optimistic num_computed_tokens on the
  host, `req_states.num_computed_tokens_np`, model_runner.py 1271-1278 and 1534-1541; V1 corrects its own
  before it adds). `max_seq_len` is its maximum, so it follows.
- `split_decodes_and_prefills`: all decodes when max_query_len <= threshold (and uniform not required or the
  threshold is 1); none when the first row is above the threshold; with require_uniform, rows equal to the
  first or 0 (FULL-graph padding) are decodes, else a row differing from the first and nonzero is a prefill;
  otherwise a row above the threshold is; the first prefill row ends the decodes (the batch is assumed
  ordered decode -> extend -> prefill). Token counts come from query_start_loc and num_actual_tokens.
- `split_decodes_prefills_and_extends`: rows above the threshold are extends or, with seq_len == query_len,
  prefills.
- Thresholds (`_init_reorder_batch_threshold`): the builder's base value, raised to the widest decode
  (1+k, V1 parallel drafting 1+2k) when it takes spec tokens as decodes, forced to 1 under DCP unless it
  supports varlen DCP; None: the backend neither reorders nor splits.
- Each rule: a scalar spec (`*_spec`, plain loops) and a numpy form, held together by tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmap.forward.cudagraph import BatchDescriptor
from kvmap.forward.padded_tails import PaddedTails

__all__ = ["BACKENDS", "BackendRules", "CommonAttentionMetadata", "Split", "common_metadata", "upper_bound",
           "common_metadata_spec", "reorder_batch_threshold", "require_uniform", "split",
           "split_decodes_and_prefills", "split_decodes_and_prefills_spec", "split_decodes_prefills_and_extends",
           "split_decodes_prefills_and_extends_spec"]


@dataclass(slots=True)  # a step's result: not frozen (inputs.py)
class CommonAttentionMetadata:
    """vLLM's `CommonAttentionMetadata` for one KV-cache group (host arrays; vLLM keeps device copies)."""

    query_start_loc: np.ndarray  # [num_reqs + 1] int32, batch_idx -> first flat token (tail: unpadded T)
    seq_lens: np.ndarray  # [num_reqs] int32, num_computed_tokens + query_len (padded rows 0)
    num_reqs: int  # n: R, or R_pad under a FULL graph
    num_actual_tokens: int  # T, or T_pad under a FULL graph
    max_query_len: int  # unpadded maximum query length
    max_seq_len: int  # max(seq_lens_cpu_upper_bound)
    block_table_tensor: np.ndarray  # [num_reqs, width] int32, batch_idx -> block ids (padded rows 0)
    slot_mapping: np.ndarray  # [num_slots] int64, flat token -> slot (PAD_SLOT_ID tail)
    is_prefilling: np.ndarray | None  # [num_reqs] (V1) or [R] (MRV2) bool, the row is still in its prompt
    seq_lens_cpu_upper_bound: np.ndarray  # [num_reqs] int32, host bound on seq_lens (padded rows 0)
    causal: bool = True


def _counts(desc: BatchDescriptor) -> tuple[int, int]:
    if desc.pad_attn:
        return desc.num_reqs_padded, desc.num_tokens_padded
    return desc.num_reqs, desc.num_tokens


def common_metadata_spec(runner: str, desc: BatchDescriptor, tails: PaddedTails, group: int,
                         num_computed_tokens, prompt_or_prefill_len, correction=None) -> CommonAttentionMetadata:
    """Scalar spec. `prompt_or_prefill_len` [R]: V1 num_prompt_tokens, MRV2 prefill_len; `correction` [R] or
    None: the rows' num_computed_tokens_correction (async spec decode)."""
    n, t = _counts(desc)
    R = desc.num_reqs
    qsl = [int(tails.query_start_loc[b]) for b in range(n + 1)]
    sl = [int(tails.seq_lens[b]) for b in range(n)]
    rows = R if runner == "mrv2" else n
    pre = [b < R and int(num_computed_tokens[b]) < int(prompt_or_prefill_len[b]) for b in range(rows)]
    max_q = max(qsl[b + 1] - qsl[b] for b in range(R))
    up = [sl[b] + (int(correction[b]) if runner == "mrv2" and correction is not None and b < R else 0)
          for b in range(n)]
    return CommonAttentionMetadata(
        np.array(qsl, dtype=np.int32), np.array(sl, dtype=np.int32), n, t, max_q, max(up),
        tails.block_tables[group][:n], tails.slot_mapping[group], np.array(pre, dtype=bool),
        np.array(up, dtype=np.int32))


def common_metadata(runner: str, desc: BatchDescriptor, tails: PaddedTails, group: int,
                    num_computed_tokens: np.ndarray, prompt_or_prefill_len: np.ndarray,
                    correction: np.ndarray | None = None) -> CommonAttentionMetadata:
    """The entry point per step and group (numpy form). `tails`: the step's `padded_tails.pad_tails`;
    num_computed_tokens [R] int32; prompt_or_prefill_len [R] int32 (V1: num_prompt_tokens, MRV2: prefill_len);
    correction [R] int32 or None (async spec decode)."""
    n, t = _counts(desc)
    R = desc.num_reqs
    qsl = tails.query_start_loc[: n + 1]
    sl = tails.seq_lens[:n]
    if runner == "mrv2":
        pre = num_computed_tokens[:R] < prompt_or_prefill_len[:R]
    else:
        pre = np.zeros(n, dtype=bool)
        np.less(num_computed_tokens[:R], prompt_or_prefill_len[:R], out=pre[:R])
    max_q = int((qsl[1: R + 1] - qsl[:R]).max())
    up = upper_bound(runner, sl, R, correction)
    return CommonAttentionMetadata(qsl, sl, n, t, max_q, int(up.max()), tails.block_tables[group][:n],
                                   tails.slot_mapping[group], pre, up)


def upper_bound(runner: str, seq_lens: np.ndarray, R: int, correction: np.ndarray | None) -> np.ndarray:
    """[n] seq_lens_cpu_upper_bound (numpy form): `seq_lens` itself unless MRV2 rows carry a correction."""
    if runner != "mrv2" or correction is None:
        return seq_lens
    up = seq_lens.copy()
    up[:R] += correction[:R]
    return up


# ------------------------------------------------------------------------------------------ thresholds

@dataclass(frozen=True, slots=True)
class BackendRules:
    """A builder's reorder rule: base threshold (None: no reordering, no split), whether spec tokens count as
    decodes, whether DCP keeps a varlen threshold, whether decodes must be uniform."""

    threshold: int | None
    spec_as_decode: bool
    dcp_varlen: bool
    require_uniform: bool


BACKENDS: dict[str, BackendRules] = {  # vLLM's AttentionBackendEnum names
    "FLASH_ATTN": BackendRules(None, False, False, False),  # flash_attn.py: no reorder_batch_threshold
    "TRITON_ATTN": BackendRules(None, False, False, False),  # triton_attn.py: none either
    "FLASHINFER": BackendRules(1, False, False, True),  # flashinfer.py 1054: see `flashinfer_decode`
    "FLASHMLA": BackendRules(128, True, False, True),  # mla/flashmla.py 111-112: UNIFORM
    "TRITON_MLA": BackendRules(1, True, False, True),  # mla/triton_mla.py 78: UNIFORM, MLA base 1
    "FLASH_ATTN_MLA": BackendRules(512, True, True, False),  # mla/flashattn_mla.py 128-145: VARLEN
    "FLASHINFER_MLA": BackendRules(1, True, True, False),  # mla/flashinfer_mla.py 141, 168: VARLEN
}
FLASHINFER_DECODE = ("native", "fa2_native", "xqa", "trtllm_gen", "trtllm_gen_varlen")


def _rules(backend: str, flashinfer_decode: str) -> BackendRules:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; known: {', '.join(BACKENDS)}")
    r = BACKENDS[backend]
    if backend == "FLASHINFER":
        assert flashinfer_decode in FLASHINFER_DECODE, flashinfer_decode
        r = BackendRules(1, flashinfer_decode != "native", False,
                         flashinfer_decode not in ("xqa", "trtllm_gen_varlen"))
    return r


def reorder_batch_threshold(backend: str, num_speculative_tokens: int = 0, dcp_size: int = 1, *,
                            runner: str = "mrv2", parallel_drafting: bool = False,
                            flashinfer_decode: str = "native", cp_kv_cache_interleave_size: int = 1) -> int | None:
    """The builder's `reorder_batch_threshold` after `_init_reorder_batch_threshold`."""
    r = _rules(backend, flashinfer_decode)
    t = r.threshold
    if t is not None and r.spec_as_decode and num_speculative_tokens > 0:
        widest = 1 + num_speculative_tokens * (2 if parallel_drafting and runner == "v1" else 1)
        t = max(t, widest)
    dcp_varlen = r.dcp_varlen and (backend != "FLASH_ATTN_MLA" or cp_kv_cache_interleave_size == 1)
    if dcp_size > 1 and not dcp_varlen:
        t = 1
    return t


def require_uniform(backend: str, flashinfer_decode: str = "native") -> bool:
    return _rules(backend, flashinfer_decode).require_uniform


# ------------------------------------------------------------------------------------------ split

@dataclass(slots=True)  # a step's result: not frozen (inputs.py)
class Split:
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int
    num_extends: int = 0  # split_decodes_prefills_and_extends only
    num_extend_tokens: int = 0


def split_decodes_and_prefills_spec(query_start_loc, num_reqs: int, num_actual_tokens: int, max_query_len: int,
                                    decode_threshold: int = 1, require_uniform: bool = False,
                                    treat_short_extends_as_decodes: bool = True, is_prefilling=None) -> Split:
    """Scalar spec of `split_decodes_and_prefills` over query_start_loc [num_reqs + 1]."""
    T = num_actual_tokens
    if max_query_len <= decode_threshold and (not require_uniform or decode_threshold <= 1) \
            and treat_short_extends_as_decodes:
        return Split(num_reqs, 0, T, 0)
    q = [int(query_start_loc[b + 1]) - int(query_start_loc[b]) for b in range(num_reqs)]
    if q[0] > decode_threshold:
        return Split(0, num_reqs, 0, T)
    if require_uniform:
        if treat_short_extends_as_decodes and all(x == q[0] or x == 0 for x in q):
            return Split(num_reqs, 0, T, 0)
        prefill = [x != q[0] and x != 0 for x in q]
    else:
        prefill = [x > decode_threshold for x in q]
    if not treat_short_extends_as_decodes:
        prefill = [p or bool(is_prefilling[b]) for b, p in enumerate(prefill)]
    for b in range(num_reqs):
        if prefill[b]:
            d = int(query_start_loc[b])
            return Split(b, num_reqs - b, d, T - d)
    return Split(num_reqs, 0, T, 0)


def split_decodes_and_prefills(query_start_loc: np.ndarray, num_reqs: int, num_actual_tokens: int,
                               max_query_len: int, decode_threshold: int = 1, require_uniform: bool = False,
                               treat_short_extends_as_decodes: bool = True,
                               is_prefilling: np.ndarray | None = None) -> Split:
    """numpy form of `split_decodes_and_prefills`."""
    T = num_actual_tokens
    if max_query_len <= decode_threshold and (not require_uniform or decode_threshold <= 1) \
            and treat_short_extends_as_decodes:
        return Split(num_reqs, 0, T, 0)
    q = np.diff(query_start_loc[: num_reqs + 1])
    if q[0] > decode_threshold:
        return Split(0, num_reqs, 0, T)
    if require_uniform:
        if treat_short_extends_as_decodes and ((q == q[0]) | (q == 0)).all():
            return Split(num_reqs, 0, T, 0)
        prefill = (q != q[0]) & (q != 0)
    else:
        prefill = q > decode_threshold
    if not treat_short_extends_as_decodes:
        prefill |= is_prefilling[:num_reqs]
    if not prefill.any():
        return Split(num_reqs, 0, T, 0)
    b = int(prefill.argmax())
    d = int(query_start_loc[b])
    return Split(b, num_reqs - b, d, T - d)


def split_decodes_prefills_and_extends_spec(query_start_loc, seq_lens_cpu_upper_bound, num_reqs: int,
                                            num_actual_tokens: int, max_query_len: int,
                                            decode_threshold: int = 1) -> Split:
    """Scalar spec of `split_decodes_prefills_and_extends`."""
    T = num_actual_tokens
    if max_query_len <= decode_threshold:
        return Split(num_reqs, 0, T, 0)
    q = [int(query_start_loc[b + 1]) - int(query_start_loc[b]) for b in range(num_reqs)]
    ext = [x > decode_threshold for x in q]
    pre = [ext[b] and int(seq_lens_cpu_upper_bound[b]) == q[b] for b in range(num_reqs)]
    first_ext = next((b for b in range(num_reqs) if ext[b]), 0)
    first_pre = next((b for b in range(num_reqs) if pre[b]), 0)
    d_tok = int(query_start_loc[first_ext])
    if not any(ext):
        return Split(first_ext, 0, d_tok, 0)
    if not any(pre):
        return Split(first_ext, 0, d_tok, 0, num_reqs - first_ext, T - d_tok)
    p_tok = T - int(query_start_loc[first_pre])
    return Split(first_ext, num_reqs - first_pre, d_tok, p_tok, first_pre - first_ext, T - d_tok - p_tok)


def split_decodes_prefills_and_extends(query_start_loc: np.ndarray, seq_lens_cpu_upper_bound: np.ndarray,
                                       num_reqs: int, num_actual_tokens: int, max_query_len: int,
                                       decode_threshold: int = 1) -> Split:
    """numpy form of `split_decodes_prefills_and_extends`."""
    T = num_actual_tokens
    if max_query_len <= decode_threshold:
        return Split(num_reqs, 0, T, 0)
    q = np.diff(query_start_loc[: num_reqs + 1])
    ext = q > decode_threshold
    pre = (seq_lens_cpu_upper_bound[:num_reqs] == q) & ext
    first_ext, first_pre = int(ext.argmax()), int(pre.argmax())
    d_tok = int(query_start_loc[first_ext])
    if not ext.any():
        return Split(first_ext, 0, d_tok, 0)
    if not pre.any():
        return Split(first_ext, 0, d_tok, 0, num_reqs - first_ext, T - d_tok)
    p_tok = T - int(query_start_loc[first_pre])
    return Split(first_ext, num_reqs - first_pre, d_tok, p_tok, first_pre - first_ext, T - d_tok - p_tok)


def split(cm: CommonAttentionMetadata, backend: str, num_speculative_tokens: int = 0, dcp_size: int = 1, *,
          runner: str = "mrv2", flashinfer_decode: str = "native") -> Split | None:
    """The entry point: the group's split as its backend's builder makes it (None: the backend does not split)."""
    t = reorder_batch_threshold(backend, num_speculative_tokens, dcp_size, runner=runner,
                                flashinfer_decode=flashinfer_decode)
    if t is None:
        return None
    return split_decodes_and_prefills(cm.query_start_loc, cm.num_reqs, cm.num_actual_tokens, cm.max_query_len, t,
                                      require_uniform(backend, flashinfer_decode))
