"""`kvmap explain`'s forward-pass section: the step's sampler indices (kvmap/forward) with their arithmetic.

Rules: plain data, as the rest of explain (the renderer draws it); each request's line states the rule of its
runner with this step's numbers, so that a reader can redo it by hand (docs/trace-format.md, "Forward-pass dump
keys"); the arrays themselves are the dump's keys under vLLM's names.
"""

from __future__ import annotations

from kvmap.forward.config import ForwardConfig
from kvmap.forward.inputs import ForwardInputs, ForwardStep
from kvmap.forward.sampler import NUM_NEW_SAMPLED_TOKENS, STALE_INPUT_ID, mrv2_input_ids_spec


def forward_dict(config: ForwardConfig, fwd: ForwardInputs, m, step: ForwardStep) -> dict:
    """{runner, cudagraph_mode, skipped, sampler: {arrays..., rows: [one line of arithmetic per request]}}."""
    s = fwd.sampler
    qsl = m.query_start_loc.tolist()
    out = {"runner": config.runner, "cudagraph_mode": config.cudagraph_mode,
           "attention_backends": [g.attention_backend for g in config.groups], "skipped": list(config.skipped),
           "sampler": s.to_dict()}
    rows = []
    r = step.rows
    if config.runner == "mrv2":
        last = step.last_sampled_tokens()
        cu = s.cu_num_logits.tolist()
        for b, req_id in enumerate(m.req_ids):
            n = cu[b + 1] - cu[b]
            line = (f"{req_id}: num_logits = {n - NUM_NEW_SAMPLED_TOKENS} drafts + {NUM_NEW_SAMPLED_TOKENS} = "
                    f"{n}; logits_indices[{cu[b]}:{cu[b + 1]}] = query_start_loc[{b + 1}] - {n} + j = "
                    f"{qsl[b + 1]} - {n} + 0..{n - 1} = {list(range(qsl[b + 1] - n, qsl[b + 1]))}")
            row = int(m.idx_mapping[b])
            seq, pre = int(r.seq_lens[b]), int(r.prefill_len[row])
            if seq <= pre:
                line += f"; input ids: prefill tokens (seq_len {seq} <= prefill_len {pre})"
            else:
                if seq - n >= pre:
                    line += f"; input_ids[{qsl[b + 1] - n}] = last_sampled_tokens[{row}] = {int(last[row])}"
                if n > NUM_NEW_SAMPLED_TOKENS:
                    line += f"; drafts at input_ids[{qsl[b + 1] - n + 1}:{qsl[b + 1]}]"
            rows.append(line)
        ids = mrv2_input_ids_spec(r, last)
        stale = [int(i) for i in (ids == STALE_INPUT_ID).nonzero()[0]]
        out["sampler"]["stale_input_ids"] = stale  # flat tokens neither MRV2 kernel writes (none in vLLM traces)
    else:
        for b, req_id in enumerate(m.req_ids):
            if s.num_draft_tokens is None:
                rows.append(f"{req_id}: logits_indices[{b}] = query_start_loc[{b + 1}] - 1 = {qsl[b + 1] - 1}")
                continue
            d = int(s.num_draft_tokens[b])
            cs = int(s.cu_num_sampled_tokens[b])
            rows.append(f"{req_id}: {d} drafts + 1 bonus = {d + 1} sampled rows; logits_indices = "
                        f"query_start_loc[{b + 1}] - {d + 1} + j = {list(range(qsl[b + 1] - d - 1, qsl[b + 1]))}; "
                        f"bonus_logits_indices[{b}] = cu_num_sampled_tokens[{b}] - 1 = {cs - 1}; "
                        f"num_decode_draft_tokens = {int(s.num_decode_draft_tokens[b])}")
    out["sampler"]["rows"] = rows
    return out
