"""Batch order for both runners: Model Runner V2's sort (the default) and V1's persistent batch (lowest hole,
condense, the optional 4-region reorder), the same in every backend."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import CachedRequestData, NewRequestData, SchedulerOutput, Step, Trace
from kvmap.workers.mappings import dump_line
from kvmap.workers.order import V1PersistentBatch, mrv2_key

from .conftest import bundled_traces


def _step(i, new=(), cached=(), n=None, finished=(), resumed=(), nc=None, preempted=()):
    """A step with `new` requests (prompt of 10 tokens) and `cached` ones; n: req -> scheduled tokens."""
    new_reqs = [NewRequestData(r, list(range(10)), [[]], 0, None) for r in new]
    cached = list(cached)
    nc = nc or {}
    c = CachedRequestData(cached, set(resumed), [None] * len(cached), [nc.get(r, 10) for r in cached], {}, None)
    n = n or {r: 1 for r in [*new, *cached]}
    return Step(i, i + 2, SchedulerOutput(new_reqs, c, n, sum(n.values()), {}, list(finished), list(preempted)),
                None, None)


def _nc(step):
    so = step.scheduler_output
    out = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
    out.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
    return out


def test_v1_fills_the_hole_with_the_last_row():
    b = V1PersistentBatch()
    s = _step(0, new="ABCD")
    assert b.update(s, _nc(s)) == list("ABCD")
    s = _step(1, cached="ABD", finished="C")  # C finished: D (the last row) moves into row 2
    assert b.update(s, _nc(s)) == list("ABD")
    s = _step(2, new="E", cached="ABD", finished="")  # a new request is appended after the condensed rows
    assert b.update(s, _nc(s)) == list("ABDE")


def test_v1_unscheduled_rows_leave_and_come_back_into_the_lowest_hole():
    b = V1PersistentBatch()
    s = _step(0, new="ABCD")
    b.update(s, _nc(s))
    s = _step(1, cached="ACD")  # B not scheduled: its row 1 is refilled by D (condense)
    assert b.update(s, _nc(s)) == list("ADC")
    s = _step(2, new="E", cached="ABCD")  # new first (lowest hole: none, append), then re-added B
    assert b.update(s, _nc(s)) == list("ADCEB")


def test_v1_adds_a_v2_resume_after_the_new_and_re_added_requests():
    b = V1PersistentBatch()
    s = _step(0, new="ABCD")
    b.update(s, _nc(s))
    s = _step(1, cached="AD", preempted="B")  # B preempted, C merely unscheduled: D moves into row 1
    assert b.update(s, _nc(s)) == list("AD")
    # v2 protocol: B comes back as new, listed before the new E; V1's scheduler sends it resumed, after the
    # running ones: E, then the re-added C, then B
    s = _step(2, new="BE", cached="ADC")
    assert b.update(s, _nc(s)) == list("ADECB")


def test_v1_reorder_puts_decodes_first_by_swaps():
    b = V1PersistentBatch(reorder_batch_threshold=1)
    s = _step(0, new="ABC", n={"A": 10, "B": 10, "C": 10})
    assert b.update(s, _nc(s)) == list("ABC")  # all pure prefills
    # A: long extend (4 tokens, nc 6 < 10), B: decode (1 token, done), C: short extend (1 token, nc 5 < 10)
    s = _step(1, cached="ABC", n={"A": 4, "B": 1, "C": 1}, nc={"A": 6, "B": 10, "C": 5})
    assert b.update(s, _nc(s)) == list("BCA")


def test_mrv2_key_orders_drafts_first():
    k = 2
    reqs = [("p", 8, 0), ("d", 1, 0), ("s", 3, 2), ("e", 3, 0)]
    order = [r for r, n, d in sorted(reqs, key=lambda x: mrv2_key(x[1], x[2], k))]
    assert order == ["s", "e", "d", "p"]


SMALL = [p for p in bundled_traces() if p.name.endswith(".jsonl")]


@pytest.mark.parametrize("threshold", [None, 1, 16])
@pytest.mark.parametrize("path", SMALL, ids=lambda p: p.name)
def test_every_backend_has_the_same_v1_order(path, threshold):
    dumps = {}
    for backend in ("reference", "numpy", "numba", "torch"):
        lines: list[str] = []
        replay(Trace(path), ReplayConfig(backend=backend, batch_order="v1", reorder_batch_threshold=threshold,
                                         verify_kv=True, nvtx=False), on_mappings=lambda d: lines.append(dump_line(d)))
        dumps[backend] = lines
    assert dumps["numpy"] == dumps["reference"] == dumps["numba"] == dumps["torch"]


class _AlwaysApplied(V1PersistentBatch):
    """The persistent batch with every step applied in full (no shortcut for a step that only repeats the last
    step's requests): the order the shortcut must keep."""

    def update(self, step, num_computed):
        so = step.scheduler_output
        if not so.finished_req_ids:  # a finished id nobody holds: the full path, the same state after it
            step = replace(step, scheduler_output=replace(so, finished_req_ids=["never scheduled"]))
        return super().update(step, num_computed)


@pytest.mark.parametrize("threshold", [None, 1, 4])
def test_a_step_repeating_the_last_ones_requests_keeps_the_order_the_full_update_gives(threshold):
    """Every bundled trace: the shortcut (the same requests as the last step, none leaving or coming) gives
    the order the full update gives, with and without the 4-region reorder; and it is taken on most steps."""
    shortcuts = total = 0
    for path in bundled_traces():
        fast, full = V1PersistentBatch(threshold), _AlwaysApplied(threshold)
        for step in Trace(path).steps():
            so = step.scheduler_output
            before = dict(fast.index)
            shortcuts += not (so.finished_req_ids or so.preempted_req_ids or so.scheduled_new_reqs
                              or so.scheduled_cached_reqs.resumed_req_ids) and so.num_scheduled_tokens.keys() == (
                before.keys())
            total += 1
            assert fast.update(step, _nc(step)) == full.update(step, _nc(step)), (path.name, step.step)
    assert shortcuts > total // 2, (shortcuts, total)
