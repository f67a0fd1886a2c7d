"""Item 1 of the forward pass: the sampler-side indices of one step, per runner, under vLLM 0.33's names.

Rules (docs/trace-format.md, "Forward-pass dump keys"; the vLLM 0.33 source of each is named at its function):
- Model Runner V2 (`prepare_inputs`, vllm/v1/worker/gpu/model_runner.py:1388-1593): request b of the batch
  samples `num_logits_b = d_b + S` rows (d_b drafts, S = 1 new sampled token), placed at the END of its query:
  `logits_indices = qsl[b+1] - num_logits_b + j`, j < num_logits_b (int64); `cu_num_logits` is their cumulative
  count from 0 (int32); `expanded_idx_mapping` repeats `idx_mapping[b]` (int64) and `expanded_local_pos` is j
  (int32). Without drafts that is `arange(R + 1)`, `idx_mapping`, zeros.
- MRV2 input ids (`prepare_prefill_inputs` + `_combine_sampled_and_draft_tokens_kernel`, vllm/v1/worker/gpu/
  input_batch.py:414-513): positions before `prefill_len` are copied from the request's prefill tokens; for a
  request past its prefill (`seq_len > prefill_len`) the first logit row gets `last_sampled_tokens[row]` when
  its position `seq_len - num_logits >= prefill_len`, and the last d_b rows get the drafts. Any other position
  is not written this step: MRV2 would read a stale id there, which the result marks -1 (`STALE_INPUT_ID`).
  kvmap's token rows already hold what that rewrite writes, so it is not part of the timed phase (nor of the
  dump): `mrv2_input_ids_*` compute it for `explain` and the tests, which hold it to kvmap's input ids.
- V1 (`_prepare_inputs`, vllm/v1/worker/gpu_model_runner.py:2188-2235): without a speculative config
  `logits_indices = qsl[1:] - 1` (int32). With one (num_speculative_tokens > 0, drafts this step or not)
  `SpecDecodeMetadata` from `_calc_spec_decode_metadata` (2591-2664): with n_b = d_b + 1,
  `cu_num_sampled_tokens = cumsum(n)`, `logits_indices = qsl[b+1] - n_b + j` (int64), `cu_num_draft_tokens =
  cumsum(d)`, `target_logits_indices = cu_num_sampled_b - n_b + j` for j < d_b, `bonus_logits_indices =
  cu_num_sampled - 1`, `draft_token_ids = input_ids[logits_indices][target_logits_indices + 1]`; and
  `num_decode_draft_tokens`: d_b when q_b == d_b + 1, else 0 when q_b == 1 and the request is past its prompt
  (`num_computed >= num_prompt_tokens`), else -1.
- Two forms, held bit for bit to each other by tests/test_forward_sampler.py: `*_spec` (plain Python loops,
  the reference worker's) and `*_numpy` (whole-array operations into `SamplerBuffers`, the host workers').
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STALE_INPUT_ID = -1  # MRV2 input ids: a position neither the prefill copy nor the combine kernel writes
NUM_NEW_SAMPLED_TOKENS = 1  # S: model_state.num_new_sampled_tokens_per_step (0 only for diffusion models)


@dataclass(slots=True)
class SamplerRows:
    """What the sampler rules read of one step, in batch order (host arrays, views valid for the step)."""

    idx_mapping: np.ndarray  # [R] int32, batch_idx -> req_state_idx
    query_start_loc: np.ndarray  # [R + 1] int32, batch_idx -> first flat token index
    seq_lens: np.ndarray  # [R] int32, num_computed_tokens + num_scheduled_tokens
    num_computed_tokens: np.ndarray  # [R] int32, batch_idx -> position of its first token
    num_draft_tokens: np.ndarray  # [R] int32, batch_idx -> drafts among its scheduled tokens
    # per request-state row, as vLLM keeps them (indexed through idx_mapping)
    prefill_len: np.ndarray  # [max_num_seqs] int32, req_state_idx -> MRV2 req_states.prefill_len
    num_prompt_tokens: np.ndarray  # [max_num_seqs] int32, req_state_idx -> V1 input_batch.num_prompt_tokens
    input_ids: np.ndarray  # [T] int32, flat token -> token id (drafts staged at their positions)
    has_drafts: bool = True  # the step schedules drafts (scheduled_spec_decode_tokens non-empty): MRV2's test
    # [R] int32 or None, batch_idx -> how far the scheduler's num_computed_tokens is above the worker's (async
    # spec decode's num_computed_tokens_correction; None: no row's is)
    num_computed_tokens_correction: np.ndarray | None = None


def corrections(step, batch_req_ids) -> np.ndarray | None:
    """[R] int32 batch_idx -> the request's num_computed_tokens_correction this step (async spec decode), or None
    when the step carries none (`step`: the trace's Step; `batch_req_ids`: () -> the ids in batch order, called
    only then)."""
    a = step.async_spec if step is not None else None
    corr = a.num_computed_tokens_correction if a is not None else None
    if not corr:
        return None
    return np.array([corr.get(r, 0) for r in batch_req_ids()], dtype=np.int32)


@dataclass(slots=True)
class MRV2Sampler:
    cu_num_logits: np.ndarray  # [R + 1] int32, batch_idx -> first logits row
    logits_indices: np.ndarray  # [L] int64, logits row -> flat token index
    expanded_idx_mapping: np.ndarray  # [L] int64, logits row -> req_state_idx
    expanded_local_pos: np.ndarray  # [L] int32, logits row -> its index within the request's rows

    def to_dict(self) -> dict:
        return {"cu_num_logits": self.cu_num_logits.tolist(), "logits_indices": self.logits_indices.tolist(),
                "expanded_idx_mapping": self.expanded_idx_mapping.tolist(),
                "expanded_local_pos": self.expanded_local_pos.tolist()}


@dataclass(slots=True)
class V1Sampler:
    logits_indices: np.ndarray  # [L] int32 without a spec config, int64 with one: logits row -> flat token
    # SpecDecodeMetadata (vllm/v1/spec_decode/metadata.py), None without a speculative config
    num_draft_tokens: np.ndarray | None = None  # [R] int32 (a list in vLLM), batch_idx -> drafts
    cu_num_draft_tokens: np.ndarray | None = None  # [R] int32, cumsum(num_draft_tokens), no leading 0
    cu_num_sampled_tokens: np.ndarray | None = None  # [R] int32, cumsum(num_draft_tokens + 1)
    target_logits_indices: np.ndarray | None = None  # [sum d] int32, draft -> its logits row
    bonus_logits_indices: np.ndarray | None = None  # [R] int32, batch_idx -> its bonus logits row
    draft_token_ids: np.ndarray | None = None  # [sum d] int32, draft -> token id
    num_decode_draft_tokens: np.ndarray | None = None  # [R] int32, d, 0 (past-prompt 1-token step) or -1

    def to_dict(self) -> dict:
        d = {"logits_indices": self.logits_indices.tolist()}
        if self.num_draft_tokens is not None:
            for k in ("num_draft_tokens", "cu_num_draft_tokens", "cu_num_sampled_tokens", "target_logits_indices",
                      "bonus_logits_indices", "draft_token_ids", "num_decode_draft_tokens"):
                d[k] = getattr(self, k).tolist()
        return d


# ------------------------------------------------------------------------------------ the scalar spec


def mrv2_spec(r: SamplerRows) -> MRV2Sampler:
    """Model Runner V2's sampler indices, one request and one row at a time."""
    R = len(r.idx_mapping)
    qsl = [int(x) for x in r.query_start_loc]
    cu, logits, exp_idx, exp_pos = [0], [], [], []
    for b in range(R):
        n = int(r.num_draft_tokens[b]) + NUM_NEW_SAMPLED_TOKENS
        assert qsl[b + 1] - qsl[b] >= n, "MRV2 asserts num_scheduled_tokens >= num_logits"
        cu.append(cu[-1] + n)
        for j in range(n):
            logits.append(qsl[b + 1] - n + j)
            exp_idx.append(int(r.idx_mapping[b]))
            exp_pos.append(j)
    return MRV2Sampler(np.array(cu, np.int32), np.array(logits, np.int64), np.array(exp_idx, np.int64),
                       np.array(exp_pos, np.int32))


