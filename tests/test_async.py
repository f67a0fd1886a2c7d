"""Async scheduling (vLLM's default): discarded outputs, -1 draft placeholders, optimistic num_computed_tokens and
its recorded correction. Every backend replays the bundled async traces like the reference (test_bundled_traces);
here: the rules, and planted faults named at their step and request."""

from __future__ import annotations

import copy

from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace
from kvmap.validate import validate

from .conftest import TRACES, read_lines, write_lines

ASYNC_SPEC = TRACES / "async_spec_decode.jsonl"


def _first(lines, key):
    """(line index, request) of the first step whose `key` holds a non-zero value."""
    for i, d in enumerate(lines[1:], 1):
        for r, v in (d.get(key) or {}).items():
            if v:
                return i, r
    raise AssertionError(f"no step with a non-zero {key}")


def test_async_traces_validate_and_replay_with_verified_kv():
    for name in ("async_decode.jsonl", "async_spec_decode.jsonl"):
        assert validate(Trace(TRACES / name)).valid, name
        r = replay(Trace(TRACES / name), ReplayConfig(verify_kv=True, nvtx=False))
        assert r.kv_checked > 0 and r.kv_mismatches == 0
    r = replay(Trace(ASYNC_SPEC), ReplayConfig(nvtx=False))
    assert r.standin_tokens == 0  # the real drafts were recorded (spec_draft_token_ids)


def test_the_correction_is_the_in_flight_step_s_rejections():
    """docs/trace-format.md: this step's num_computed_tokens assumed every in-flight draft was accepted."""
    lines = read_lines(ASYNC_SPEC)
    prev: dict[str, int] = {}
    checked = 0
    for d in lines[1:]:
        for r, k in d.get("num_computed_tokens_correction", {}).items():
            if r in prev:
                assert k == prev[r], (d["step"], r)
                checked += 1
        prev = d.get("num_rejected_tokens", {})
    assert checked > 10


def test_a_wrong_correction_is_named_at_its_step_and_request(tmp_path):
    lines = read_lines(ASYNC_SPEC)
    i, r = _first(lines, "num_computed_tokens_correction")
    bad = copy.deepcopy(lines)
    bad[i]["num_computed_tokens_correction"][r] -= 1  # the worker would start one token too late
    rep = validate(Trace(write_lines(tmp_path / "t.jsonl", bad)))
    p = rep.problems[0]
    assert (p.kind, p.step, p.req_id, p.field) == ("computed_ahead", bad[i]["step"], r,
                                                    "num_computed_tokens_correction")


def test_a_wrong_rejection_count_is_named_at_its_step_and_request(tmp_path):
    lines = read_lines(ASYNC_SPEC)
    i, r = _first(lines, "num_rejected_tokens")
    bad = copy.deepcopy(lines)
    bad[i]["num_rejected_tokens"][r] -= 1
    rep = validate(Trace(write_lines(tmp_path / "t.jsonl", bad)))
    kinds = {(p.kind, p.step, p.req_id) for p in rep.problems}
    assert ("rejected_mismatch", bad[i]["step"], r) in kinds


def test_without_recorded_drafts_the_input_ids_are_honest_stand_ins(tmp_path):
    lines = read_lines(ASYNC_SPEC)
    for d in lines[1:]:
        d.pop("spec_draft_token_ids", None)
    r = replay(Trace(write_lines(tmp_path / "t.jsonl", lines)), ReplayConfig(nvtx=False))
    placeholders = sum(len(v) for d in lines[1:]
                       for v in d["scheduler_output"]["scheduled_spec_decode_tokens"].values())
    assert r.standin_tokens == placeholders > 0
