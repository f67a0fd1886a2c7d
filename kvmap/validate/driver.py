"""`kvmap validate`'s driver: read every line leniently, feed the shadow model, collect the report.

Rules: a line that does not parse is one problem, of the kind its `TraceError` carries; the parts of it that
did parse still inform the shadow model, and the requests it hid become uncertain (no cascade). A blank line
is one problem and no step; problems beyond problems.py's `KEPT_PROBLEMS` are only counted. A wrong step
number is one problem and the count follows the file from there. A file cut short is validated up to its last
complete line, with the reader's one warning (also in `--json`).
"""

from __future__ import annotations

import json
from collections import Counter

from kvmap.errors import TraceError
from kvmap.trace import ASYNC_SPEC_KEYS, Trace, Where, loads, parse_step
from kvmap.trace.reader import json_error
from kvmap.validate.problems import KEPT_PROBLEMS, KeptProblems, Problem, ValidationReport
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


def _readable(raw: bytes) -> object | None:
    """A line that is JSON once its undecodable bytes are replaced (its fields still inform the model)."""
    try:
        return loads(raw.decode("utf-8", "replace"))
    except json.JSONDecodeError:
        return None


def _step_number(obj: object, expected: int) -> int:
    """The step a line claims to be (when it says so as an integer), so that one missing or repeated step is
    one `step_order` problem and the count resynchronises, instead of one problem per later line."""
    step = obj.get("step") if isinstance(obj, dict) else None
    return step if type(step) is int and step >= 0 else expected


class _Pass:
    """One lenient pass over the step lines, feeding the shadow model."""

    def __init__(self, trace: Trace, v: Validator) -> None:
        self.trace, self.v = trace, v
        self.i = 0  # the step the next line should be
        self.pos = 0  # the step lines before this one: a claim equal to it ends a one-line slip
        self.unknown_keys: Counter[str] = Counter()

    def line(self, line: int, raw: bytes) -> None:
        v = self.v
        if not raw.strip():
            v.add("json", "blank line (a trace has one JSON object on every line)", line=line, step_idx=self.i)
            return
        clean = True
        try:
            obj = loads(raw)
        except json.JSONDecodeError as e:
            clean = False
            v.add("json", json_error(raw, e, None, line, self.i).message, line=line, step_idx=self.i)
            obj = _readable(raw)
            if obj is None:  # nothing of the line is known: no cascade from what it hid
                v.lost_line()
                self.i += 1
                self.pos += 1
                return
        step_idx = self._number(obj, line)
        where = Where(self.trace.name, line, step_idx)
        try:
            step = parse_step(obj, self.trace.header, where)
        except TraceError as e:
            if clean:
                v.add(e.kind or "schema", e.message, line=line, step_idx=step_idx, req_id=e.req_id, group=e.group,
                      field=e.field)
            v.salvage(obj, _raw_req_ids(obj), line, step_idx)
            return
        if isinstance(obj, dict):
            self.unknown_keys.update(k for k in obj if k not in STEP_KEYS)
            _check_cascade(v, obj, line, step_idx)
        if clean:
            v.step(step)
        else:  # already one problem (not UTF-8): follow it as a line that did not parse
            v.salvage(obj, _raw_req_ids(obj), line, step_idx)

    def _number(self, obj: object, line: int) -> int:
        """This line's step index. A wrong number is one problem, located at the step expected (as `replay`
        names it), and the count follows the file from there (a missing or repeated step), unless the next line
        returns to the count by position (one mistyped number: the line after it is not a problem)."""
        claimed = _step_number(obj, self.i)
        self.pos += 1
        if claimed != self.i:
            if claimed != self.pos - 1:  # not back in step by position after a one-line slip
                self.v.add("step_order", f"steps must be consecutive from 0: expected step {self.i}, got {claimed}",
                           line=line, step_idx=self.i, field="step")
            self.i = claimed
        self.i += 1
        return self.i - 1


def _check_cascade(v: Validator, obj: dict, line: int, step_idx: int) -> None:
    """`num_common_prefix_blocks` (one count per KV cache group): vLLM 0.33 always sends [] (cascade attention is
    removed: vllm/v1/core/sched/output.py:318-320, every builder gets common_prefix_len 0); older vLLM sent one
    count per group, 0 when no prefix is shared. A positive count is a step whose attention used (or could have
    used) a cascade prefix that kvmap's forward inputs, vLLM 0.33's, do not model."""
    so = obj.get("scheduler_output")
    blocks = so.get("num_common_prefix_blocks") if isinstance(so, dict) else None
    if isinstance(blocks, list) and any(type(n) is int and n > 0 for n in blocks):
        v.add("cascade", f"num_common_prefix_blocks {blocks[:8]!r:.80} claims a common prefix for cascade "
              "attention, which vLLM 0.33 removed (docs/trace-format.md, \"Cascade attention\")", line=line,
              step_idx=step_idx, field="num_common_prefix_blocks")


def validate(trace: Trace, max_problems: int | None = None, deep: bool = False,
             backends: list[str] | None = None, progress=None) -> ValidationReport:
    """Every problem of `trace`; with `deep`, also replay `backends` (default: all) against the reference."""
    report = ValidationReport(trace=trace.name)
    warn = trace.warn
    trace.warn = lambda message: (report.warnings.append(message), warn(message))
    v = Validator(trace.header, trace.name, max_problems)
    kept = KeptProblems(max(KEPT_PROBLEMS, max_problems or 0))  # bounded memory on any input
    kept.extend(v.problems)  # the header's
    v.problems = kept
    run = _Pass(trace, v)
    try:
        for line, raw in trace.raw_lines():
            run.line(line, raw)
    except StopValidation:
        report.truncated = True
    except TraceError as e:  # the file itself became unreadable
        v.problems.append(Problem("json", e.message, e.line, None))
    finally:
        trace.warn = warn
    report.steps, report.requests, report.problems = run.i, len(v.seen), v.problems
    if run.unknown_keys:
        report.info.append("unknown step keys (ignored): " + ", ".join(f"{k} x{n}" for k, n in
                                                                      run.unknown_keys.items()))
    if trace.header.extra:
        report.info.append("informational header keys: " + ", ".join(sorted(trace.header.extra)))
    if deep and not report.valid:
        report.info.append("--deep not run: it replays a valid trace through every worker, and this trace has "
                           "the problems above")
    elif deep:
        from kvmap.validate.deep import deep_check

        report.deep = deep_check(trace, backends, progress)
        if report.deep["problems"]:
            report.problems.extend(Problem(**p) for p in report.deep["problems"])
    return report
