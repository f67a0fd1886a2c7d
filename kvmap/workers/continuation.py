"""The streaming-input continuation rule of the host workers' state: a live request sent again in
`scheduled_new_reqs` must extend what it held (docs/trace-format.md, "Continuations (streaming input)").

Rules: this is the vectorized form over `WorkerState`'s arrays; the reference worker (reference.py) holds the
scalar form and validate (validate/continuation.py) its independent model, and the differential tests hold
all three to the same refusals (kind `continuation_mismatch`, the same step, request, group and field).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvmap.errors import TraceError
from kvmap.trace import NewRequestData, Step

if TYPE_CHECKING:
    from kvmap.workers.state import WorkerState


def check_continuation(state: WorkerState, nr: NewRequestData, step: Step) -> None:
    """A streaming-input continuation must extend what the live request held (docs/trace-format.md,
    Continuations): no more than the held tokens but the last are cached (`num_computed_tokens`), those
    tokens are the held ones, and each group's new block row starts with the held row (a group that is not
    full attention may show the null block where the row kept a stale id)."""
    row = state.req_id_to_index[nr.req_id]
    h = state.header
    held = int(state.total_len[row])
    new = nr.token_ids
    nc = nr.num_computed_tokens
    field = "prefill_token_ids" if nr.prefill_token_ids is not None else "prompt_token_ids"

    def refuse(message: str, field: str, group: int | None = None) -> TraceError:
        return TraceError(message, line=step.line, step=step.step, req_id=nr.req_id, group=group, field=field,
                          kind="continuation_mismatch")

    if nc > held - 1:
        raise refuse(f"num_computed_tokens {nc} passes the {held - 1} tokens the request kept",
                     "num_computed_tokens")
    keep = nc  # the scheduler keeps `num_tokens - 1 >= num_computed_tokens` of its tokens
    if len(new) < keep:
        raise refuse(f"a continuation of {len(new)} tokens is shorter than the {keep} it keeps", field)
    if keep > 0 and not np.array_equal(state.token_ids[row, :keep], np.asarray(new[:keep], dtype=np.int32)):
        j = int(np.argmax(state.token_ids[row, :keep] != np.asarray(new[:keep], dtype=np.int32)))
        raise refuse(f"position {j} holds token {new[j]}, but the request held {int(state.token_ids[row, j])} "
                     f"there (a continuation keeps its first {keep} tokens)", field)
    null = h.null_block_id if h.null_block_id is not None else 0
    for g, ids in enumerate(nr.block_ids):
        have = int(state.num_blocks[g, row])
        old = state.block_tables[g][row, :have]
        if len(ids) < have:
            raise refuse(f"{len(ids)} blocks drop the {have} the request held", "block_ids", g)
        got = np.asarray(ids[:have], dtype=np.int32)
        diff = got != old
        if h.kv_cache_groups[g].kind != "full_attention":
            diff &= got != null  # out-of-window blocks the scheduler freed come back as the null block
        if diff.any():
            j = int(np.argmax(diff))
            raise refuse(f"logical block {j} is {ids[j]}, but the request held block {int(old[j])} there",
                         "block_ids", g)
