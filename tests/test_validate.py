"""`kvmap validate`: no false alarm on any bundled (real) trace, and each planted fault named at its step and
request. Faults are planted into real traces recorded from vLLM's scheduler."""

from __future__ import annotations

import copy
import gzip
import json

import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app
from kvmap.trace import Trace
from kvmap.validate import validate

from .conftest import TRACES, bundled_traces, read_lines, write_lines

runner = CliRunner()


def load(name):
    p = TRACES / name
    op = gzip.open if name.endswith(".gz") else open
    with op(p, "rt") as f:
        return [json.loads(x) for x in f]


def so(L, k):
    return L[k + 1]["scheduler_output"]


def first(L, pred):
    """(step, req_id) of the first cached request (step >= 1) for which pred(L, step, i, req_id) holds."""
    for k in range(1, len(L) - 1):
        c = so(L, k)["scheduled_cached_reqs"]
        for i, r in enumerate(c["req_ids"]):
            if pred(L, k, i, r):
                return k, i, r
    raise AssertionError("no such request in the trace")


def decode(L, k, i, r):
    s = so(L, k)
    return s["num_scheduled_tokens"][r] == 1 and not s["scheduled_spec_decode_tokens"].get(r) and \
        not s["scheduled_cached_reqs"]["resumed_req_ids"]


# ---------------------------------------------------------------------------------- planted faults
# Each returns (mutated lines, step, req_id or None) of the fault it planted.


def f_json(L):
    return L, 3, None  # the line itself is cut in test_mutation below


def f_total(L):
    so(L, 2)["total_num_scheduled_tokens"] += 1
    return L, 2, None


def f_block_range(L):
    k, i, r = first(L, lambda L, k, i, r: so(L, k)["scheduled_cached_reqs"]["new_block_ids"][i] is not None)
    so(L, k)["scheduled_cached_reqs"]["new_block_ids"][i][0][0] = L[0]["num_gpu_blocks"]
    return L, k, r


def f_budget_tokens(L):
    totals = [so(L, k)["total_num_scheduled_tokens"] for k in range(len(L) - 1)]
    L[0]["max_num_batched_tokens"] = max(totals) - 1
    return L, totals.index(max(totals)), None


def f_budget_seqs(L):
    counts = [len(so(L, k)["num_scheduled_tokens"]) for k in range(len(L) - 1)]
    L[0]["max_num_seqs"] = max(counts) - 1
    return L, counts.index(max(counts)), None


def f_unknown(L):
    k, i, r = first(L, decode)
    s = so(L, k)
    s["scheduled_cached_reqs"]["req_ids"][i] = "ghost"
    s["num_scheduled_tokens"] = {("ghost" if x == r else x): n for x, n in s["num_scheduled_tokens"].items()}
    L[k + 1]["sampled_token_ids"] = {("ghost" if x == r else x): t for x, t in L[k + 1]["sampled_token_ids"].items()}
    return L, k, "ghost"


def f_after_finish(L):
    k, i, r = first(L, decode)
    so(L, k)["finished_req_ids"].append(r)
    return L, k, r


def f_continuation(L):  # a live request sent again as new: a continuation whose prompt does not extend it
    k, i, r = first(L, decode)
    s = so(L, k)
    c = s["scheduled_cached_reqs"]
    nc = c["num_computed_tokens"][i]
    for key in ("req_ids", "new_block_ids", "num_computed_tokens", "num_output_tokens"):
        c[key].pop(i)
    s["scheduled_new_reqs"].append({"req_id": r, "prompt_token_ids": [1] * (nc + 1), "block_ids": [[]],
                                    "num_computed_tokens": nc, "prefill_token_ids": None})
    return L, k, r


def f_new_while_preempted(L):  # v1 protocol: a preempted request must come back resumed, not as new
    for k in range(len(L) - 2):
        for r in so(L, k)["preempted_req_ids"]:
            s = so(L, k + 1)
            if r not in s["num_scheduled_tokens"]:
                s["scheduled_new_reqs"].append({"req_id": r, "prompt_token_ids": [1] * 4, "block_ids": [[]],
                                                "num_computed_tokens": 0, "prefill_token_ids": None})
                s["num_scheduled_tokens"][r] = 1
                s["total_num_scheduled_tokens"] += 1
                return L, k + 1, r
    raise AssertionError


def f_preempted_scheduled(L):
    k, i, r = first(L, lambda L, k, i, r: r in so(L, k)["scheduled_cached_reqs"]["resumed_req_ids"])
    so(L, k)["scheduled_cached_reqs"]["resumed_req_ids"].remove(r)
    return L, k, r


def f_computed_ahead(L):
    k, i, r = first(L, decode)
    so(L, k)["scheduled_cached_reqs"]["num_computed_tokens"][i] += 1
    return L, k, r


