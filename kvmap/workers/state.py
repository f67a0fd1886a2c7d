"""Long-lived worker state, as Model Runner V2 keeps it: request-state rows, token rows, block-table rows.

Rules:
- Rows follow MRV2's `RequestState`: a free list `0 .. max_num_seqs-1`, taken from the end, a freed row
  appended back (LIFO), so the first request gets row `max_num_seqs - 1` and a freed row is the next one out.
  A step frees its finished ids (v2 protocol: and its preempted ids) in sorted id order, as MRV2's
  `finish_requests` does, whatever order the trace lists them in.
- A request keeps its row until it finishes or (v2 protocol) is preempted, also in steps where it is not
  scheduled. Under the v1 protocol a preempted request keeps its row, marked not live, until it resumes
  with a full replacement block row and its tokens.
- Everything is preallocated at maximum size. Updates are vectorized ragged writes (`ragged_write`), never a
  loop per token; the only Python loops are per request, for requests that carry new data (a step where a
  few rows cross into a new block writes those rows' slices directly: cheaper than setting up a scatter).
- One mode: every write into token rows and block tables goes through `self.writes` (workers/writes.py), which
  device workers set to record; the whole-batch operations (position check, sampled-token append, scatter of
  `num_computed_tokens`) go through `self.ops`, vectorized or compiled (workers/state_ops.py).
- One update, `update(step)`, from the decoded `Step` (the trace layer's one record): rows are added only
  through `_take_row` and removed only through `_remove`, which count every change (`_generation`); a step
  that schedules the last step's requests with no change since takes the last step's rows.
- A live request sent again in `scheduled_new_reqs` is a streaming-input continuation (vLLM's resumable
  sessions; MRV2 `add_requests`): its state is removed and added again, so the LIFO free list gives its row
  back, one request at a time in `scheduled_new_reqs` order; its tokens, block rows and `num_computed_tokens`
  are replaced. It must extend what the request held (`workers/continuation.py`, kind `continuation_mismatch`).
- `num_computed_tokens` is always taken from the trace. Sampled tokens are appended after the step.
- Problems that need state to detect (unknown request, a full pool of rows, a row that overflows, a scheduled
  position without a block) raise `TraceError` naming step, request, group and field, with the problem kind
  `kvmap validate` gives the same condition (validate/problems.py KINDS).
"""

from __future__ import annotations

from itertools import chain, compress
from operator import itemgetter

import numpy as np

from kvmap.defaults import STANDIN_TOKEN_ID
from kvmap.errors import TraceError
from kvmap.layout import group_layouts
from kvmap.workers.continuation import check_continuation
from kvmap.trace import SchedulerOutput, Step, TraceHeader, check_fits
from kvmap.workers.state_ops import CompiledOps, VectorOps
from kvmap.workers.writes import TOKENS, StagedWrites

