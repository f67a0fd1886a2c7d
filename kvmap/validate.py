"""`kvmap validate`: find every inconsistency in a trace, each named by step, line, request, group and field.

Rules:
- Report all problems, not the first: a line that does not parse is one problem and is skipped; requests it
  mentions become "uncertain" until they finish, so one bad line does not cascade into false alarms.
- A shadow model in plain Python (independent of the replay workers) follows every live request: its tokens,
  the `num_computed_tokens` the scheduler must send next, its block rows per group, and who holds each block.
- Zero false alarms on real traces: every rule is vLLM 0.33 behaviour (trace-format.md). Prefix caching shares
  full-attention blocks between live requests that hold the same tokens at the same positions (one may still
  be computing them); sliding-window rows keep stale ids outside the window; rejected drafts and preemption
  are the only reasons `num_computed_tokens` goes back.
- No torch, no numpy arrays in the loop: validate starts fast and never needs the KV cache unless `--deep`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

from kvmap.errors import KvmapError, TraceError, format_location
from kvmap.trace import Step, Trace, TraceHeader, _loads, _Where, fast_step, parse_step

KINDS = {
    "json": "line is not JSON or is truncated",
    "schema": "a field has the wrong type or shape",
    "step_order": "step numbers are not consecutive from 0",
    "total_mismatch": "total_num_scheduled_tokens differs from the sum of num_scheduled_tokens",
    "block_range": "a block id is outside the pool",
    "budget_tokens": "more tokens than the header's token budget",
    "budget_seqs": "more requests than max_num_seqs",
    "max_model_len": "a position beyond max_model_len",
    "unknown_request": "a cached request the worker does not know",
    "scheduled_after_finish": "a request scheduled after it finished",
    "new_id_not_new": "a new request whose id is still live",
    "preempted_scheduled": "a preempted request scheduled without being resumed",
    "preempted_in_step": "a request preempted and scheduled in the same step",
    "computed_ahead": "num_computed_tokens runs ahead of what was computed",
    "computed_back": "num_computed_tokens goes back without a rollback or preemption to explain it",
    "tokens_unknown": "scheduled positions past the request's known tokens",
    "no_block": "a scheduled position has no block",
    "null_block": "a scheduled position maps to the null block",
    "double_allocation": "one block held by two live requests for different tokens or positions",
    "window_conflict": "a sliding-window block read inside the window by two requests for different tokens",
    "partial_sampled": "a partial prefill chunk sampled tokens",
    "too_many_sampled": "more sampled tokens than 1 + drafts",
    "drafts_mismatch": "scheduled drafts are not (a prefix of) the drafts proposed the step before",
    "header": "header values contradict each other",
}


@dataclass(slots=True)
class Problem:
    kind: str
    message: str
    line: int | None = None
    step: int | None = None
    req_id: str | None = None
    group: int | None = None
    field: str | None = None

    def where(self) -> str:
        return format_location(None, self.line, self.step, self.req_id, self.group, self.field)


@dataclass
class ValidationReport:
    trace: str
    steps: int = 0
    requests: int = 0
    problems: list[Problem] = field(default_factory=list)
    truncated: bool = False  # stopped at --max-problems
    info: list[str] = field(default_factory=list)
    deep: dict | None = None

    @property
    def valid(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"trace": self.trace, "valid": self.valid, "steps": self.steps, "requests": self.requests,
                "problems": [asdict(p) for p in self.problems], "by_kind": dict(Counter(p.kind for p in self.problems)),
                "truncated": self.truncated, "info": self.info, "deep": self.deep}


class _StopValidation(Exception):
    pass


class _Req:
    __slots__ = ("tokens", "expected_nc", "nc_slack", "blocks", "live", "last_drafts_proposed")

    def __init__(self, tokens: list[int], nc: int, blocks: list[list[int]]) -> None:
        self.tokens = list(tokens)
        self.expected_nc: int | None = nc  # what the next step must send (None: unknown)
        self.nc_slack = 0  # how far below expected_nc a rollback may legitimately land
        self.blocks = [list(b) for b in blocks]
        self.live = True  # False: v1-preempted, row kept but not live
        self.last_drafts_proposed: list[int] | None = None


class Validator:
    def __init__(self, header: TraceHeader, path: str, max_problems: int | None) -> None:
        self.h = header
        self.path = path
        self.max_problems = max_problems
        self.problems: list[Problem] = []
        self.reqs: dict[str, _Req] = {}
        self.finished: set[str] = set()
        self.uncertain: set[str] = set()
        self.seen: set[str] = set()
        # full-attention groups: block id -> {req_id: logical block index}
        self.owners: list[dict[int, dict[str, int]]] = [{} for _ in header.kv_cache_groups]
        self.full = [g.kind == "full_attention" for g in header.kv_cache_groups]
        self.null = header.null_block_id if header.null_block_id is not None else 0
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
            raise _StopValidation

    def _check_header(self) -> None:
        h = self.h
        for i, g in enumerate(h.kv_cache_groups):
            if h.block_size % g.block_size:
                self.add("header", f"scheduler block_size {h.block_size} is not a multiple of group {i}'s "
                         f"block_size {g.block_size}", line=1, group=i, field="kv_cache_groups.block_size")
        if h.max_model_len < h.block_size:
            self.add("header", "max_model_len is shorter than one block", line=1, field="max_model_len")

    # ------------------------------------------------------------------ blocks

    def _release(self, req_id: str, req: _Req) -> None:
        for g, ids in enumerate(req.blocks):
            if not self.full[g]:
                continue
            owners = self.owners[g]
            for b in ids:
                holders = owners.get(b)
                if holders is not None:
                    holders.pop(req_id, None)
                    if not holders:
                        del owners[b]

    def _claim(self, step: Step, req_id: str, req: _Req, g: int, start: int, field_name: str) -> None:
        """Register req's blocks of group g from logical index `start`; check against other live holders."""
        if not self.full[g]:
            return
        bs = self.h.kv_cache_groups[g].block_size
        owners = self.owners[g]
        for j in range(start, len(req.blocks[g])):
            b = req.blocks[g][j]
            if b == self.null:
                continue
            holders = owners.setdefault(b, {})
            for other, oj in holders.items():
                if other == req_id or other in self.uncertain:
                    continue
                o = self.reqs.get(other)
                if o is None or not o.live:
                    continue
                lo, hi = j * bs, (j + 1) * bs
                mine, theirs = req.tokens[lo:hi], o.tokens[oj * bs:(oj + 1) * bs]
                n = min(len(mine), len(theirs))
                if oj != j or mine[:n] != theirs[:n]:
                    what = (f"logical block {j} here, {oj} in {other!r}" if oj != j
                            else f"different tokens at positions {lo}..{hi - 1}")
                    self.add("double_allocation", f"block {b} is also held by live request {other!r} ({what})",
                             step, req_id=req_id, group=g, field=field_name)
                    break
            holders[req_id] = j

    # ------------------------------------------------------------------ steps

    def salvage(self, obj: object, mentioned: set[str]) -> None:
        """A step line that did not parse: keep following the requests it mentions as far as its
        well-formed parts allow (appended blocks, sampled tokens), and stop checking what it hid: requests
        it added stay unchecked until they finish, the others skip their next num_computed_tokens check."""
        so = obj.get("scheduler_output") if isinstance(obj, dict) else None
        c = so.get("scheduled_cached_reqs") if isinstance(so, dict) else None
        appended: set[str] = set()
        if isinstance(c, dict) and isinstance(c.get("req_ids"), list) and isinstance(c.get("new_block_ids"), list):
            for r, new in zip(c["req_ids"], c["new_block_ids"]):
                req = self.reqs.get(r) if isinstance(r, str) else None
                if req is None or new is None:
                    continue
                if (isinstance(new, list) and len(new) == len(req.blocks)
                        and all(isinstance(b, list) and all(type(x) is int for x in b) for b in new)):
                    for g, b in enumerate(new):
                        req.blocks[g].extend(b)
                    appended.add(r)
        sampled = obj.get("sampled_token_ids") if isinstance(obj, dict) else None
        for r in mentioned:
            req = self.reqs.get(r)
            if req is None:
                self.uncertain.add(r)
                continue
            req.expected_nc = None  # resynchronise from the next value the scheduler sends
            toks = sampled.get(r) if isinstance(sampled, dict) else None
            if isinstance(toks, list) and all(type(t) is int for t in toks):
                req.tokens.extend(toks)
            elif toks is None and r not in appended:
                self.uncertain.add(r)

    def step(self, step: Step) -> None:
        so = step.scheduler_output
        h = self.h
        v2 = h.model_runner_protocol == "v2"
        for r in so.finished_req_ids:
            req = self.reqs.pop(r, None)
            if req is not None:
                self._release(r, req)
            self.finished.add(r)
            self.uncertain.discard(r)
        scheduled = so.num_scheduled_tokens
        for r in so.preempted_req_ids:
            if r in scheduled and not (v2 and any(nr.req_id == r for nr in so.scheduled_new_reqs)):
                self.add("preempted_in_step", "preempted in this step but also scheduled", step, req_id=r,
                         field="preempted_req_ids")
            req = self.reqs.get(r)
            if req is None:
                continue
            self._release(r, req)
            if v2:
                del self.reqs[r]
            else:
                req.live = False

        # budgets
        if so.total_num_scheduled_tokens > h.token_budget:
            self.add("budget_tokens", f"{so.total_num_scheduled_tokens} tokens exceed the budget {h.token_budget}",
                     step, field="total_num_scheduled_tokens")
        if len(scheduled) > h.max_num_seqs:
            self.add("budget_seqs", f"{len(scheduled)} requests exceed max_num_seqs {h.max_num_seqs}", step,
                     field="num_scheduled_tokens")

        for nr in so.scheduled_new_reqs:
            r = nr.req_id
            if r in self.reqs and self.reqs[r].live:
                self.add("new_id_not_new", "scheduled as new while still live (not finished or preempted)", step,
                         req_id=r, field="scheduled_new_reqs")
                self._release(r, self.reqs[r])
            elif r in self.reqs:
                self._release(r, self.reqs[r])
            self.finished.discard(r)
            self.uncertain.discard(r)
            self.seen.add(r)
            req = _Req(nr.token_ids, nr.num_computed_tokens, nr.block_ids)
            self.reqs[r] = req
            if nr.num_computed_tokens >= len(nr.token_ids):
                self.add("computed_ahead", f"num_computed_tokens {nr.num_computed_tokens} leaves nothing of "
                         f"its {len(nr.token_ids)} tokens to compute", step, req_id=r, field="num_computed_tokens")
            for g in range(h.num_groups):
                self._claim(step, r, req, g, 0, "block_ids")

        c = so.scheduled_cached_reqs
        for i, r in enumerate(c.req_ids):
            if r in self.uncertain:
                continue
            req = self.reqs.get(r)
            if req is None:
                if r in self.finished:
                    self.add("scheduled_after_finish", "scheduled after it finished", step, req_id=r,
                             field="scheduled_cached_reqs.req_ids")
                else:
                    self.add("unknown_request", "never added as a new request (or dropped on preemption)", step,
                             req_id=r, field="scheduled_cached_reqs.req_ids")
                self.uncertain.add(r)
                continue
            nc = c.num_computed_tokens[i]
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
                if new is not None:
                    req.blocks = [list(b) for b in new]
                    for g in range(h.num_groups):
                        self._claim(step, r, req, g, 0, "new_block_ids")
            else:
                exp = req.expected_nc
                if exp is not None and not h.async_scheduling:
                    if nc > exp:
                        self.add("computed_ahead", f"num_computed_tokens {nc} but only {exp} were computed", step,
                                 req_id=r, field="scheduled_cached_reqs.num_computed_tokens")
                    elif nc < exp - req.nc_slack:
                        self.add("computed_back", f"num_computed_tokens went back to {nc} from {exp} with no "
                                 "rejected drafts or preemption to explain it", step, req_id=r,
                                 field="scheduled_cached_reqs.num_computed_tokens")
                new = c.new_block_ids[i]
                if new is not None:
                    for g in range(h.num_groups):
                        start = len(req.blocks[g])
                        req.blocks[g].extend(new[g])
                        self._claim(step, r, req, g, start, "new_block_ids")
            req.expected_nc = nc

        # every scheduled request: positions, blocks, drafts
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
                bs = grp.block_size
                row = req.blocks[g]
                need = -(-end // bs)
                if len(row) < need:
                    self.add("no_block", f"position {end - 1} needs block {need - 1} but the row holds {len(row)}",
                             step, req_id=r, group=g, field="block_ids/new_block_ids")
                    continue
                first = nc // bs
                if any(b == self.null for b in row[first:need]):
                    j = first + [b == self.null for b in row[first:need]].index(True)
                    self.add("null_block",
                             f"scheduled positions in logical block {j} map to the null block {self.null}",
                             step, req_id=r, group=g, field="block_ids/new_block_ids")
                if grp.kind == "sliding_window":
                    lo = max(0, nc - grp.sliding_window + 1) // bs
                    owners = window_owner[g]
                    for j in range(lo, need):
                        b = row[j]
                        if b == self.null:
                            continue
                        prev = owners.get(b)
                        if prev is not None and prev[0] != r:
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

        # model output
        sampled = step.sampled_token_ids
        proposals = step.draft_token_ids or {}
        for r, n in scheduled.items():
            req = self.reqs.get(r)
            if req is None or r in self.uncertain:
                continue
            nc = req.expected_nc or 0
            drafts = len(so.scheduled_spec_decode_tokens.get(r, []))
            out = sampled.get(r) if sampled is not None else None
            partial = nc + n - drafts < len(req.tokens)
            if out is not None:
                if partial and out:
                    self.add("partial_sampled", f"sampled {len(out)} tokens from a partial prefill chunk", step,
                             req_id=r, field="sampled_token_ids")
                if len(out) > 1 + drafts:
                    self.add("too_many_sampled", f"{len(out)} sampled tokens for {drafts} drafts", step, req_id=r,
                             field="sampled_token_ids")
                if not partial:
                    del req.tokens[nc + n - drafts:]
                    req.tokens.extend(out)
            if sampled is None or (not partial and not out) or h.async_scheduling:
                req.expected_nc = nc + n
                req.nc_slack = drafts
            elif out is not None and drafts:
                req.expected_nc = nc + n - (drafts - max(len(out) - 1, 0))
                req.nc_slack = 0
            else:
                req.expected_nc = nc + n
                req.nc_slack = 0
            req.last_drafts_proposed = list(proposals[r]) if r in proposals else None


def _raw_req_ids(obj: object) -> set[str]:
    """Request ids a (possibly malformed) step line mentions, so that its failure does not cascade."""
    out: set[str] = set()
    if not isinstance(obj, dict):
        return out
    so = obj.get("scheduler_output")
    if not isinstance(so, dict):
        return out
    nst = so.get("num_scheduled_tokens")
    if isinstance(nst, dict):
        out.update(k for k in nst if isinstance(k, str))
    new = so.get("scheduled_new_reqs")
    for nr in new if isinstance(new, list) else []:
        if isinstance(nr, dict) and isinstance(nr.get("req_id"), str):
            out.add(nr["req_id"])
    c = so.get("scheduled_cached_reqs")
    if isinstance(c, dict) and isinstance(c.get("req_ids"), list):
        out.update(r for r in c["req_ids"] if isinstance(r, str))
    return out


def _kind_of(e: TraceError) -> str:
    if e.field == "total_num_scheduled_tokens":
        return "total_mismatch"
    if e.field == "step":
        return "step_order"
    if "block id" in e.message and "outside" in e.message:
        return "block_range"
    if "JSON" in e.message or "truncated" in e.message or "blank line" in e.message:
        return "json"
    return "schema"


def validate(trace: Trace, max_problems: int | None = None, deep: bool = False) -> ValidationReport:
    report = ValidationReport(trace=trace.name)
    v = Validator(trace.header, trace.name, max_problems)
    unknown_keys: Counter[str] = Counter()
    i = 0
    try:
        for line, raw in trace.raw_steps():
            where = _Where(trace.name, line, i)
            i += 1
            if not raw.strip():
                v.add("json", "blank line", line=line, step_idx=i - 1)
                continue
            try:
                obj = _loads(raw)
            except json.JSONDecodeError as e:
                v.add("json", f"not JSON ({e.msg} at column {e.colno})", line=line, step_idx=i - 1)
                continue
            try:
                # fast_step: the same Step on a well-formed line, with builtins only (no numpy import)
                step = fast_step(obj, trace.header, where) or parse_step(obj, trace.header, where)
            except TraceError as e:
                v.add(_kind_of(e), e.message, line=line, step_idx=i - 1, req_id=e.req_id, group=e.group,
                      field=e.field)
                v.salvage(obj, _raw_req_ids(obj))
                continue
            if isinstance(obj, dict):
                unknown_keys.update(k for k in obj if k not in ("step", "scheduler_output", "sampled_token_ids",
                                                                  "draft_token_ids"))
            v.step(step)
    except _StopValidation:
        report.truncated = True
    except TraceError as e:  # the file itself became unreadable (e.g. gzip cut short)
        v.problems.append(Problem("json", e.message, e.line, None))
    report.steps = i
    report.requests = len(v.seen)
    report.problems = v.problems
    if unknown_keys:
        report.info.append("unknown step keys (ignored): " + ", ".join(f"{k} x{n}" for k, n in unknown_keys.items()))
    if trace.header.extra:
        report.info.append("informational header keys: " + ", ".join(sorted(trace.header.extra)))
    if deep and report.valid:
        report.deep = deep_check(trace)
        if report.deep["problems"]:
            report.problems.extend(Problem(**p) for p in report.deep["problems"])
    return report


def deep_check(trace: Trace) -> dict:
    """Replay through every available worker; compare each step with the reference; KV canary every step."""
    from kvmap.replay import replay
    from kvmap.worker import BACKENDS, make_worker

    problems: list[dict] = []
    ref: list[dict] = []
    try:
        r = replay(trace, backend="reference", on_mappings=ref.append, write_kv=False, nvtx=False, warmup=0)
    except KvmapError as e:
        return {"backends": [], "problems": [asdict(Problem("schema", f"replay failed: {e.message}", e.line, e.step,
                                                            e.req_id, e.group, e.field))]}
    compared: dict = {}
    skipped: dict = {}
    for backend in [b for b in BACKENDS if b != "reference"]:
        got: list[dict] = []
        try:
            worker = make_worker(backend, trace.header)
        except KvmapError as e:  # not installed, or needs an environment (triton on CPU: TRITON_INTERPRET=1)
            skipped[backend] = e.message
            continue
        kv = replay(trace, worker=worker, on_mappings=got.append, verify_kv=True, nvtx=False, warmup=0)
        diffs = 0
        for g, w in zip(got, ref):
            if g != w:
                diffs += 1
                if diffs <= 5:
                    key = next(k for k in w if g.get(k) != w[k])
                    problems.append(asdict(Problem("schema", f"{backend} differs from the reference in {key}",
                                                   None, w["step"], field=key)))
        compared[backend] = {"steps": len(got), "differing_steps": diffs, "kv_checked": kv.kv_checked,
                             "kv_mismatches": kv.kv_mismatches}
        for e in kv.kv_examples[:5]:
            problems.append(asdict(Problem("schema", f"KV mismatch at position {e['position']} slot {e['slot']}: "
                                           f"found {e['found']}", None, e["step"], e["req_id"], e["group"])))
    return {"reference_steps": r.steps_replayed, "backends": compared, "skipped": skipped, "problems": problems}
