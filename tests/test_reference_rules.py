"""The oracle owns every rule it judges: each refusal the host workers make from state (workers/state.py,
workers/host.py) is made by the reference worker too, with the same located error (kind, step, request, group,
field, message) at the same step. Each case plants one fault into a bundled trace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmap.errors import TraceError
from kvmap.trace import Trace
from kvmap.workers.registry import make_worker

from .conftest import TRACES


def _lines(name: str) -> list[dict]:
    return [json.loads(x) for x in (TRACES / name).read_text().splitlines()]


def _so(L, k):
    return L[k + 1]["scheduler_output"]


def _retotal(so) -> None:
    so["total_num_scheduled_tokens"] = sum(so["num_scheduled_tokens"].values())


def _no_block(L):  # A's block for positions 16..23 never arrives
    _so(L, 1)["scheduled_cached_reqs"]["new_block_ids"] = [None, None]


def _unknown(L):  # a cached request nobody added
    so = _so(L, 2)
    c = so["scheduled_cached_reqs"]
    c["req_ids"] = ["B", "Z"]
    so["num_scheduled_tokens"] = {"B": 1, "Z": 1}
    L[3]["sampled_token_ids"] = {"B": [2033], "Z": [7]}


def _continuation_drops_blocks(L):  # A, still live, sent again as new (a continuation) with one other block
    so = _so(L, 2)
    c = so["scheduled_cached_reqs"]
    for key in ("req_ids", "new_block_ids", "num_computed_tokens", "num_output_tokens"):
        c[key] = c[key][:1]
    new = dict(_so(L, 0)["scheduled_new_reqs"][1])
    new["block_ids"] = [[50]]
    so["scheduled_new_reqs"] = [new]
    so["num_scheduled_tokens"] = {"B": 1, "A": 16}
    _retotal(so)


def _new_while_preempted(L):  # v1 protocol: the first preempted request sent as new instead of resumed
    for k in range(len(L) - 2):
        for r in _so(L, k)["preempted_req_ids"]:
            so = _so(L, k + 1)
            if r not in so["num_scheduled_tokens"]:
                so["scheduled_new_reqs"].append({"req_id": r, "prompt_token_ids": [1] * 4, "block_ids": [[]],
                                                 "num_computed_tokens": 0, "prefill_token_ids": None})
                so["num_scheduled_tokens"][r] = 1
                _retotal(so)
                return
    raise AssertionError


def _budget_seqs(L):
    L[0]["max_num_seqs"] = 1


def _prompt_too_long(L):
    L[0]["max_model_len"] = 30
    so = _so(L, 0)
    so["num_scheduled_tokens"]["B"] = 20
    _retotal(so)


def _positions_too_far(L):  # B passes max_model_len at step 2 (and has no block there either: the first rule wins)
    _row_width_append(L)
    _so(L, 2)["scheduled_cached_reqs"]["new_block_ids"] = [None, None]


def _row_width_new(L):
    _so(L, 0)["scheduled_new_reqs"][0]["block_ids"] = [[37, 12, 1, 2, 3]]


def _row_width_append(L):  # max_model_len 32: rows of 2 blocks; B's third block overflows (no samples at step 1)
    L[0]["max_model_len"] = 32
    del L[2]["sampled_token_ids"]


def _sampled_overflow(L):
    L[0]["max_model_len"] = 31


def _tokens_unknown(L):  # B's sampled token of step 0 never recorded
    del L[1]["sampled_token_ids"]["B"]


def _token_budget(L):
    L[0]["max_num_batched_tokens"] = 40


def _resumed_no_blocks(L):
    c = _so(L, 48)["scheduled_cached_reqs"]
    c["new_block_ids"][c["req_ids"].index("req-3")] = None


def _preempted_scheduled(L):
    _so(L, 48)["scheduled_cached_reqs"]["resumed_req_ids"] = []


def _correction(L):
    L[4]["num_computed_tokens_correction"]["req-0"] = 100


CASES = [  # (trace, fault, kind, step, req_id)
    ("worked_example.jsonl", _no_block, "no_block", 1, "A"),
    ("worked_example.jsonl", _unknown, "unknown_request", 2, "Z"),
    ("worked_example.jsonl", _continuation_drops_blocks, "continuation_mismatch", 2, "A"),
    ("preemption_v1.jsonl", _new_while_preempted, "new_id_not_new", 12, "req-4"),
    ("worked_example.jsonl", _budget_seqs, "budget_seqs", 0, "A"),
    ("worked_example.jsonl", _prompt_too_long, "max_model_len", 0, "B"),
    ("worked_example.jsonl", _positions_too_far, "max_model_len", 2, "B"),
    ("worked_example.jsonl", _row_width_new, "row_width", 0, "B"),
    ("worked_example.jsonl", _row_width_append, "row_width", 2, "B"),
    ("worked_example.jsonl", _sampled_overflow, "max_model_len", 0, "B"),
    ("worked_example.jsonl", _tokens_unknown, "tokens_unknown", 1, "B"),
    ("worked_example.jsonl", _token_budget, "schema", 0, None),
    ("preemption_v1.jsonl", _resumed_no_blocks, "resumed_no_blocks", 48, "req-3"),
    ("preemption_v1.jsonl", _preempted_scheduled, "preempted_scheduled", 48, "req-3"),
    ("async_spec_decode.jsonl", _correction, "schema", 3, "req-0"),
]


def _refusal(path, backend: str):
    """The first error replaying `path` on `backend`: (kind, step, req_id, group, field, message, line)."""
    trace = Trace(path)
    worker = make_worker(backend, trace.header)
    try:
        for step in trace.steps():
            worker.run_step(step)
            worker.append_sampled()
    except TraceError as e:
        return e.kind, e.step, e.req_id, e.group, e.field, e.message, e.line
    return None


@pytest.mark.parametrize("name,fault,kind,step,req_id", CASES, ids=[c[1].__name__.strip("_") for c in CASES])
def test_the_reference_refuses_what_the_host_workers_refuse(tmp_path, name, fault, kind, step, req_id):
    L = _lines(name)
    fault(L)
    path = tmp_path / name
    path.write_text("".join(json.dumps(x) + "\n" for x in L))
    want = _refusal(path, "numpy")
    assert want is not None and want[:3] == (kind, step, req_id)  # the fault reached the workers
    assert _refusal(path, "reference") == want


def test_a_position_without_a_block_exits_2_on_the_reference_as_on_numba(tmp_path):
    """The review's case: --backend reference used to pad with PAD_SLOT_ID and exit 0."""
    L = _lines("worked_example.jsonl")
    _no_block(L)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in L))
    out = {}
    for backend in ("reference", "numba"):
        p = subprocess.run([sys.executable, "-m", "kvmap", "replay", str(path), "--backend", backend, "-q"],
                           capture_output=True, text=True)
        out[backend] = (p.returncode, p.stderr.strip())
    assert out["reference"] == out["numba"]
    assert out["reference"][0] == 2 and "step 1, request 'A'" in out["reference"][1]
    assert "position 23 has no block" in out["reference"][1]
