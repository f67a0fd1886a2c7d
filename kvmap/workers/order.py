"""Batch order: which scheduled request takes which batch row, for both of vLLM's runners (one owner).

Rules:
- Model Runner V2 (the default, `mrv2`): a stable ascending sort by scheduled tokens; with speculative decoding,
  requests with drafts, then requests of exactly `1 + num_speculative_tokens` tokens, come first (#47381).
  `mrv2_key` is the spec; the numpy and numba sorts are tested against it.
- V1 (`v1`): the persistent batch (vLLM's `gpu_model_runner._update_states`): finished
  requests leave their row, then every row not scheduled this step (preempted, resumed, merely unscheduled),
  then every streaming-input continuation (a live id in `scheduled_new_reqs`, `_update_streaming_request`);
  new requests (continuations among them, scheduler order), then re-added cached ones, then (v2 protocol) the
  requests back from a preemption (sent as new; V1's scheduler lists a resumed request after the running ones)
  take the lowest hole or are appended;
  `condense()` moves the highest occupied rows into the remaining holes, lowest hole first; then, only if the
  attention backend sets `reorder_batch_threshold`, the 4-region reorder by swaps (decode, short extend, long
  extend, prefill), exactly as `reorder_batch_to_split_decodes_and_prefills` swaps them. A step whose
  requests are the last step's, none finished, preempted, sent as new or resumed, keeps every row (the rows
  never keep a hole), so only the reorder runs (tests/test_batch_order.py holds it to the full update).
- Plain Python over request ids: the order is per request, not per token, and it is what V1 itself does.
"""

from __future__ import annotations

from kvmap.errors import KvmapError
from kvmap.trace import Step

BATCH_ORDERS = ("mrv2", "v1")


def check_batch_order(name: str) -> str:
    """`name` if it is a batch order kvmap knows, else the error naming `--batch-order`."""
    if name not in BATCH_ORDERS:
        raise KvmapError(f"unknown batch order {name!r}; choose one of {', '.join(BATCH_ORDERS)}",
                         field="--batch-order")
    return name


def mrv2_key(num_scheduled_tokens: int, num_drafts: int, num_speculative_tokens: int) -> tuple[bool, bool, int]:
    """Model Runner V2's sort key of one request (sorted stably, ascending)."""
    if num_speculative_tokens == 0:
        return (False, False, num_scheduled_tokens)
    return (num_drafts == 0, num_scheduled_tokens != 1 + num_speculative_tokens, num_scheduled_tokens)


class V1PersistentBatch:
    """V1's `InputBatch` row order, followed step by step. `rows[i]` is the request in batch row i."""

    def __init__(self, reorder_batch_threshold: int | None = None) -> None:
        self.threshold = reorder_batch_threshold
        self.rows: list[str | None] = []  # batch row -> req_id (None: a hole until condense)
        self.index: dict[str, int] = {}  # req_id -> batch row
        self.prompt_len: dict[str, int] = {}  # req_id -> num_prompt_tokens (kept while the request lives)
        self.preempted: set[str] = set()  # requests preempted and not yet back

    def _remove(self, req_id: str, holes: list[int]) -> None:
        i = self.index.pop(req_id, None)
        if i is not None:
            self.rows[i] = None
            holes.append(i)

    def update(self, step: Step, num_computed: dict[str, int]) -> list[str]:
        """Apply one step; returns the batch order (req ids). `num_computed`: each scheduled request's
        num_computed_tokens as the worker holds it this step (for the reorder's regions; None without a
        `reorder_batch_threshold`)."""
        so = step.scheduler_output
        scheduled = so.num_scheduled_tokens
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        if not (so.finished_req_ids or so.preempted_req_ids or so.scheduled_new_reqs or resumed) and (
                scheduled.keys() == self.index.keys()):  # the last step's requests, none leaving or coming
            return self._ordered(scheduled, num_computed)  # every row stands (rows never keep holes)
        holes: list[int] = []
        for r in so.finished_req_ids:
            self._remove(r, holes)
            self.prompt_len.pop(r, None)
            self.preempted.discard(r)
        self.preempted.update(so.preempted_req_ids)
        for r in [r for r in self.index if r not in scheduled or r in resumed]:
            self._remove(r, holes)
        for nr in so.scheduled_new_reqs:  # a live id sent as new: a streaming-input continuation leaves its row
            self._remove(nr.req_id, holes)
        holes.sort(reverse=True)  # popped from the end: lowest first
        for nr in so.scheduled_new_reqs:
            self.prompt_len[nr.req_id] = len(nr.prompt_token_ids)
        back = [nr.req_id for nr in so.scheduled_new_reqs if nr.req_id in self.preempted]  # v2: resumed as new
        to_add = [nr.req_id for nr in so.scheduled_new_reqs if nr.req_id not in self.preempted]
        to_add += [r for r in so.scheduled_cached_reqs.req_ids if r not in self.index and r not in to_add]
        to_add += back
        self.preempted.difference_update(back, resumed)
        for r in to_add:
            i = holes.pop() if holes else len(self.rows)
            if i == len(self.rows):
                self.rows.append(r)
            else:
                self.rows[i] = r
            self.index[r] = i
        self._condense(holes)
        return self._ordered(scheduled, num_computed)

    def _ordered(self, scheduled: dict[str, int], num_computed: dict[str, int] | None) -> list[str]:
        if self.threshold is not None:
            self._reorder(scheduled, num_computed)
        return list(self.rows)

    def _condense(self, holes: list[int]) -> None:
        """Move the highest occupied rows into the lowest holes; trailing holes are dropped."""
        holes.sort(reverse=True)
        last = len(self.rows) - 1
        while holes:
            while last >= 0 and self.rows[last] is None:
                last -= 1
            if holes[-1] >= last:
                break
            i = holes.pop()
            r = self.rows[last]
            self.rows[i], self.rows[last] = r, None
            self.index[r] = i
        while self.rows and self.rows[-1] is None:
            self.rows.pop()

    def _reorder(self, scheduled: dict[str, int], num_computed: dict[str, int]) -> None:
        """decode -> short extend -> long extend -> prefill, by the swaps V1 makes."""
        rows = self.rows
        regions = []
        for r in rows:
            nc = num_computed[r]
            below = scheduled[r] <= self.threshold
            if nc == 0:
                regions.append(3)
            elif not below:
                regions.append(2)
            elif nc < self.prompt_len.get(r, 0):
                regions.append(1)
            else:
                regions.append(0)
        target = sorted(regions)
        wrong = [i for i in range(len(rows)) if regions[i] != target[i]]
        if not wrong:
            return
        src = sorted(wrong, key=lambda i: regions[i])  # stable, like np.argsort(kind="stable")
        dest = dict(zip(src, wrong))
        for s in list(dest):
            d = dest[s]
            while s != d:
                rows[s], rows[d] = rows[d], rows[s]
                nxt = dest.get(d, d)
                dest[d] = d
                d = nxt
        for i, r in enumerate(rows):
            self.index[r] = i
