"""`kvmap validate`'s driver: read every line leniently, feed the shadow model, collect the report.

Rules: a line that does not parse is one problem, of the kind its `TraceError` carries, and the requests it
mentions become uncertain (no cascade); the file itself becoming unreadable ends the pass with one problem.
"""

from __future__ import annotations

import json
from collections import Counter

from kvmap.errors import TraceError
from kvmap.trace import ASYNC_SPEC_KEYS, Trace, Where, loads, parse_step
from kvmap.validate.problems import Problem, ValidationReport
from kvmap.validate.shadow import StopValidation, Validator


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


STEP_KEYS = frozenset({"step", "scheduler_output", "sampled_token_ids", "draft_token_ids"}) | ASYNC_SPEC_KEYS


def validate(trace: Trace, max_problems: int | None = None, deep: bool = False,
             backends: list[str] | None = None) -> ValidationReport:
    """Every problem of `trace`; with `deep`, also replay `backends` (default: all) against the reference."""
    report = ValidationReport(trace=trace.name)
    v = Validator(trace.header, trace.name, max_problems)
    unknown_keys: Counter[str] = Counter()
    i = 0
    try:
        for line, raw in trace.raw_steps():
            where = Where(trace.name, line, i)
            i += 1
            if not raw.strip():
                v.add("json", "blank line", line=line, step_idx=i - 1)
                continue
            try:
                obj = loads(raw)
            except json.JSONDecodeError as e:
                v.add("json", f"not JSON ({e.msg} at column {e.colno})", line=line, step_idx=i - 1)
                continue
            try:
                step = parse_step(obj, trace.header, where)
            except TraceError as e:
                v.add(e.kind or "schema", e.message, line=line, step_idx=i - 1, req_id=e.req_id, group=e.group,
                      field=e.field)
                v.salvage(obj, _raw_req_ids(obj))
                continue
            if isinstance(obj, dict):
                unknown_keys.update(k for k in obj if k not in STEP_KEYS)
            v.step(step)
    except StopValidation:
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
        from kvmap.validate.deep import deep_check

        report.deep = deep_check(trace, backends)
        if report.deep["problems"]:
            report.problems.extend(Problem(**p) for p in report.deep["problems"])
    return report