def mrv2_input_ids_spec(r: SamplerRows, last_sampled_tokens: np.ndarray) -> np.ndarray:
    """[T] int32: MRV2's input ids after `prepare_prefill_inputs` and the combine kernel, STALE_INPUT_ID where
    neither writes. `last_sampled_tokens`: [max_num_seqs] req_state_idx -> the request's last sampled id."""
    qsl = [int(x) for x in r.query_start_loc]
    ids = [int(x) for x in r.input_ids]
    for b in range(len(r.idx_mapping)):
        row = int(r.idx_mapping[b])
        nc, seq, pre = int(r.num_computed_tokens[b]), int(r.seq_lens[b]), int(r.prefill_len[row])
        d = int(r.num_draft_tokens[b])
        n = d + NUM_NEW_SAMPLED_TOKENS
        if seq <= pre:
            continue  # every position is a prefill token (copied from the request's prefill tokens)
        for i in range(qsl[b], qsl[b + 1]):
            if nc + i - qsl[b] >= pre:
                ids[i] = STALE_INPUT_ID  # not a prefill token: only the combine kernel may write it
        if seq - n >= pre:
            ids[qsl[b + 1] - n] = int(last_sampled_tokens[row])
        for j in range(d):
            i = qsl[b + 1] - d + j
            ids[i] = int(r.input_ids[i])  # the drafts, which kvmap stages at their positions
    return np.array(ids, np.int32)


