"""validate = replay, by fault injection: every fault that makes replay refuse a trace is a validate problem
of the same kind at the same step and request, and every fault that makes replay's KV read-back find another
token's bits is a validate problem at or before that step. Faults are planted into the bundled real traces at
sites hypothesis picks (tests/faults.py); the real traces themselves stay valid for both.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmap
from kvmap.errors import TraceError
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace
from kvmap.validate import validate

from . import faults as F

# replay's kind -> validate kinds that name the same condition
SAME = {"unknown_request": {"unknown_request", "scheduled_after_finish"}}


def replay_outcome(path):
    """('refused', TraceError) or ('ran', first KV-mismatch step or None)."""
    try:
        r = replay(Trace(path), ReplayConfig(backend="numpy", verify_kv=True, nvtx=False, warmup=0))
    except TraceError as e:
        return "refused", e
    first = min((e["step"] for e in r.kv_examples), default=None)
    return "ran", first


def check_agree(path):
    outcome, detail = replay_outcome(path)
    report = validate(Trace(path))
    probs = report.problems
    if outcome == "refused":
        e = detail
        kinds = SAME.get(e.kind, {e.kind})
        match = [p for p in probs if p.step == e.step and (e.req_id is None or p.req_id == e.req_id)
                 and (e.kind == "schema" or p.kind in kinds)]
        assert match, (f"replay refused at step {e.step} request {e.req_id!r} ({e.kind}: {e.message}); "
                       f"validate found {[(p.kind, p.step, p.req_id) for p in probs][:8]}")
    elif detail is not None:
        assert any(p.step is not None and p.step <= detail for p in probs), \
            f"replay found KV mismatches from step {detail}; validate found {probs[:5]}"
    return outcome, report


@pytest.mark.parametrize("name", F.SMALL)
def test_real_traces_valid_for_both(name):
    outcome, report = check_agree(F.TRACES / name)
    assert outcome == "ran" and report.valid, report.problems[:3]


@pytest.mark.parametrize("mutator", F.MUTATORS, ids=lambda m: m.__name__)
def test_each_fault_found_by_validate(mutator, tmp_path):
    """Each mutator, on every small trace that has a site for it: validate reports the planted fault (and
    agrees with replay wherever replay refuses or finds KV mismatches)."""
    planted = 0
    for name, path, (step, req) in F.plant_everywhere(mutator, tmp_path):
        planted += 1
        _, report = check_agree(path)
        assert not report.valid, f"{name}: {mutator.__name__} at step {step} {req!r} not found"
        assert any(p.step == step for p in report.problems), (name, step, req, report.problems[:5])
    assert planted, f"no bundled trace has a site for {mutator.__name__}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(F.SMALL), mutator=st.sampled_from(F.MUTATORS), seed=st.integers(0, 2**16))
def test_validate_agrees_with_replay(name, mutator, seed, tmp_path):
    got = F.plant(name, mutator, seed, tmp_path)
    if got is not None:
        check_agree(got[0])


# every kind the host workers' state refuses a trace with (workers/state.py, workers/continuation.py) -> the
# fault that makes replay refuse with it
REFUSALS = {"unknown_request": F.unknown_cached, "new_id_not_new": F.new_while_preempted,
            "budget_seqs": F.few_rows, "max_model_len": F.short_model_len, "row_width": F.wide_row,
            "resumed_no_blocks": F.resumed_without_row, "preempted_scheduled": F.not_resumed,
            "no_block": F.schedule_more, "tokens_unknown": F.drop_sampled,
            "continuation_mismatch": F.new_twice}


def test_every_refusal_of_replay_is_planted():
    """A new refusal in the workers' state needs its planted fault here."""
    root = Path(kvmap.__file__).parent / "workers"
    raised = set()
    for name in ("state.py", "continuation.py"):
        raised |= set(re.findall(r'kind="(\w+)"', (root / name).read_text()))
    assert raised == set(REFUSALS), raised ^ set(REFUSALS)


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_each_refusal_named_by_validate(kind, tmp_path):
    """Replay refuses with `kind` on some bundled trace with the fault planted, and validate names the same
    kind at the same step and request."""
    refused = 0
    for name, path, _ in F.plant_everywhere(REFUSALS[kind], tmp_path):
        outcome, e = replay_outcome(path)
        if outcome != "refused" or e.kind != kind:
            continue
        refused += 1
        found = {(p.kind, p.step, p.req_id) for p in validate(Trace(path)).problems}
        assert (kind, e.step, e.req_id) in found, (name, e.step, e.req_id, sorted(found)[:8])
    assert refused, f"no bundled trace makes replay refuse with {kind}"


@pytest.mark.parametrize("mutator", sorted(F.REPLAY_RUNS, key=lambda m: m.__name__), ids=lambda m: m.__name__)
def test_faults_replay_runs_through(mutator, tmp_path):
    """A block held by two groups and a finished id listed again: replay runs through (see faults.py), and
    validate names the fault at its step and request."""
    kind = {"cross_group_block": "group_conflict", "finish_twice": "finished_twice"}[mutator.__name__]
    planted = 0
    for _, path, (step, req) in F.plant_everywhere(mutator, tmp_path):
        planted += 1
        assert replay_outcome(path)[0] == "ran"
        assert (kind, step, req) in {(p.kind, p.step, p.req_id) for p in validate(Trace(path)).problems}
    assert planted


