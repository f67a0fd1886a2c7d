"""The shadow model's rule for streaming-input continuations: a live request sent again as new.

Rules (vLLM 0.33: `Scheduler._update_request_as_session`; docs/trace-format.md, Continuations): when a turn of a
resumable session ends, the scheduler keeps the request's tokens but the turn's last sampled one
(`keep_end = num_tokens - 1`), appends the next chunk, keeps `num_computed_tokens` and its blocks. A stop rolls
`num_computed_tokens` back to `num_tokens - 1` (tokens sampled past the stop are trimmed, so the worker may
hold more than the scheduler kept), and under async scheduling the turn's in-flight outputs are dropped: what
the worker can hold the continuation to is its first `num_computed_tokens` tokens (`keep_end >=
num_computed_tokens`, the scheduler asserts it). So: `num_computed_tokens` leaves the held tokens' last one
out (and, without outputs in flight, is at most what was computed), those tokens are the held ones, and each
group's new row starts with the held row; outside full attention the null block may stand where the row kept
an id the scheduler freed out of the window. `self` is the `shadow.Validator`; one `continuation_mismatch`
per continuation, its first misfit named, in the workers' order (workers/state.py `_check_continuation`).
"""

from __future__ import annotations

from kvmap.trace import Step


def misfit(h, held_tokens: list[int], held_blocks: list[list[int]], expected_nc: int | None, nr
           ) -> tuple[str, str, int | None] | None:
    """(message, field, group) of the first way `nr` does not continue what the request held, or None."""
    new, nc = nr.token_ids, nr.num_computed_tokens
    field = "prefill_token_ids" if nr.prefill_token_ids is not None else "prompt_token_ids"
    kept = len(held_tokens) - 1
    if nc > kept:
        return f"num_computed_tokens {nc} passes the {kept} tokens the request kept", "num_computed_tokens", None
    in_flight = h.async_scheduling or h.max_concurrent_batches > 1
    if expected_nc is not None and not in_flight and nc > expected_nc:
        return f"num_computed_tokens {nc} but only {expected_nc} were computed", "num_computed_tokens", None
    keep = nc  # the scheduler keeps `num_tokens - 1 >= num_computed_tokens` of its tokens
    if len(new) < keep:
        return f"a continuation of {len(new)} tokens is shorter than the {keep} it keeps", field, None
    if new[:keep] != held_tokens[:keep]:
        j = next(p for p in range(keep) if new[p] != held_tokens[p])
        return (f"position {j} holds token {new[j]}, but the request held {held_tokens[j]} there (a continuation "
                f"keeps its first {keep} tokens)", field, None)
    null = h.null_block_id if h.null_block_id is not None else 0
    for g, (ids, old) in enumerate(zip(nr.block_ids, held_blocks)):
        if len(ids) < len(old):
            return f"{len(ids)} blocks drop the {len(old)} the request held", "block_ids", g
        full = h.kv_cache_groups[g].kind == "full_attention"
        for j, b in enumerate(old):
            if ids[j] != b and (full or ids[j] != null):
                return f"logical block {j} is {ids[j]}, but the request held block {b} there", "block_ids", g
    return None


def check(self, step: Step, nr) -> None:
    """Name the first misfit of continuation `nr` (its request is live and certain)."""
    req = self.reqs[nr.req_id]
    bad = misfit(self.h, req.tokens, req.blocks, req.expected_nc, nr)
    if bad is not None:
        message, field, group = bad
        self.add("continuation_mismatch", message, step, req_id=nr.req_id, group=group, field=field)