def v1_spec(r: SamplerRows, num_speculative_tokens: int) -> V1Sampler:
    """The V1 runner's sampler indices, one request and one row at a time."""
    R = len(r.idx_mapping)
    qsl = [int(x) for x in r.query_start_loc]
    if num_speculative_tokens == 0:
        return V1Sampler(np.array([qsl[b + 1] - 1 for b in range(R)], np.int32))
    d = [int(x) for x in r.num_draft_tokens]
    cu_d, cu_s, logits, target, bonus, decode = [], [], [], [], [], []
    td = ts = 0
    for b in range(R):
        n = d[b] + 1
        td, ts = td + d[b], ts + n
        cu_d.append(td)
        cu_s.append(ts)
        logits.extend(qsl[b + 1] - n + j for j in range(n))
        target.extend(ts - n + j for j in range(d[b]))
        bonus.append(ts - 1)
        q = qsl[b + 1] - qsl[b]
        if d[b] and q == d[b] + 1:
            decode.append(d[b])
        elif q == 1 and int(r.num_computed_tokens[b]) >= int(r.num_prompt_tokens[int(r.idx_mapping[b])]):
            decode.append(0)
        else:
            decode.append(-1)
    sampled_ids = [int(r.input_ids[i]) for i in logits]
    drafts = [sampled_ids[t + 1] for t in target]
    return V1Sampler(np.array(logits, np.int64), np.array(d, np.int32), np.array(cu_d, np.int32),
                     np.array(cu_s, np.int32), np.array(target, np.int32), np.array(bonus, np.int32),
                     np.array(drafts, np.int32), np.array(decode, np.int32))


# ------------------------------------------------------------------------------------ the numpy form


class SamplerBuffers:
    """Preallocated outputs: R = max_num_seqs rows, L = R * (1 + k) logits rows, T tokens."""

    def __init__(self, max_num_reqs: int, num_speculative_tokens: int, max_num_tokens: int) -> None:
        R, L = max_num_reqs, max_num_reqs * (1 + num_speculative_tokens)
        self.arange = np.arange(max(L, R + 1, max_num_tokens), dtype=np.int64)  # 0, 1, 2, ...
        self.arange_i32 = np.arange(R + 1, dtype=np.int32)  # [R + 1] MRV2's cu_num_logits without drafts
        self.cu_num_logits = np.zeros(R + 1, np.int32)  # [R + 1]
        self.num_logits = np.zeros(R, np.int32)  # [R]
        self.logits_indices = np.zeros(L, np.int64)  # [L]
        self.logits_indices_i32 = np.zeros(R, np.int32)  # [R] V1 without a spec config
        self.expanded_idx_mapping = np.zeros(L, np.int64)  # [L]
        self.expanded_local_pos = np.zeros(L, np.int32)  # [L]
        self.zeros = np.zeros(R, np.int32)  # [R] MRV2's local positions without drafts (never written)
        self.input_ids = np.zeros(max_num_tokens, np.int32)  # [T] MRV2's rewritten input ids
        self.cu_num_draft_tokens = np.zeros(R, np.int32)  # [R]
        self.cu_num_sampled_tokens = np.zeros(R, np.int32)  # [R]
        self.target_logits_indices = np.zeros(max(L - R, 0), np.int32)  # [R * k]
        self.bonus_logits_indices = np.zeros(R, np.int32)  # [R]
        self.draft_token_ids = np.zeros(max(L - R, 0), np.int32)  # [R * k]
        self.num_decode_draft_tokens = np.zeros(R, np.int32)  # [R]
        self.arange_i32.flags.writeable = self.zeros.flags.writeable = False  # handed out as results: never written


def _expand(buf: SamplerBuffers, R: int, counts: np.ndarray, cu: np.ndarray, L: int) -> np.ndarray:
    """[L] j within each request's rows, for `counts` [R] with `cu` [R + 1] = [0, cumsum(counts)]."""
    return buf.arange[:L] - np.repeat(cu[:R], counts)