ROW_WRITES_MAX = 16  # up to this many rows with new blocks: one slice write each; more: one vectorized scatter


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class WorkerState:
    """Persistent per-request state. Shapes use R = max_num_seqs rows."""

    def __init__(self, header: TraceHeader) -> None:
        check_fits(header)  # a header too big for this machine is one located error, not a MemoryError
        self.header = header
        R = header.max_num_seqs
        k = header.num_speculative_tokens
        self.max_num_reqs = R
        self.token_width = header.max_model_len + k  # room for drafts staged past the known tokens
        self.free_indices: list[int] = list(range(R))  # popped from the end
        self.req_id_to_index: dict[str, int] = {}
        self.index_to_req_id: dict[int, str] = {}
        self.preempted: set[str] = set()  # v1 protocol: rows kept, not live until resumed
        self.token_ids = np.zeros((R, self.token_width), dtype=np.int32)  # [R, max_model_len + k] row -> tokens
        self.total_len = np.zeros(R, dtype=np.int32)  # [R] known tokens (prompt + sampled) per row
        self.num_computed_tokens = np.zeros(R, dtype=np.int32)  # [R] scheduler's value, before this step
        self.prefill_len = np.zeros(R, dtype=np.int32)  # [R] MRV2 req_states.prefill_len: tokens it was added with
        self.num_prompt_tokens = np.zeros(R, dtype=np.int32)  # [R] V1 input_batch.num_prompt_tokens
        self.block_sizes = [g.block_size for g in header.kv_cache_groups]
        # [G] global positions one block id spans: the layout's virtual_block_size (block_size * cp; block_size
        # for a replicated group)
        self.block_spans = [lay.virtual_block_size for lay in group_layouts(header)]
        # groups whose rows address KV by position (state groups' rows hold state indices: no capacity)
        self.kv_groups = [g for g, grp in enumerate(header.kv_cache_groups) if grp.uses_slot_mapping]
        self.max_num_blocks = [cdiv(self.token_width, span) if grp.uses_slot_mapping
                               else max(cdiv(self.token_width, span), 1 + k)
                               for span, grp in zip(self.block_spans, header.kv_cache_groups)]
        # [num_groups] x [R, max_num_blocks_g] int32: row -> physical block ids (valid up to num_blocks)
        self.block_tables = [np.zeros((R, w), dtype=np.int32) for w in self.max_num_blocks]
        self.num_blocks = np.zeros((header.num_groups, R), dtype=np.int32)  # [G, R] valid entries per row
        # [R] positions every group's blocks cover, capped at max_model_len: min_g num_blocks[g] * block_size_g
        self.capacity = np.zeros(R, dtype=np.int32)
        # every write into token_ids / block_tables; device workers turn `record` on (only changes cross)
        self.writes = StagedWrites(self.token_ids, self.block_tables)
        self.ops: VectorOps | CompiledOps = VectorOps()  # the compiled worker installs CompiledOps
        self.num_standin_tokens = 0  # input ids that had to be made up (trace without sampled_token_ids)
        self._ones = np.ones(R, dtype=np.int32)  # [R] counts of a step that samples one token per request
        self._zeros = np.zeros(R, dtype=np.int32)  # [R] draft counts of a step without drafts (never written)
        self.missing_samples = False  # some step had no sampled_token_ids
        # the last step's scheduled ids and their rows, valid while no row was taken or freed since
        # (`_generation` counts those changes): a step scheduling the same ids reuses the lookups
        self._generation = 0
        self._last: tuple[list[str], np.ndarray, int] = ([], self._zeros[:0], 0)

    # ------------------------------------------------------------------ rows

    def _rows(self, req_ids) -> np.ndarray:
        """[n] int32 rows of live request ids, in order (KeyError for an unknown one): one C call for the lookups."""
        if len(req_ids) > 1:
            return np.array(itemgetter(*req_ids)(self.req_id_to_index), dtype=np.int32)
        return np.fromiter(map(self.req_id_to_index.__getitem__, req_ids), np.int32, len(req_ids))

    def _cached_rows(self, step: Step, req_ids: list[str]) -> np.ndarray:
        """[n] int32 rows of the cached requests: the last step's when it scheduled the same ids and no row
        changed hands since, else looked up (naming the first unknown id)."""
        ids, rows, generation = self._last
        if generation == self._generation and req_ids == ids:
            return rows
        try:
            return self._rows(req_ids)
        except KeyError:  # name the first unknown one
            for r in req_ids:
                self.row_of(r, step, "scheduled_cached_reqs.req_ids")
            raise AssertionError("unreachable") from None  # pragma: no cover

    def row_of(self, req_id: str, step: Step, field: str) -> int:
        row = self.req_id_to_index.get(req_id)
        if row is None:
            raise TraceError("unknown request: it was never added, or it already finished",
                             path=None, line=step.line, step=step.step, req_id=req_id, field=field,
                             kind="unknown_request")
        return row

    def _remove(self, req_id: str) -> None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return  # vLLM workers ignore ids they never saw (e.g. aborted while waiting)
        del self.index_to_req_id[row]
        self.preempted.discard(req_id)
        self.free_indices.append(row)
        self._generation += 1

    def _take_row(self, req_id: str, step: Step) -> int:
        """A free row for a new request (the one rule for adding)."""
        if req_id in self.req_id_to_index:
            raise TraceError("scheduled as new while preempted (it must come back resumed)", line=step.line,
                             step=step.step, req_id=req_id, field="scheduled_new_reqs", kind="new_id_not_new")
        if not self.free_indices:
            raise TraceError(f"more than max_num_seqs={self.max_num_reqs} live requests", line=step.line,
                             step=step.step, req_id=req_id, field="scheduled_new_reqs", kind="budget_seqs")
        row = self.free_indices.pop()
        self.req_id_to_index[req_id] = row
        self.index_to_req_id[row] = req_id
        self._generation += 1
        return row

    def _set_tokens(self, row: int, tokens: list[int], step: Step, req_id: str, field: str) -> None:
        n = len(tokens)
        if n > self.header.max_model_len:
            raise TraceError(f"{n} tokens exceed max_model_len {self.header.max_model_len}", line=step.line,
                             step=step.step, req_id=req_id, field=field, kind="max_model_len")
        self.writes.write_row(TOKENS, row, 0, tokens)
        self.total_len[row] = n

    def _set_blocks(self, row: int, block_ids: list[list[int]], step: Step, req_id: str, field: str) -> None:
        for g, ids in enumerate(block_ids):
            n = len(ids)
            if n > self.max_num_blocks[g]:
                raise TraceError(f"{n} blocks exceed the row width {self.max_num_blocks[g]}", line=step.line,
                                 step=step.step, req_id=req_id, group=g, field=field, kind="row_width")
            self.writes.write_row(g, row, 0, ids)
            self.num_blocks[g, row] = n
        self._refresh_capacity(row)

    def _refresh_capacity(self, rows) -> None:
        cap = np.full_like(self.num_blocks[0, rows], self.header.max_model_len)
        for g in self.kv_groups:
            cap = np.minimum(cap, self.num_blocks[g, rows] * self.block_spans[g])
        self.capacity[rows] = cap

    # ------------------------------------------------------------------ step

    def update(self, step: Step) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """Apply one step's scheduler output. Returns the scheduled requests in scheduler order:
        (req_ids, rows [n] int32, num_scheduled_tokens [n] int32, num_draft_tokens [n] int32)."""
        so: SchedulerOutput = step.scheduler_output
        v2 = self.header.model_runner_protocol == "v2"
        gone = {*so.finished_req_ids, *so.preempted_req_ids} if v2 else so.finished_req_ids
        for r in sorted(gone):  # MRV2 `finish_requests`: sorted ids, so every TP rank frees rows alike
            self._remove(r)
        if not v2:
            for r in so.preempted_req_ids:
                if r in self.req_id_to_index:
                    self.preempted.add(r)

        for nr in so.scheduled_new_reqs:
            if nr.req_id in self.req_id_to_index and nr.req_id not in self.preempted:
                check_continuation(self, nr, step)
                self._remove(nr.req_id)  # a continuation: MRV2 removes the state, then adds it again
            row = self._take_row(nr.req_id, step)
            self._set_tokens(row, nr.token_ids, step, nr.req_id, "prefill_token_ids"
                             if nr.prefill_token_ids is not None else "prompt_token_ids")
            self.num_computed_tokens[row] = nr.num_computed_tokens
            self.prefill_len[row] = len(nr.token_ids)
            self.num_prompt_tokens[row] = len(nr.prompt_token_ids)
            self._set_blocks(row, nr.block_ids, step, nr.req_id, "block_ids")

        c = so.scheduled_cached_reqs
        nst = so.num_scheduled_tokens
        req_ids = list(nst)  # the scheduled batch, in scheduler order
        steady = not so.scheduled_new_reqs and req_ids == c.req_ids  # the usual step: cached rows are its rows
        crows = self._zeros[:0]
        if c.req_ids:
            # steady: this step's and the last step's lists of dict keys, which the typed decoder builds from one
            # cache of key objects (msgspec's), compare by identity
            crows = self._cached_rows(step, req_ids if steady else c.req_ids)
            nc = np.fromiter(c.num_computed_tokens, np.int32, len(crows))
            if step.async_spec is not None and step.async_spec.num_computed_tokens_correction:
                self._correct(step, c.req_ids, nc)
            self.ops.scatter(self.num_computed_tokens, crows, nc)
            for r in c.resumed_req_ids:
                row = self.row_of(r, step, "scheduled_cached_reqs.resumed_req_ids")
                self.preempted.discard(r)
                i = c.req_ids.index(r)
                if c.new_block_ids[i] is None:
                    raise TraceError("resumed without a replacement block row", line=step.line,
                                     step=step.step, req_id=r, field="new_block_ids", kind="resumed_no_blocks")
                self._set_blocks(row, c.new_block_ids[i], step, r, "new_block_ids")
            for r, toks in c.all_token_ids.items():
                row = self.row_of(r, step, "all_token_ids")
                self._set_tokens(row, toks, step, r, "all_token_ids")
                if r in c.resumed_req_ids:  # v1 protocol: MRV2 would re-add it with every token as prefill tokens
                    self.prefill_len[row] = len(toks)
            for r in (c.req_ids if self.preempted else ()):
                if r in self.preempted:
                    raise TraceError("scheduled after preemption without being resumed", line=step.line,
                                     step=step.step, req_id=r, field="scheduled_cached_reqs.resumed_req_ids",
                                     kind="preempted_scheduled")
            self._append_blocks(step, crows)

        rows = crows if steady else self._rows(req_ids)
        self._last = (req_ids, rows, self._generation)
        counts = np.fromiter(nst.values(), np.int32, len(nst))
        spec = so.scheduled_spec_decode_tokens
        num_drafts = self._zeros[: len(req_ids)]  # read-only: a step with drafts gets its own array
        if spec:
            num_drafts = np.zeros(len(req_ids), dtype=np.int32)
            pos_of = {r: i for i, r in enumerate(req_ids)}
            for r, d in spec.items():
                num_drafts[pos_of[r]] = len(d)
        self._check_and_stage_tokens(step, req_ids, rows, counts, num_drafts, spec)
        return req_ids, rows, counts, num_drafts

    def _correct(self, step: Step, req_ids: list[str], nc: np.ndarray) -> None:
        """Async speculative decoding: the scheduler's num_computed_tokens assumes every in-flight draft was
        accepted; the worker-true start is `num_computed_tokens - num_computed_tokens_correction`."""
        corr = step.async_spec.num_computed_tokens_correction
        for i, r in enumerate(req_ids):
            k = corr.get(r)
            if k:
                if k > nc[i]:
                    raise TraceError(f"correction {k} is larger than num_computed_tokens {int(nc[i])}",
                                     line=step.line, step=step.step, req_id=r, field="num_computed_tokens_correction")
                nc[i] -= k

    def _append_blocks(self, step: Step, crows: np.ndarray) -> None:
        c = step.scheduler_output.scheduled_cached_reqs
        nb = c.new_block_ids
        if nb.count(None) == len(nb):
            return
        sel = list(compress(range(len(nb)), nb))  # entries with new blocks (a group-list list is never empty)
        resumed = c.resumed_req_ids
        if resumed:
            sel = [i for i in sel if c.req_ids[i] not in resumed]
            if not sel:
                return
        if len(sel) <= ROW_WRITES_MAX:  # the usual step: a few rows cross into a new block
            num_blocks, spans, widths = self.num_blocks, self.block_spans, self.max_num_blocks
            kv_groups, write_row, capacity = self.kv_groups, self.writes.write_row, self.capacity
            max_model_len = self.header.max_model_len
            for i in sel:
                row = crows.item(i)
                cap = max_model_len
                for g, ids in enumerate(nb[i]):
                    have = num_blocks.item(g, row)
                    if ids:
                        k = len(ids)
                        if have + k > widths[g]:
                            raise TraceError(f"appending {k} blocks overflows the row width {widths[g]}",
                                             line=step.line, step=step.step, req_id=c.req_ids[i], group=g,
                                             field="new_block_ids", kind="row_width")
                        write_row(g, row, have, ids)
                        have += k
                        num_blocks[g, row] = have
                    if g in kv_groups and have * spans[g] < cap:
                        cap = have * spans[g]
                capacity[row] = cap
            return
        rows = crows[sel]
        G = self.header.num_groups
        counts = [np.fromiter((len(nb[i][g]) for i in sel), np.int32, len(sel)) for g in range(G)]  # [G][n]
        ends = [self.num_blocks[g, rows] + counts[g] for g in range(G)]
        over = [ends[g] > self.max_num_blocks[g] for g in range(G)]
        if any(bool(o.any()) for o in over):  # name the first row that overflows, then its first group
            j = min(int(np.argmax(o)) for o in over if o.any())
            g = next(g for g in range(G) if over[g][j])
            raise TraceError(f"appending {int(counts[g][j])} blocks overflows the row width "
                             f"{self.max_num_blocks[g]}", line=step.line, step=step.step,
                             req_id=c.req_ids[sel[j]], group=g, field="new_block_ids", kind="row_width")
        for g in range(G):
            flat = np.fromiter(chain.from_iterable(nb[i][g] for i in sel), dtype=np.int32, count=int(counts[g].sum()))
            self.writes.write(g, rows, self.num_blocks[g, rows], counts[g], flat)
            self.num_blocks[g, rows] = ends[g]
        self._refresh_capacity(rows)

    def _check_and_stage_tokens(self, step: Step, req_ids, rows: np.ndarray, counts: np.ndarray,
                                num_drafts: np.ndarray, spec: dict | None) -> None:
        """Check that every scheduled position fits and has a block; stage drafts (`spec`) after the known
        tokens. `req_ids[j]` names entry j."""
        # one look at the whole batch; `_check_positions` names the first problem (or stages stand-in tokens)
        ok = self.ops.positions_fit(rows, counts, num_drafts, self.num_computed_tokens, self.capacity, self.total_len)
        if ok and not spec:
            return
        end = self.num_computed_tokens[rows] + counts  # [n] seq_lens
        real_end = end - num_drafts  # positions past this are drafts
        if not ok:
            self._check_positions(step, req_ids, rows, end, real_end)
        if spec:
            sel = np.flatnonzero(num_drafts)
            drows = rows[sel]
            real = step.async_spec.spec_draft_token_ids if step.async_spec is not None else {}
            flat = np.fromiter((t for j in sel for t in real.get(req_ids[j], spec[req_ids[j]])), dtype=np.int32,
                               count=int(num_drafts.sum()))
            # async scheduling sends -1 placeholders (the real drafts live on the GPU): without the recorded
            # drafts (`spec_draft_token_ids`) their input ids are stand-ins
            standin = flat < 0
            if standin.any():
                flat[standin] = STANDIN_TOKEN_ID
                self.num_standin_tokens += int(standin.sum())
            self.writes.write(TOKENS, drows, real_end[sel], num_drafts[sel], flat)

    def _check_positions(self, step: Step, req_ids: list[str], rows: np.ndarray, end: np.ndarray,
                         real_end: np.ndarray) -> None:
        h = self.header
        if len(rows) and int(end.max()) > h.max_model_len:
            j = int(np.argmax(end > h.max_model_len))
            raise TraceError(f"positions up to {int(end[j]) - 1} exceed max_model_len {h.max_model_len}",
                             line=step.line, step=step.step, req_id=req_ids[j], field="num_scheduled_tokens",
                             kind="max_model_len")
        for g in self.kv_groups:
            bs = self.block_spans[g]
            have = self.num_blocks[g, rows].astype(np.int64) * bs
            if len(rows) and bool((have < end).any()):
                j = int(np.argmax(have < end))
                raise TraceError(f"position {int(end[j]) - 1} has no block: the row holds "
                                 f"{int(self.num_blocks[g, rows[j]])} blocks of {bs} tokens",
                                 line=step.line, step=step.step, req_id=req_ids[j], group=g,
                                 field="block_ids/new_block_ids", kind="no_block")
        known = self.total_len[rows]
        gap = real_end > known
        if bool(gap.any()):
            if not self.missing_samples:
                j = int(np.argmax(gap))
                raise TraceError(f"positions {int(known[j])}..{int(real_end[j]) - 1} are past the request's "
                                 f"{int(known[j])} known tokens", line=step.line, step=step.step,
                                 req_id=req_ids[j], field="num_scheduled_tokens", kind="tokens_unknown")
            for j in np.flatnonzero(gap):  # made-up ids for tokens the trace did not record
                row = rows[j]
                self.writes.write_row(TOKENS, row, int(known[j]),
                                np.full(int(real_end[j] - known[j]), STANDIN_TOKEN_ID, dtype=np.int32))
                self.num_standin_tokens += int(real_end[j] - known[j])
                self.total_len[row] = real_end[j]

    def append_sampled(self, step: Step, req_ids: list[str], rows: np.ndarray) -> None:
        """After the step: append what the model sampled (MRV2's `post_update`). `req_ids`/`rows` are the
        step's scheduled requests; the sampled dict normally lists the same ids in the same order."""
        sampled = step.sampled_token_ids
        if sampled is None:
            self.missing_samples = True
            return
        if not sampled:
            return
        if len(sampled) == len(req_ids) and list(sampled) == req_ids:
            srows = rows
        else:
            srows = self._rows(sampled)
        values = sampled.values()
        flat = np.fromiter(chain.from_iterable(values), np.int32)
        if len(flat) == len(sampled) and all(values):  # one token each (no list is empty), the usual decode step
            counts = self._ones[: len(flat)]
        else:
            counts = np.fromiter(map(len, values), np.int32, len(sampled))
        j = self.ops.append_tokens(self, srows, counts, flat)
        if j >= 0:
            raise TraceError("sampled tokens overflow max_model_len", line=step.line, step=step.step,
                             req_id=list(sampled)[j], field="sampled_token_ids", kind="max_model_len")

