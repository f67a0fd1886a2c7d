"""CUDA-graph dispatch of one step under data parallelism, from every DP rank's counts of the step.

Rules (issue 26 forward-pass notes, section 4.4; no microbatching):
- MRV2 (`sync_cudagraph_and_dp_padding`, vllm/v1/worker/gpu/dp_utils.py): the ranks all-reduce their unpadded
  token counts, desired graph modes, uniform token counts and request counts; no tokens anywhere: no step;
  any rank NONE: every rank runs eager, unpadded; else every rank dispatches the largest token count with the
  uniform count all ranks agree on (None when they differ) and its own request count.
- V1 (`coordinate_batch_across_dp` + `_determine_batch_execution_and_padding`): the ranks all-reduce their
  unpadded and padded counts and modes; the agreed mode is the least; not NONE: every rank pads to the largest
  padded count and dispatches it with only the agreed mode allowed; NONE: every rank runs eager at its own
  padded count.
- A scalar spec only (a step has a handful of ranks); held against vLLM's own functions by tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmap.forward.cudagraph import BatchDescriptor, check, dispatch_spec, mrv2_rule, v1_rule

__all__ = ["RankBatch", "dp_dispatch_spec"]


@dataclass(frozen=True, slots=True)
class RankBatch:
    """One DP rank's step as its dispatch sees it."""

    num_reqs: int
    num_tokens: int
    max_query_len: int
    decode_eligible: bool = True  # MRV2's decode_graph_eligible


_MODE_VALUE = {"NONE": 0, "PIECEWISE": 1, "FULL": 2}


def dp_dispatch_spec(runner: str, mode: str, capture_sizes: list[int], max_num_seqs: int,
                     num_speculative_tokens: int, ranks: list[RankBatch], dp_rank: int) -> BatchDescriptor | None:
    """Rank `dp_rank`'s descriptor after the all-reduce (None: no rank has tokens, MRV2 skips the step)."""
    check(runner, mode)
    sizes, q = sorted(capture_sizes), 1 + num_speculative_tokens
    own = [dispatch_spec(runner, mode, sizes, max_num_seqs, num_speculative_tokens, r.num_reqs, r.num_tokens,
                         r.max_query_len, r.decode_eligible) for r in ranks]
    me, mine = ranks[dp_rank], own[dp_rank]
    synced = min(own, key=lambda d: _MODE_VALUE[d.cudagraph_mode]).cudagraph_mode
    if runner == "v1":
        if synced == "NONE":
            return BatchDescriptor("NONE", me.num_tokens, me.num_reqs, mine.num_tokens_padded, me.num_reqs,
                                   mine.uniform_decode)
        t = max(d.num_tokens_padded for d in own)
        m, t_pad, r_pad = v1_rule(mode, sizes, max_num_seqs, q, t, mine.uniform_decode, (synced,))
        assert t_pad == t, "vLLM asserts the re-dispatch keeps the agreed token count"
        return BatchDescriptor(m, me.num_tokens, me.num_reqs, t_pad, me.num_reqs if r_pad is None else r_pad,
                               mine.uniform_decode)
    if all(r.num_tokens == 0 for r in ranks):
        return None
    if synced == "NONE":
        return BatchDescriptor("NONE", me.num_tokens, me.num_reqs, me.num_tokens, me.num_reqs, mine.uniform_decode)
    counts = [r.max_query_len if d.uniform_decode else None for r, d in zip(ranks, own)]
    count = counts[0] if counts[0] is not None and all(c == counts[0] for c in counts) else None
    t = max(r.num_tokens for r in ranks)
    m, t_pad, r_pad = mrv2_rule(mode, sizes, max_num_seqs, q, me.num_reqs, t, count)
    return BatchDescriptor(m, me.num_tokens, me.num_reqs, max(me.num_tokens, t_pad),
                           me.num_reqs if r_pad is None else r_pad, count is not None)
