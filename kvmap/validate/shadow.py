"""`kvmap validate`: find every inconsistency in a trace, each named by step, line, request, group and field.

Rules:
- Report all problems, not the first: a line that does not parse is one problem and is skipped; requests it
  mentions become "uncertain" until they finish, so one bad line does not cascade into false alarms.
- A shadow model in plain Python (independent of the replay workers) follows every live request: its tokens,
  the `num_computed_tokens` the scheduler must send next, its block rows per group, and who holds each block.
- A live request sent again as new is a streaming-input continuation (validate/continuation.py checks that it
  extends what the request held); it then starts over as a new request with the continuation's rows.
- One block pool serves every group (vLLM's `BlockPool`): a block id claimed in one group while a live request
  holds it in another is a `group_conflict` (blocks.py `PoolHolders`). vLLM frees a request once, so an id
  listed in `finished_req_ids` again after it finished is `finished_twice` (replay ignores it, as vLLM's
  workers ignore finished ids they hold no row for).
- Zero false alarms on real traces: every rule is vLLM 0.33 behaviour (docs/trace-format.md). Prefix caching
  shares full-attention blocks between live requests holding the same tokens at the same positions; sliding
  windows keep stale ids; only rejected drafts and preemption move `num_computed_tokens` back.
- No torch, no numpy arrays in the loop: validate starts fast and never needs the KV cache unless `--deep`.
"""

from __future__ import annotations

from kvmap.trace import Step, TraceHeader
from kvmap.validate.blocks import BlockOwners, PoolHolders, context_start, still_held
from kvmap.validate import continuation, model_output, multirank
from kvmap.validate.idset import IdSet
from kvmap.validate.problems import KINDS, Problem
from kvmap.validate.salvage import read_bad_line


class StopValidation(Exception):  # --max-problems reached
    pass


class _Req:
    __slots__ = ("tokens", "expected_nc", "nc_slack", "blocks", "live", "last_drafts_proposed", "no_null")

    def __init__(self, tokens: list[int], nc: int, blocks: list[list[int]]) -> None:
        self.tokens = list(tokens)
        self.expected_nc: int | None = nc  # what the next step must send (None: unknown)
        self.nc_slack = 0  # how far below expected_nc a rollback may legitimately land
        self.blocks = [list(b) for b in blocks]
        self.live = True  # False: v1-preempted, row kept but not live
        self.last_drafts_proposed: list[int] | None = None
        self.no_null = [0] * len(blocks)  # per group: leading blocks already seen free of the null block