def f_computed_back(L):
    k, i, r = first(L, decode)
    so(L, k)["scheduled_cached_reqs"]["num_computed_tokens"][i] -= 2
    return L, k, r


def f_tokens_unknown(L):
    k, i, r = first(L, lambda L, k, i, r: decode(L, k, i, r) and
                    (so(L, k)["scheduled_cached_reqs"]["num_computed_tokens"][i] + 1) % 16 != 0)
    so(L, k)["num_scheduled_tokens"][r] += 1
    so(L, k)["total_num_scheduled_tokens"] += 1
    return L, k, r


def f_no_block(L):
    k, i, r = first(L, lambda L, k, i, r: so(L, k)["scheduled_cached_reqs"]["new_block_ids"][i] is not None)
    so(L, k)["scheduled_cached_reqs"]["new_block_ids"][i] = None
    return L, k, r


def f_null_block(L):
    for k in range(len(L) - 1):
        for nr in so(L, k)["scheduled_new_reqs"]:
            nr["block_ids"][0][-1] = 0
            return L, k, nr["req_id"]
    raise AssertionError


def f_double_allocation(L):
    # a block appended to a running request becomes the first block of another live request
    for k in range(1, len(L) - 1):
        c = so(L, k)["scheduled_cached_reqs"]
        for i, r in enumerate(c["req_ids"]):
            if c["new_block_ids"][i] is None:
                continue
            for kk in range(k):
                for nr in so(L, kk)["scheduled_new_reqs"]:
                    if nr["req_id"] != r and nr["req_id"] in so(L, k)["num_scheduled_tokens"]:
                        c["new_block_ids"][i][0][0] = nr["block_ids"][0][0]
                        return L, k, r
    raise AssertionError


def f_partial_sampled(L):
    for k in range(len(L) - 1):
        for r, toks in L[k + 1]["sampled_token_ids"].items():
            if toks == []:
                L[k + 1]["sampled_token_ids"][r] = [7]
                return L, k, r
    raise AssertionError


def f_too_many_sampled(L):
    k, i, r = first(L, decode)
    L[k + 1]["sampled_token_ids"][r] = [7, 8, 9]
    return L, k, r


def f_drafts_mismatch(L):
    for k in range(1, len(L) - 1):
        for r, d in so(L, k)["scheduled_spec_decode_tokens"].items():
            if d:
                d[0] += 1
                return L, k, r
    raise AssertionError


def f_preempted_in_step(L):
    k, i, r = first(L, decode)
    so(L, k)["preempted_req_ids"].append(r)
    return L, k, r


FAULTS = {
    # kind: (trace, planter)
    "json": ("chunked_prefill.jsonl", f_json),
    "total_mismatch": ("chunked_prefill.jsonl", f_total),
    "block_range": ("chunked_prefill.jsonl", f_block_range),
    "budget_tokens": ("prefix_caching.jsonl", f_budget_tokens),
    "budget_seqs": ("prefix_caching.jsonl", f_budget_seqs),
    "unknown_request": ("chunked_prefill.jsonl", f_unknown),
    "scheduled_after_finish": ("chunked_prefill.jsonl", f_after_finish),
    "continuation_mismatch": ("chunked_prefill.jsonl", f_continuation),
    "new_id_not_new": ("preemption_v1.jsonl", f_new_while_preempted),
    "preempted_scheduled": ("preemption_v1.jsonl", f_preempted_scheduled),
    "computed_ahead": ("chunked_prefill.jsonl", f_computed_ahead),
    "computed_back": ("chunked_prefill.jsonl", f_computed_back),
    "tokens_unknown": ("chunked_prefill.jsonl", f_tokens_unknown),
    "no_block": ("chunked_prefill.jsonl", f_no_block),
    "null_block": ("prefix_caching.jsonl", f_null_block),
    "double_allocation": ("chunked_prefill.jsonl", f_double_allocation),
    "partial_sampled": ("chunked_prefill.jsonl", f_partial_sampled),
    "too_many_sampled": ("chunked_prefill.jsonl", f_too_many_sampled),
    "drafts_mismatch": ("spec_decode.jsonl", f_drafts_mismatch),
    "preempted_in_step": ("preemption_v2.jsonl", f_preempted_in_step),
}


@pytest.mark.parametrize("path", bundled_traces(), ids=lambda p: p.name)
def test_no_false_alarm_on_real_traces(path):
    r = validate(Trace(path))
    assert r.valid, [(p.kind, p.step, p.req_id, p.message) for p in r.problems[:5]]