def test_blank_line_is_one_problem_at_its_line(tmp_path):
    L = F.load("preemption_v1.jsonl")
    text = "".join(json.dumps(x) + "\n" for x in L)
    lines = text.splitlines(keepends=True)
    lines.insert(20, "\n")  # line 21 is blank; the step lines after it keep their numbers
    p = tmp_path / "blank.jsonl"
    p.write_text("".join(lines))
    report = validate(Trace(p))
    assert [(x.kind, x.line) for x in report.problems] == [("json", 21)]
    with pytest.raises(TraceError) as e:
        list(Trace(p).steps())
    assert e.value.line == 21 and e.value.kind == "json"


def test_bad_line_still_frees_its_finished_requests(tmp_path):
    """One wrongly typed field on a line that finishes requests: one problem, no false double allocation
    when the freed blocks are reused later."""
    L = F.load("preemption_v1.jsonl")
    k = next(k for k in range(5, len(L) - 1) if F.so(L, k)["finished_req_ids"])
    F.so(L, k)["scheduled_spec_decode_tokens"] = "oops"
    report = validate(Trace(F.write(tmp_path / "typo.jsonl", L)))
    assert [(p.kind, p.step) for p in report.problems] == [("schema", k)], report.problems[:5]


def test_unknown_request_reported_on_a_bad_line(tmp_path):
    L = F.load("prefix_caching.jsonl")
    k, req = F.unknown_cached(L, random.Random(1))
    F.so(L, k)["total_num_scheduled_tokens"] = "many"
    report = validate(Trace(F.write(tmp_path / "ghost.jsonl", L)))
    assert ("unknown_request", k, "ghost") in [(p.kind, p.step, p.req_id) for p in report.problems]


def test_request_in_new_and_cached_is_named(tmp_path):
    L = F.load("worked_example.jsonl")
    s = F.so(L, 1)
    r = s["scheduled_cached_reqs"]["req_ids"][0]
    s["scheduled_new_reqs"].append({"req_id": r, "prompt_token_ids": [1, 2], "block_ids": [[5]],
                                    "num_computed_tokens": 0, "prefill_token_ids": None})
    report = validate(Trace(F.write(tmp_path / "twice.jsonl", L)))
    assert any(p.kind == "duplicate_request" and p.req_id == r and p.step == 1 for p in report.problems)


def test_v2_preempted_and_readded_in_one_step(tmp_path):
    L = F.load("preemption_v2.jsonl")
    k = next(k for k in range(len(L) - 1) if F.so(L, k)["preempted_req_ids"])
    j = next(j for j in range(k + 1, len(L) - 1) for nr in F.so(L, j)["scheduled_new_reqs"]
             if nr["req_id"] in F.so(L, k)["preempted_req_ids"])
    r = next(nr["req_id"] for nr in F.so(L, j)["scheduled_new_reqs"] if nr["req_id"] in F.so(L, k)["preempted_req_ids"])
    F.so(L, j)["preempted_req_ids"].append(r)
    report = validate(Trace(F.write(tmp_path / "readd.jsonl", L)))
    assert ("preempted_in_step", j, r) in [(p.kind, p.step, p.req_id) for p in report.problems]


def test_true_is_not_block_1(tmp_path):
    L = F.load("worked_example.jsonl")
    F.so(L, 0)["scheduled_new_reqs"][0]["block_ids"][0][0] = True
    p = F.write(tmp_path / "bool.jsonl", L)
    report = validate(Trace(p))
    assert report.problems and report.problems[0].step == 0 and "bool" in report.problems[0].message
    with pytest.raises(TraceError):
        list(Trace(p).steps())


def test_more_drafts_than_num_speculative_tokens_is_refused_by_both(tmp_path):
    """5 drafts under num_speculative_tokens 3 (spec_decode.jsonl) used to pass validate and replay."""
    src = (F.TRACES / "spec_decode.jsonl").read_text().splitlines()
    header = json.loads(src[0])
    k = header["num_speculative_tokens"]
    i = next(j for j, text in enumerate(src[1:], start=1)
             if json.loads(text)["scheduler_output"]["scheduled_spec_decode_tokens"])
    step = json.loads(src[i])
    spec = step["scheduler_output"]["scheduled_spec_decode_tokens"]
    r, drafts = next(iter(spec.items()))
    spec[r] = drafts + [7] * (k + 2 - len(drafts))  # k + 2 drafts, each a real token id
    nst = step["scheduler_output"]["num_scheduled_tokens"]
    step["scheduler_output"]["total_num_scheduled_tokens"] += (k + 2 + 1) - nst[r]
    nst[r] = k + 2 + 1  # room for the drafts and one real token: only the draft count is wrong
    src[i] = json.dumps(step)
    path = tmp_path / "too_many_drafts.jsonl"
    path.write_text("\n".join(src) + "\n")
    outcome, e = replay_outcome(path)
    assert outcome == "refused" and (e.kind, e.step, e.req_id) == ("too_many_drafts", i - 1, r)
    kinds = {(p.kind, p.step, p.req_id) for p in validate(Trace(path)).problems}
    assert ("too_many_drafts", i - 1, r) in kinds