class Validator:
    def __init__(self, header: TraceHeader, path: str, max_problems: int | None) -> None:
        self.h = header
        self.path = path
        self.max_problems = max_problems
        self.problems: list[Problem] = []
        self.reqs: dict[str, _Req] = {}
        self.finished = IdSet()  # the sets kept over the whole trace: about 8 bytes an id (idset.py)
        self.freed = IdSet()  # finished since the last lost line and not added again
        self.uncertain: set[str] = set()
        self.seen = IdSet()
        self.blind = False  # the line before was not JSON: unknown requests now may have been added there
        self.full = [g.kind == "full_attention" for g in header.kv_cache_groups]
        self.null = header.null_block_id if header.null_block_id is not None else 0
        self.spans = multirank.block_spans(header)  # [G] positions per block id (block_size * cp), None: state
        # full-attention groups: block id -> {req_id: logical block index}
        self.owners = [BlockOwners(s or g.block_size, self.null) if f else None
                       for g, f, s in zip(header.kv_cache_groups, self.full, self.spans)]
        self.pool = PoolHolders(self.null)  # every positional group: block id -> group -> holders
        self.scheduled: dict[str, int] = {}  # the step's num_scheduled_tokens (holders' windows in `_held`)
        width = header.max_model_len + header.num_speculative_tokens
        # the worker's row width, in blocks of block_size * cp
        self.row_width = [-(-width // (s or g.block_size)) for g, s in zip(header.kv_cache_groups, self.spans)]
        self._check_header()

    # ------------------------------------------------------------------ reporting

    def add(self, kind: str, message: str, step: Step | None = None, *, line: int | None = None,
            step_idx: int | None = None, req_id: str | None = None, group: int | None = None,
            field: str | None = None) -> None:
        if req_id is not None and req_id in self.uncertain:
            return
        assert kind in KINDS, kind
        self.problems.append(Problem(kind, message, line if step is None else step.line,
                                     step_idx if step is None else step.step, req_id, group, field))
        if self.max_problems is not None and len(self.problems) >= self.max_problems:
            raise StopValidation

    def _check_header(self) -> None:
        for msg, grp, fld in multirank.header_problems(self.h):
            self.add("header", msg, line=1, group=grp, field=fld)

    # ------------------------------------------------------------------ blocks

    def _release(self, req_id: str, req: _Req) -> None:
        for g, ids in enumerate(req.blocks):
            if self.owners[g] is not None:
                self.owners[g].release(req_id, ids)
            if self.spans[g] is not None:
                self.pool.release(g, req_id, ids)

    def _held(self, g: int, other: str, j: int) -> bool:
        """Whether live request `other` certainly still holds logical block j of group g (blocks.still_held, at
        the furthest it can reach this step: its expected start, the step's tokens and every draft)."""
        o = self.reqs.get(other)
        if o is None or not o.live or other in self.uncertain:
            return False
        reach = None if o.expected_nc is None else \
            o.expected_nc + self.scheduled.get(other, 0) + self.h.num_speculative_tokens
        return still_held(self.h.kv_cache_groups[g], self.spans[g], reach, j)

    def _peer(self, other: str) -> list[int] | None:
        o = None if other in self.uncertain else self.reqs.get(other)
        return o.tokens if o is not None and o.live else None

    def _claim(self, step: Step, req_id: str, req: _Req, g: int, start: int, field_name: str) -> None:
        """Register req's blocks of group g from logical index `start`; check against other live holders."""
        if len(req.blocks[g]) > self.row_width[g]:
            self.add("row_width", f"{len(req.blocks[g])} blocks exceed the row width {self.row_width[g]} "
                     "(cdiv(max_model_len + drafts, block_size * cp))", step, req_id=req_id, group=g, field=field_name)
        if self.spans[g] is not None:
            for _j, b, og, other in self.pool.claim(g, req_id, req.blocks[g], start, self._held):
                who = "this request" if other == req_id else f"live request {other!r}"
                self.add("group_conflict", f"block {b} is also held in group {og} by {who} (all groups draw "
                         "from one block pool)", step, req_id=req_id, group=g, field=field_name)
        owners = self.owners[g]
        if owners is None:
            return
        for _j, b, other, what in owners.claim(req_id, req.tokens, req.blocks[g], start, self._peer):
            if other == req_id:
                self.add("block_repeated", f"block {b} appears at {what}", step, req_id=req_id, group=g,
                         field=field_name)
            else:
                self.add("double_allocation", f"block {b} is also held by live request {other!r} ({what})",
                         step, req_id=req_id, group=g, field=field_name)

    # ------------------------------------------------------------------ steps

    def salvage(self, obj: object, mentioned: set[str], line: int, step_idx: int) -> None:
        """A line that did not parse: its well-formed parts (salvage.py) count (finished and preempted ids freed,
        unknown cached ids reported, appended blocks and sampled tokens followed). Requests it added or resumed,
        or with nothing usable, become uncertain until they finish or are added again; the others skip their
        next num_computed_tokens check."""
        bad = read_bad_line(obj)
        self._free(bad.finished, bad.preempted)
        for r in bad.cached:
            if r not in self.reqs and r not in self.uncertain and r not in bad.new_ids:
                self._unknown(None, r, line=line, step_idx=step_idx)
        appended: set[str] = set()
        for r, new in bad.appended:
            req = self.reqs.get(r)
            if req is not None and len(new) == len(req.blocks):
                for g, b in enumerate(new):
                    req.blocks[g].extend(b)
                appended.add(r)
        for r in mentioned:
            req = self.reqs.get(r)
            if req is None or r in bad.resumed or r in bad.new_ids:
                self.uncertain.add(r)
                continue
            req.expected_nc = None  # resynchronise from the next value the scheduler sends
            if r in bad.sampled:
                req.tokens.extend(bad.sampled[r])
            elif r not in bad.sampled_bad and r not in appended:
                self.uncertain.add(r)

    def step(self, step: Step) -> None:
        """Follow one parsed step through the shadow model, adding every problem it shows."""
        self.scheduled = step.scheduler_output.num_scheduled_tokens
        self._finish_and_preempt(step)
        self._budgets(step)
        self._new_requests(step)
        self._cached_requests(step)
        self._scheduled_positions(step)
        model_output.check(self, step)
        self.blind = False

    def _finish_and_preempt(self, step: Step) -> None:
        """Free finished requests; drop (v2) or park (v1) preempted ones. vLLM schedules no waiting request
        in a step that preempts, so a preempted request is never scheduled in its step (v2: nor re-added)."""
        so = step.scheduler_output
        scheduled = so.num_scheduled_tokens
        listed: set[str] = set()
        for r in so.finished_req_ids:
            if r in listed or (r in self.freed and r not in self.reqs):
                self.add("finished_twice", "listed in finished_req_ids again after it finished (vLLM frees a "
                         "request once; replay ignores the id, as vLLM's workers do)", step, req_id=r,
                         field="finished_req_ids")
            listed.add(r)
        for r in so.preempted_req_ids:
            if r in scheduled:
                self.add("preempted_in_step", "preempted in this step but also scheduled", step, req_id=r,
                         field="preempted_req_ids")
        self._free(so.finished_req_ids, so.preempted_req_ids)

    def _free(self, finished: list[str], preempted: list[str]) -> None:
        for r in finished:
            req = self.reqs.pop(r, None)
            if req is not None:
                self._release(r, req)
            self.finished.add(r)
            self.freed.add(r)
            self.uncertain.discard(r)
        v2 = self.h.model_runner_protocol == "v2"
        for r in preempted:
            req = self.reqs.get(r)
            if req is None:
                continue
            self._release(r, req)
            if v2:
                del self.reqs[r]
            else:
                req.live = False

    def lost_line(self) -> None:
        """A step line that is not JSON at all: every live request stops being checked (its tokens and
        blocks may have changed there), and requests first seen in the next step may have been added there."""
        self.uncertain.update(self.reqs)
        self.freed.clear()  # the lost line may have added a finished id again
        self.blind = True

    def _unknown(self, step: Step | None, r: str, field: str = "scheduled_cached_reqs.req_ids", **where) -> None:
        """A request the worker holds no row for: after its finish, or never added."""
        if self.blind:
            pass
        elif r in self.finished:
            self.add("scheduled_after_finish", "scheduled after it finished", step, req_id=r, field=field, **where)
        else:
            self.add("unknown_request", "never added as a new request (or dropped on preemption)", step,
                     req_id=r, field=field, **where)
        self.uncertain.add(r)

    def _budgets(self, step: Step) -> None:
        """The step's token and request budgets."""
        so = step.scheduler_output
        h = self.h
        scheduled = so.num_scheduled_tokens
        if so.total_num_scheduled_tokens > h.token_budget:
            self.add("budget_tokens", f"{so.total_num_scheduled_tokens} tokens exceed the budget {h.token_budget}",
                     step, field="total_num_scheduled_tokens")
        if len(scheduled) > h.max_num_seqs:
            self.add("budget_seqs", f"{len(scheduled)} requests exceed max_num_seqs {h.max_num_seqs}", step,
                     field="num_scheduled_tokens")

    def _new_requests(self, step: Step) -> None:
        """Requests added this step: rows, tokens, blocks claimed."""
        so = step.scheduler_output
        h = self.h
        for nr in so.scheduled_new_reqs:
            r = nr.req_id
            if r not in self.reqs and len(self.reqs) >= h.max_num_seqs:
                self.add("budget_seqs", f"a new request while all max_num_seqs={h.max_num_seqs} worker rows are "
                         "held (running or preempted)", step, req_id=r, field="scheduled_new_reqs")
            if len(nr.token_ids) > h.max_model_len:
                self.add("max_model_len", f"{len(nr.token_ids)} tokens exceed max_model_len {h.max_model_len}",
                         step, req_id=r, field="prefill_token_ids" if nr.prefill_token_ids is not None
                         else "prompt_token_ids")
            if r in self.reqs and self.reqs[r].live and r not in self.uncertain:  # a streaming continuation
                continuation.check(self, step, nr)
            elif r in self.reqs and r not in self.uncertain:  # v1 protocol: a preempted request comes back resumed
                self.add("new_id_not_new", "scheduled as new while preempted (it must come back resumed)", step,
                         req_id=r, field="scheduled_new_reqs")
            if r in self.reqs:
                self._release(r, self.reqs[r])
            self.finished.discard(r)
            self.freed.discard(r)
            self.uncertain.discard(r)
            self.seen.add(r)
            req = _Req(nr.token_ids, nr.num_computed_tokens, nr.block_ids)
            self.reqs[r] = req
            if nr.num_computed_tokens >= len(nr.token_ids):
                self.add("computed_ahead", f"num_computed_tokens {nr.num_computed_tokens} leaves nothing of "
                         f"its {len(nr.token_ids)} tokens to compute", step, req_id=r, field="num_computed_tokens")
            for g in range(h.num_groups):
                self._claim(step, r, req, g, 0, "block_ids")

    def _cached_requests(self, step: Step) -> None:
        """Running and resumed requests: num_computed_tokens, block appends or replacements."""
        so = step.scheduler_output
        h = self.h
        c = so.scheduled_cached_reqs
        for r, toks in c.all_token_ids.items():
            if len(toks) > h.max_model_len:
                self.add("max_model_len", f"{len(toks)} tokens exceed max_model_len {h.max_model_len}", step,
                         req_id=r, field="all_token_ids")
            if r not in self.reqs and r not in self.uncertain:
                self._unknown(step, r, "all_token_ids")
        for i, r in enumerate(c.req_ids):
            if r in self.uncertain:
                continue
            req = self.reqs.get(r)
            if req is None:
                self._unknown(step, r)
                continue
            nc = c.num_computed_tokens[i]
            corrections = step.async_spec.num_computed_tokens_correction if step.async_spec else {}
            corr = corrections.get(r, 0)
            nc -= corr  # async spec decode: the worker-true start
            resumed = r in c.resumed_req_ids
            if not req.live and not resumed:
                self.add("preempted_scheduled", "scheduled after preemption without being resumed", step,
                         req_id=r, field="scheduled_cached_reqs.resumed_req_ids")
            if r in c.all_token_ids:
                req.tokens = list(c.all_token_ids[r])
            if resumed:
                self._release(r, req)
                req.live = True
                new = c.new_block_ids[i]
                if new is None:
                    self.add("resumed_no_blocks", "resumed without its replacement block row", step, req_id=r,
                             field="new_block_ids")
                    self.uncertain.add(r)
                    continue
                req.blocks = [list(b) for b in new]
                req.no_null = [0] * len(new)
                for g in range(h.num_groups):
                    self._claim(step, r, req, g, 0, "new_block_ids")
            else:
                exp = req.expected_nc
                # under async spec decode the scheduler's value is optimistic: exact only with the recorded
                # correction (or without drafts at all)
                exact = not h.async_scheduling or step.async_spec is not None or not h.num_speculative_tokens
                said = f"num_computed_tokens {nc + corr} - correction {corr} = {nc}" if r in corrections else \
                    f"num_computed_tokens {nc}"
                field = "num_computed_tokens_correction" if r in corrections else \
                    "scheduled_cached_reqs.num_computed_tokens"
                if exp is not None and exact:
                    if nc > exp:
                        self.add("computed_ahead", f"{said} but only {exp} were computed", step, req_id=r,
                                 field=field)
                    elif nc < exp - req.nc_slack:
                        self.add("computed_back", f"{said} went back from {exp} with no rejected drafts or "
                                 "preemption to explain it", step, req_id=r, field=field)
                new = c.new_block_ids[i]
                if new is not None:
                    for g in range(h.num_groups):
                        start = len(req.blocks[g])
                        req.blocks[g].extend(new[g])
                        self._claim(step, r, req, g, start, "new_block_ids")
            req.expected_nc = nc

    def _scheduled_positions(self, step: Step) -> None:
        """Every scheduled request: positions inside max_model_len, known tokens, blocks, windows, drafts."""
        so = step.scheduler_output
        h = self.h
        scheduled = so.num_scheduled_tokens
        window_owner: list[dict[int, tuple[str, int]]] = [{} for _ in h.kv_cache_groups]
        for r, n in scheduled.items():
            req = self.reqs.get(r)
            if req is None or r in self.uncertain:
                continue
            nc = req.expected_nc or 0
            end = nc + n
            drafts = so.scheduled_spec_decode_tokens.get(r, [])
            if end > h.max_model_len:
                self.add("max_model_len", f"positions up to {end - 1} exceed max_model_len {h.max_model_len}",
                         step, req_id=r, field="num_scheduled_tokens")
            if end - len(drafts) > len(req.tokens):
                self.add("tokens_unknown", f"positions {len(req.tokens)}..{end - len(drafts) - 1} are past the "
                         f"request's {len(req.tokens)} known tokens", step, req_id=r, field="num_scheduled_tokens")
            for g, grp in enumerate(h.kv_cache_groups):
                bs = self.spans[g]
                if bs is None:  # a state group: its row holds state indices, not positions
                    continue
                row = req.blocks[g]
                need = -(-end // bs)
                if len(row) < need:
                    self.add("no_block", f"position {end - 1} needs block {need - 1} but the row holds {len(row)}",
                             step, req_id=r, group=g, field="block_ids/new_block_ids")
                    continue
                first = context_start(grp, nc) // bs  # the first block this step reads
                if first == 0:  # full attention: the row's prefix never changes, look at each block once
                    first = min(req.no_null[g], need)
                if self.null not in row[first:need]:
                    req.no_null[g] = max(req.no_null[g], need) if first <= req.no_null[g] else req.no_null[g]
                else:
                    j = row.index(self.null, first, need)
                    what = "scheduled positions" if j >= nc // bs else "context positions"
                    self.add("null_block", f"{what} in logical block {j} map to the null block {self.null}",
                             step, req_id=r, group=g, field="block_ids/new_block_ids")
                if grp.kind == "sliding_window":
                    lo = max(0, nc - grp.sliding_window + 1) // bs
                    owners = window_owner[g]
                    for j in range(lo, need):
                        b = row[j]
                        if b == self.null:
                            continue
                        prev = owners.get(b)
                        if prev is not None and prev[0] == r and prev[1] != j:
                            self.add("block_repeated", f"block {b} appears at logical blocks {prev[1]} and {j} "
                                     "inside the window", step, req_id=r, group=g, field="block_ids/new_block_ids")
                        elif prev is not None and prev[0] != r:
                            o = self.reqs[prev[0]]
                            same = prev[1] == j and req.tokens[j * bs:(j + 1) * bs][:len(o.tokens)] == \
                                o.tokens[j * bs:(j + 1) * bs][:len(req.tokens)]
                            if not same:
                                self.add("window_conflict", f"block {b} is read inside the window by {prev[0]!r} too",
                                         step, req_id=r, group=g, field="block_ids/new_block_ids")
                        owners[b] = (r, j)
            if drafts and req.last_drafts_proposed is not None:
                if list(drafts) != req.last_drafts_proposed[: len(drafts)] and -1 not in drafts:
                    self.add("drafts_mismatch", f"scheduled drafts {list(drafts)[:4]} are not a prefix of the "
                             f"proposed {req.last_drafts_proposed[:4]}", step, req_id=r,
                             field="scheduled_spec_decode_tokens")