@pytest.mark.parametrize("kind", list(FAULTS))
def test_planted_fault_is_named_at_its_step(tmp_path, kind):
    name, plant = FAULTS[kind]
    L, step, req_id = plant(copy.deepcopy(load(name)))
    path = write_lines(tmp_path / name, L)
    if kind == "json":
        raw = path.read_text().splitlines()
        raw[step + 1] = raw[step + 1][: len(raw[step + 1]) // 2]
        path.write_text("\n".join(raw) + "\n")
    r = validate(Trace(path))
    hits = [p for p in r.problems if p.kind == kind]
    assert hits, f"{kind} not found; got {[(p.kind, p.step, p.req_id) for p in r.problems[:5]]}"
    p = hits[0]
    assert p.step == step, (p.step, step, p.message)
    assert p.line == step + 2
    if req_id is not None:
        assert p.req_id == req_id, (p.req_id, req_id, p.message)


def test_at_least_twelve_fault_kinds():
    assert len(FAULTS) >= 12


def test_cli_exit_codes_and_json(tmp_path):
    res = runner.invoke(app, ["validate", str(TRACES / "prefix_caching.jsonl")])
    assert res.exit_code == 0, res.output
    L, k, _ = f_computed_ahead(load("chunked_prefill.jsonl"))
    so(L, k + 3)["total_num_scheduled_tokens"] += 1
    path = write_lines(tmp_path / "bad.jsonl", L)
    out = tmp_path / "v.json"
    res = runner.invoke(app, ["validate", str(path), "--json", str(out)])
    assert res.exit_code == 1
    d = json.loads(out.read_text())
    assert not d["valid"] and {"total_mismatch", "computed_ahead"} <= set(d["by_kind"])
    res = runner.invoke(app, ["validate", str(path), "--max-problems", "1"])
    assert res.exit_code == 1 and "stopped after 1" in res.output
    (tmp_path / "x.jsonl").write_text("not a trace\n")
    res = runner.invoke(app, ["validate", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_deep_compares_every_backend_and_the_kv_cache():
    r = validate(Trace(TRACES / "spec_decode.jsonl"), deep=True)
    assert r.valid
    assert r.deep["backends"]["numpy"]["differing_steps"] == 0
    assert r.deep["backends"]["numpy"]["kv_mismatches"] == 0 and r.deep["backends"]["numpy"]["kv_checked"] > 0


@pytest.mark.parametrize("numbers, problem", [
    ([0, 5, 2, 3], (3, 1, "expected step 1, got 5")),  # one mistyped number: the next line is back in step
    ([0, 1, 1, 2], (4, 2, "expected step 2, got 1")),  # a repeated step: the count follows the file
    ([0, 2, 3, 4], (3, 1, "expected step 1, got 2")),  # a missing step: likewise
])
def test_a_wrong_step_number_is_one_problem_at_the_step_expected(tmp_path, numbers, problem):
    """One problem per slip, located at the line and at the step replay names (its position), never at the
    line after a one-line typo."""
    lines = read_lines(TRACES / "worked_example.jsonl")
    for line, n in zip(lines[1:], numbers):
        line["step"] = n
    r = validate(Trace(write_lines(tmp_path / "t.jsonl", lines)))
    order = [p for p in r.problems if p.kind == "step_order"]
    assert [(p.line, p.step, p.message.split(": ")[-1]) for p in order] == [problem]


def test_deep_on_a_trace_with_problems_says_it_did_not_run(tmp_path):
    """--deep compares replays of a valid trace: with problems it is not run, and the report says so."""
    lines = read_lines(TRACES / "worked_example.jsonl")
    lines[2]["scheduler_output"]["scheduled_cached_reqs"]["new_block_ids"] = [None, [[12]]]  # B's block to A
    r = validate(Trace(write_lines(tmp_path / "double.jsonl", lines)), deep=True)
    assert not r.valid and r.deep is None
    assert any(x.startswith("--deep not run") for x in r.info)


def test_a_bad_lines_well_formed_parts_are_read_and_nothing_else():
    """salvage.py reads only what is well-formed; the validator applies it (Validator.salvage)."""
    from kvmap.validate.salvage import read_bad_line

    bad = read_bad_line({"scheduler_output": {
        "finished_req_ids": ["A", 7], "preempted_req_ids": "B",
        "scheduled_new_reqs": [{"req_id": "N"}, {"req_id": None}, 3],
        "scheduled_cached_reqs": {"req_ids": ["C", "R", 5, "D", "E"], "resumed_req_ids": ["R"],
                                  "new_block_ids": [[[1, 2]], [[3]], [[4]], None, [[5, "x"]]]}},
        "sampled_token_ids": {"C": [11, 12], "D": "oops", "E": None, "F": [1.5]}})
    assert bad.finished == ["A"] and bad.preempted == []
    assert bad.new_ids == {"N"} and bad.resumed == {"R"} and bad.cached == ["C", "R", "D", "E"]
    assert bad.appended == [("C", [[1, 2]])]  # R is resumed, 5 no id, D no blocks, E a bad block list
    assert bad.sampled == {"C": [11, 12]} and bad.sampled_bad == {"D", "F"}  # E: None, as if absent
    assert read_bad_line("not an object") == read_bad_line({})
