"""What each recorded step's batch was made of: prefill, decode and draft tokens, new, resumed, preempted and
finished requests.

Rules: read from the decoded step after it ran (outside every timed region), with dict and list operations
only (a numpy call costs more than these few requests). A request
scheduled exactly one token besides its drafts is decoding (a one-token last prefill chunk counts as decode: the
step does not tell them apart); every other non-draft token is prefill. `new` counts scheduled_new_reqs (a v2
resumption comes back as new), `resumed` the v1 resumed ids. No per-step Python objects: `steplog.Rows`.
"""

from __future__ import annotations

import numpy as np

from kvmap.run.steplog import Rows

COLUMNS = ("prefill_tokens", "decode_tokens", "draft_tokens", "new", "resumed", "preempted", "finished")


class Composition:
    """The tally: `add(step)` per recorded step, `arrays()` once at the end."""

    def __init__(self) -> None:
        self.rows = Rows(len(COLUMNS))  # [recorded steps, len(COLUMNS)]

    def add(self, step) -> None:
        so = step.scheduler_output
        drafts = so.scheduled_spec_decode_tokens  # req_id -> drafts (only requests that have some)
        counts = so.num_scheduled_tokens
        decode = list(counts.values()).count(1)  # one token, no drafts
        total_drafts = 0
        for r, d in drafts.items():  # a drafting request decodes when one token is its own
            total_drafts += len(d)
            decode += counts.get(r, 0) - len(d) == 1
        self.rows.extend((step.num_tokens - total_drafts - decode, decode, total_drafts, len(so.scheduled_new_reqs),
                          len(so.scheduled_cached_reqs.resumed_req_ids), len(so.preempted_req_ids),
                          len(so.finished_req_ids)))

    def arrays(self) -> np.ndarray:
        """[recorded steps, len(COLUMNS)] int32 (int64 when a value needs it)."""
        return self.rows.take()