def mrv2_numpy(r: SamplerRows, buf: SamplerBuffers) -> MRV2Sampler:
    """`mrv2_spec` as whole-array operations into `buf`."""
    R = len(r.idx_mapping)
    qsl, d = r.query_start_loc, r.num_draft_tokens
    if not r.has_drafts:  # MRV2's fast path: one logit per request (model_runner.py:1414-1421)
        logits = buf.logits_indices[:R]
        np.subtract(qsl[1:], 1, out=logits)
        exp_idx = buf.expanded_idx_mapping[:R]
        exp_idx[:] = r.idx_mapping
        return MRV2Sampler(buf.arange_i32[: R + 1], logits, exp_idx, buf.zeros[:R])
    cu = buf.cu_num_logits[: R + 1]
    n = buf.num_logits[:R]
    np.add(d, NUM_NEW_SAMPLED_TOKENS, out=n)
    cu[0] = 0
    np.cumsum(n, out=cu[1:])
    L = int(cu[R])
    j = _expand(buf, R, n, cu, L)
    logits = buf.logits_indices[:L]
    np.add(np.repeat(qsl[1:] - n, n), j, out=logits)
    exp_idx = buf.expanded_idx_mapping[:L]
    exp_idx[:] = np.repeat(r.idx_mapping, n)
    exp_pos = buf.expanded_local_pos[:L]
    exp_pos[:] = j
    return MRV2Sampler(cu, logits, exp_idx, exp_pos)


def mrv2_input_ids_numpy(r: SamplerRows, last_sampled_tokens: np.ndarray, buf: SamplerBuffers) -> np.ndarray:
    """`mrv2_input_ids_spec` as whole-array operations into `buf`."""
    T = len(r.input_ids)
    qsl, d, idx = r.query_start_loc, r.num_draft_tokens, r.idx_mapping
    ids = buf.input_ids[:T]
    np.copyto(ids, r.input_ids)
    pre = r.prefill_len[idx]
    past = np.flatnonzero(r.seq_lens > pre)  # requests the combine kernel rewrites
    if not len(past):
        return ids
    nl = d[past] + NUM_NEW_SAMPLED_TOKENS
    nc, qe = r.num_computed_tokens[past], qsl[past + 1]
    start = qsl[past] + np.maximum(pre[past] - nc, 0)  # first flat index at or past prefill_len
    width = qe - start
    rows = np.repeat(np.arange(len(past)), width)
    ids[buf.arange[: len(rows)] - np.repeat(np.cumsum(width) - width, width) + start[rows]] = STALE_INPUT_ID
    keep = r.seq_lens[past] - nl >= pre[past]
    ids[(qe - nl)[keep]] = last_sampled_tokens[idx[past[keep]]]
    nd = d[past]
    if nd.any():  # the drafts: the last d_b flat tokens of each request
        at = np.repeat(qe - nd, nd) + buf.arange[: int(nd.sum())] - np.repeat(np.cumsum(nd) - nd, nd)
        ids[at] = r.input_ids[at]
    return ids


def v1_no_spec(query_start_loc: np.ndarray, buf: SamplerBuffers) -> V1Sampler:
    """`v1_numpy` without a spec-decode config: each request's last token (reads only query_start_loc)."""
    logits = buf.logits_indices_i32[: len(query_start_loc) - 1]
    np.subtract(query_start_loc[1:], 1, out=logits)
    return V1Sampler(logits)


def v1_numpy(r: SamplerRows, num_speculative_tokens: int, buf: SamplerBuffers) -> V1Sampler:
    """`v1_spec` as whole-array operations into `buf`."""
    R = len(r.idx_mapping)
    qsl = r.query_start_loc
    if num_speculative_tokens == 0:
        return v1_no_spec(qsl, buf)
    d = r.num_draft_tokens
    n = buf.num_logits[:R]
    np.add(d, 1, out=n)
    cu_s = buf.cu_num_sampled_tokens[:R]
    np.cumsum(n, out=cu_s)
    cu_d = buf.cu_num_draft_tokens[:R]
    np.cumsum(d, out=cu_d)
    L = int(cu_s[-1]) if R else 0
    D = int(cu_d[-1]) if R else 0
    start = cu_s - n  # [R] each request's first logits row
    logits = buf.logits_indices[:L]
    np.add(np.repeat(qsl[1:] - n, n), buf.arange[:L] - np.repeat(start, n), out=logits)
    target = buf.target_logits_indices[:D]
    np.add(np.repeat(start, d), buf.arange[:D] - np.repeat(cu_d - d, d), out=target)
    bonus = buf.bonus_logits_indices[:R]
    np.subtract(cu_s, 1, out=bonus)
    drafts = buf.draft_token_ids[:D]
    np.take(r.input_ids, logits[target + 1], out=drafts)
    q = np.diff(qsl)
    dec = buf.num_decode_draft_tokens[:R]
    dec.fill(-1)
    dec[(q == 1) & (r.num_computed_tokens >= r.num_prompt_tokens[r.idx_mapping])] = 0
    full = (d > 0) & (q == d + 1)
    dec[full] = d[full]
    return V1Sampler(logits, d, cu_d, cu_s, target, bonus, drafts, dec)
