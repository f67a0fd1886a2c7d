"""Fuzzing `validate` and `replay` with broken inputs: every one ends in a clean result or a clean one-line
error (KvmapError), never another exception and never a hang. Bounded: a fixed budget of examples and time.

Two sources of broken input: byte-level mutations of real bundled traces (flip, delete, insert, truncate,
duplicate a line) and hypothesis-built JSON values dropped into a step's fields.
"""

from __future__ import annotations

import json
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmap.errors import KvmapError
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace
from kvmap.validate import validate

from .conftest import TRACES, read_lines, write_lines

SOURCES = ["worked_example.jsonl", "prefix_caching.jsonl", "spec_decode.jsonl", "preemption_v1.jsonl",
           "hybrid_sliding_window.jsonl"]


def run_both(path) -> str:
    """'ok', or 'error' for a clean KvmapError; anything else propagates and fails the test."""
    outcome = "ok"
    try:
        validate(Trace(path), max_problems=50)
    except KvmapError:
        outcome = "error"
    try:
        replay(Trace(path), ReplayConfig(nvtx=False, write_kv=False, warmup=0))
    except KvmapError:
        outcome = "error"
    return outcome


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0:  # flip bytes
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1:  # delete a span
        i = rng.randrange(len(b))
        del b[i:i + rng.randint(1, 64)]
    elif kind == 2:  # insert JSON-ish noise
        i = rng.randrange(len(b))
        b[i:i] = rng.choice([b"null", b"-1", b"[]", b"{}", b'"x"', b"1e400", b",", b"]", b"}", b"\n", b"99999999999"])
    elif kind == 3:  # truncate
        del b[rng.randrange(len(b)):]
    elif kind == 4:  # duplicate or drop a line
        lines = bytes(b).split(b"\n")
        i = rng.randrange(len(lines))
        if rng.random() < 0.5:
            lines.insert(i, lines[i])
        else:
            del lines[i]
        b = bytearray(b"\n".join(lines))
    else:  # swap two digits inside a number
        digits = [i for i, c in enumerate(b) if 48 <= c <= 57]
        if digits:
            b[rng.choice(digits)] = rng.randrange(48, 58)
    return bytes(b)


def test_byte_mutations_of_real_traces(tmp_path):
    rng = random.Random(1234)
    counts = {"ok": 0, "error": 0}
    deadline = time.monotonic() + 40
    tried = 0
    while tried < 1500 and time.monotonic() < deadline:
        src = (TRACES / rng.choice(SOURCES)).read_bytes()
        path = tmp_path / f"m{tried % 4}.jsonl"
        path.write_bytes(mutate(src, rng))
        counts[run_both(path)] += 1
        tried += 1
    assert tried >= 300, f"only {tried} inputs in the time budget"
    assert counts["error"] > 0  # the mutations do break traces
    print(f"byte mutations: {tried} inputs, {counts['error']} clean errors, {counts['ok']} still valid, 0 crashes")


@pytest.mark.parametrize("name", [p.name for p in sorted(TRACES.glob("*.jsonl"))])
@pytest.mark.parametrize("past", [False, True], ids=["last_id", "one_past"])
def test_block_ids_at_the_pools_edge(tmp_path, name, past):
    """A trace's first new request given the pool's last ids (num_gpu_blocks - 1, - 2, ...: replayed with the KV
    written and read back whenever validate finds the trace valid) or one past the pool in every entry (refused
    at the boundary, by validate and by replay; a missing check would reach the KV write's guard, an
    IndexError, instead)."""
    lines = read_lines(TRACES / name)
    at = next(i for i, x in enumerate(lines[1:], 1) if x["scheduler_output"]["scheduled_new_reqs"])
    pool = lines[0]["num_gpu_blocks"]
    req = lines[at]["scheduler_output"]["scheduled_new_reqs"][0]
    top = iter(range(pool - 1, 0, -1))  # distinct ids across the request's groups (one pool)
    req["block_ids"] = [[pool if past else next(top) for _ in row] for row in req["block_ids"]]
    path = write_lines(tmp_path / name, lines[:at + 3])
    report = validate(Trace(path), max_problems=5)
    try:
        replay(Trace(path), ReplayConfig(nvtx=False, warmup=0, verify_kv=True, forward=True))
        refused = None
    except KvmapError as e:
        refused = e.kind
    if past:
        assert "block_range" in {q.kind for q in report.problems} and refused == "block_range", (report, refused)
    elif report.valid:  # (the ids may also be held by another request: validate names that)
        assert refused is None, refused


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**40) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8)

FIELDS = [("scheduler_output", "num_scheduled_tokens"), ("scheduler_output", "total_num_scheduled_tokens"),
          ("scheduler_output", "scheduled_new_reqs"), ("scheduler_output", "scheduled_cached_reqs"),
          ("scheduler_output", "finished_req_ids"), ("scheduler_output", "preempted_req_ids"),
          ("scheduler_output", "scheduled_spec_decode_tokens"), ("sampled_token_ids",), ("draft_token_ids",),
          ("step",), ("scheduler_output",), ("cached", "req_ids"), ("cached", "new_block_ids"),
          ("cached", "num_computed_tokens"), ("cached", "resumed_req_ids"), ("new0", "block_ids"),
          ("new0", "prompt_token_ids"), ("new0", "num_computed_tokens"), ("new0", "req_id")]


def set_field(step: dict, which: tuple[str, ...], value: object) -> bool:
    """Put `value` at the place `which` (one of FIELDS) names; False when the step has no such place."""
    so = step["scheduler_output"]
    if which[0] == "cached":
        so["scheduled_cached_reqs"][which[1]] = value
    elif which[0] == "new0":
        if not so["scheduled_new_reqs"]:
            return False
        so["scheduled_new_reqs"][0][which[1]] = value
    elif len(which) == 2:
        so[which[1]] = value
    else:
        step[which[0]] = value
    return True


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(which=st.sampled_from(FIELDS), value=JSONISH, line=st.integers(1, 3))
def test_hypothesis_values_in_step_fields(tmp_path, which, value, line):
    lines = [json.loads(x) for x in (TRACES / "worked_example.jsonl").read_text().splitlines()]
    if not set_field(lines[line], which, value):
        return
    path = tmp_path / "h.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_both(path)


@pytest.mark.parametrize("header_value", [None, 0, -3, "16", [], {}, 2**70])
def test_header_values(tmp_path, header_value):
    for key in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_model_len", "kv_cache_groups",
                "max_num_batched_tokens", "num_speculative_tokens"):
        lines = [json.loads(x) for x in (TRACES / "worked_example.jsonl").read_text().splitlines()]
        lines[0][key] = header_value
        path = tmp_path / "hd.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        run_both(path)
