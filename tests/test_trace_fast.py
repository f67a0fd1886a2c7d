"""The step parser's fast path (`fast_step`) against the checked one (`parse_step`): on every line either the
fast path steps aside (None) or both give the same Step; whenever `parse_step` rejects a line, the fast path
steps aside, so every problem is still named by the checked parser."""

from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmap.errors import TraceError
from kvmap.trace import Trace, Where, fast_step, parse_step

from .conftest import TRACES, bundled_traces
from .test_fuzz import FIELDS, JSONISH, set_field


def lines_of(path):
    op = gzip.open if path.suffix == ".gz" else open
    with op(path, "rt") as f:
        return [json.loads(x) for x in f.read().splitlines()]


def both(obj, header, i):
    where = Where("t.jsonl", i + 2, i)
    fast = fast_step(obj, header, where)
    try:
        slow = parse_step(obj, header, where)
    except TraceError:
        assert fast is None, "the fast path accepted a line the checked parser rejects"
        return None, "rejected"
    assert fast is None or fast == slow
    return fast, "ok"


@pytest.mark.parametrize("path", bundled_traces(), ids=lambda p: p.name)
def test_fast_path_takes_every_bundled_line(path):
    header = Trace(path).header
    for i, obj in enumerate(lines_of(path)[1:]):
        fast, verdict = both(obj, header, i)
        assert verdict == "ok" and fast is not None, f"line {i + 2}: the fast path stepped aside"


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.sampled_from(FIELDS + [("cached", "all_token_ids"), ("cached", "num_output_tokens"),
                                       ("new0", "prefill_token_ids"), ("kind",)]),
       value=JSONISH, line=st.integers(1, 3),
       src=st.sampled_from(["worked_example.jsonl", "spec_decode.jsonl", "hybrid_sliding_window.jsonl"]))
def test_fast_path_never_accepts_what_the_checked_parser_rejects(which, value, line, src):
    path = TRACES / src
    lines = lines_of(path)
    header = Trace(path).header
    if set_field(lines[line], which, value):
        both(lines[line], header, line - 1)


@pytest.mark.parametrize("mutation", [
    lambda s: s["scheduler_output"]["num_scheduled_tokens"].update(B=True),  # a bool is not a count
    lambda s: s["scheduler_output"]["scheduled_cached_reqs"].update(num_computed_tokens=[31.0]),
    lambda s: s.update(sampled_token_ids={"B": [2**31]}),  # one past the int32 token range
    lambda s: s.update(sampled_token_ids={"B": [True]}),
    lambda s: s["scheduler_output"]["scheduled_cached_reqs"]["new_block_ids"].__setitem__(0, [[96]]),
    lambda s: s["scheduler_output"].update(finished_req_ids=[1]),
])
def test_fast_path_steps_aside_on_edge_values(mutation):
    path = TRACES / "worked_example.jsonl"
    lines = lines_of(path)
    step = lines[2]
    mutation(step)
    assert fast_step(step, Trace(path).header, Where("t", 3, 1)) is None
