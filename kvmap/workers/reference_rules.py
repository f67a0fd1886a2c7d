"""Rules the reference worker judges that need more than a line: each raises the located `TraceError` the host
workers raise for the same input (workers/state.py), so the differential tests can compare kinds, steps,
requests and groups.
"""

from __future__ import annotations

from kvmap.errors import TraceError
from kvmap.trace import Step, TraceHeader


def located(step: Step, req_id: str, message: str, field: str, kind: str, group: int | None = None) -> TraceError:
    """The error for one request of one step (file line, step, request, group, field, kind)."""
    return TraceError(message, line=step.line, step=step.step, req_id=req_id, group=group, field=field, kind=kind)


def check_continuation(h: TraceHeader, step: Step, nr, held) -> None:
    """num_computed_tokens leaves the held tokens' last one out, the new prompt's first num_computed_tokens
    tokens are the held ones, and every held block stays at its logical index (or turns into the null block,
    outside full attention)."""
    new, nc = nr.token_ids, nr.num_computed_tokens
    field = "prefill_token_ids" if nr.prefill_token_ids is not None else "prompt_token_ids"
    if nc > len(held.tokens) - 1:
        raise located(step, nr.req_id, f"num_computed_tokens {nc} passes the {len(held.tokens) - 1} tokens "
                      "the request kept", "num_computed_tokens", "continuation_mismatch")
    keep = nc
    if len(new) < keep:
        raise located(step, nr.req_id, f"a continuation of {len(new)} tokens is shorter than the {keep} it "
                      "keeps", field, "continuation_mismatch")
    for p in range(keep):
        if new[p] != held.tokens[p]:
            raise located(step, nr.req_id, f"position {p} holds token {new[p]}, but the request held "
                          f"{held.tokens[p]} there (a continuation keeps its first {keep} tokens)", field,
                          "continuation_mismatch")
    null = h.null_block_id if h.null_block_id is not None else 0
    for g, (ids, old) in enumerate(zip(nr.block_ids, held.block_ids)):
        if len(ids) < len(old):
            raise located(step, nr.req_id, f"{len(ids)} blocks drop the {len(old)} the request held",
                          "block_ids", "continuation_mismatch", group=g)
        for j, b in enumerate(old):
            stale = ids[j] == null and h.kv_cache_groups[g].kind != "full_attention"
            if ids[j] != b and not stale:
                raise located(step, nr.req_id, f"logical block {j} is {ids[j]}, but the request held block "
                              f"{b} there", "block_ids", "continuation_mismatch", group=g)
