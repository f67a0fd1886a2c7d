"""Streaming-input continuations (vLLM's resumable sessions): a live request id sent again in
`scheduled_new_reqs`, replayed as vLLM's workers do (MRV2: remove, then add again, so the row comes back; V1:
leave the persistent batch, re-add into the lowest hole), validated against what the request held, and refused
at its step and request, with the same kind, by every backend when it does not fit.

tests/data/streaming_session.jsonl, block size 16, 4 rows: session `s` sends a 5-token chunk (100..104, block 1)
with max_tokens=2 (samples 105 at step 0, 106 at step 1), then a 3-token chunk (200..202): at step 2 the prompt
is the 5 tokens + the kept output 105 (106, the turn's last sampled token, dropped) + the chunk, 6 cached."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kvmap.errors import TraceError
from kvmap.explain import explain
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace
from kvmap.validate import validate
from kvmap.workers.registry import make_worker

SESSION = Path(__file__).parent / "data" / "streaming_session.jsonl"
BACKENDS = ["reference", "numpy", "numba", "torch", "triton"]
ORDERS = ["mrv2", "v1"]
CHUNK1, CHUNK2 = [100, 101, 102, 103, 104], [200, 201, 202]


def _lines(path: Path = SESSION) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _write(tmp_path: Path, lines: list[dict], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def _dumps(path: Path, backend: str, order: str, **kw) -> tuple[list[dict], object]:
    out: list[dict] = []
    res = replay(Trace(path), ReplayConfig(backend=backend, batch_order=order, verify_kv=True, nvtx=False,
                                          warmup=0, **kw), on_mappings=out.append)
    return out, res


def _skip_missing(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_smallest_continuation_in_every_backend_and_order(backend, order):
    _skip_missing(backend)
    dumps, res = _dumps(SESSION, backend, order)
    d = dumps[2]
    assert d["req_ids"] == ["s"]
    assert d["idx_mapping"] == [4 - 1]  # the session keeps the row it was first given (MRV2: the last one)
    assert d["positions"] == [5 + 1 + 0, 5 + 1 + 1, 5 + 1 + 2]  # after the 5 prompt tokens and the kept 105
    assert d["input_ids"] == CHUNK2
    assert d["seq_lens"] == [5 + 1 + 3]
    assert d["query_start_loc"] == [0, 3]
    assert d["block_tables"] == [[[1]]]
    assert d["slot_mapping"] == [[1 * 16 + 6, 1 * 16 + 7, 1 * 16 + 8]]
    # step 3 decodes the chunk's sampled token at position 9
    assert dumps[3]["positions"] == [5 + 1 + 3] and dumps[3]["input_ids"] == [203]
    # --verify-kv reads every position of the context back: 5 + 6 + 9 + 10, the kept 0..5 written in steps 0, 1
    assert res.kv_checked == 5 + 6 + 9 + 10 and res.kv_mismatches == 0


def _two_sessions() -> list[dict]:
    """Sessions a (row 3) and b (row 2), plain request x (row 1); at step 2 both sessions continue in one step,
    b listed first in scheduled_new_reqs, while x decodes."""
    L = _lines()
    h, s0, s1 = L[0], L[1], L[2]

    def so(k):
        return L[k + 1]["scheduler_output"]

    def new(r, prompt, block, nc):
        return {"req_id": r, "prompt_token_ids": prompt, "block_ids": [[block]], "num_computed_tokens": nc,
                "prefill_token_ids": prompt}

    s0["scheduler_output"]["scheduled_new_reqs"] = [new("a", CHUNK1, 1, 0), new("b", [300, 301], 2, 0),
                                                    new("x", [400, 401, 402], 3, 0)]
    s0["scheduler_output"]["num_scheduled_tokens"] = {"a": 5, "b": 2, "x": 3}
    s0["sampled_token_ids"] = {"a": [105], "b": [302], "x": [403]}
    c = s1["scheduler_output"]["scheduled_cached_reqs"]
    c.update(req_ids=["a", "b", "x"], new_block_ids=[None] * 3, num_computed_tokens=[5, 2, 3],
             num_output_tokens=[1] * 3)
    s1["scheduler_output"]["num_scheduled_tokens"] = {"a": 1, "b": 1, "x": 1}
    s1["sampled_token_ids"] = {"a": [106], "b": [303], "x": [404]}
    so(2)["scheduled_new_reqs"] = [new("b", [300, 301, 302, 310], 2, 3), new("a", CHUNK1 + [105] + CHUNK2, 1, 6)]
    c = so(2)["scheduled_cached_reqs"]
    c.update(req_ids=["x"], new_block_ids=[None], num_computed_tokens=[4], num_output_tokens=[2])
    so(2)["num_scheduled_tokens"] = {"x": 1, "b": 1, "a": 3}
    L[3]["sampled_token_ids"] = {"x": [405], "b": [311], "a": [203]}
    for k in range(3):
        so(k)["total_num_scheduled_tokens"] = sum(so(k)["num_scheduled_tokens"].values())
    h["max_num_batched_tokens"] = 32
    return L[:4]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_sessions_continuing_in_one_step_keep_their_rows(tmp_path, backend, order):
    _skip_missing(backend)
    dumps, res = _dumps(_write(tmp_path, _two_sessions()), backend, order)
    d = dumps[2]
    row = {r: i for r, i in zip(d["req_ids"], d["idx_mapping"])}
    assert row == {"a": 4 - 1, "b": 4 - 2, "x": 4 - 3}  # MRV2: each removed and re-added in turn, LIFO
    if order == "v1":
        # V1: both leave rows 0 and 1; re-added in scheduled_new_reqs order into the lowest holes (b, a), x stays
        assert d["req_ids"] == ["b", "a", "x"]
    else:  # sorted by scheduled tokens, ties in scheduler order
        assert d["req_ids"] == ["x", "b", "a"]
    assert res.kv_mismatches == 0


def _frees_then_adds(finished: list[str], preempted: list[str]) -> list[dict]:
    """a, b, c take rows 3, 2, 1 at step 0 (free list [0] left). Step 1 frees a and c (listed c first, as
    finished or preempted), then adds d, continues session b, adds e, in that scheduled_new_reqs order."""
    L = _lines()
    h, s0, s1 = L[0], L[1], L[2]

    def new(r, prompt, block, nc):
        return {"req_id": r, "prompt_token_ids": prompt, "block_ids": [[block]], "num_computed_tokens": nc,
                "prefill_token_ids": prompt}

    so = s0["scheduler_output"]
    so["scheduled_new_reqs"] = [new("a", [100, 101], 1, 0), new("b", [200, 201], 2, 0), new("c", [300, 301], 3, 0)]
    so["num_scheduled_tokens"] = {"a": 2, "b": 2, "c": 2}
    s0["sampled_token_ids"] = {"a": [102], "b": [202], "c": [302]}
    so = s1["scheduler_output"]
    so["scheduled_new_reqs"] = [new("d", [400, 401], 4, 0), new("b", [200, 201, 210], 2, 2),
                                new("e", [500, 501], 5, 0)]
    so["scheduled_cached_reqs"].update(req_ids=[], new_block_ids=[], num_computed_tokens=[], num_output_tokens=[])
    so["num_scheduled_tokens"] = {"d": 2, "b": 1, "e": 2}
    so["finished_req_ids"], so["preempted_req_ids"] = finished, preempted
    s1["sampled_token_ids"] = {"d": [402], "b": [211], "e": [502]}
    for x in (s0["scheduler_output"], s1["scheduler_output"]):
        x["total_num_scheduled_tokens"] = sum(x["num_scheduled_tokens"].values())
    return [h, s0, s1]


@pytest.mark.parametrize("finished, preempted", [(["c", "a"], []), (["c"], ["a"])], ids=["finished", "preempted"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_are_freed_in_sorted_id_order(tmp_path, backend, finished, preempted):
    """MRV2's `finish_requests` frees `sorted(finished_req_ids | preempted_req_ids)` (so every TP rank frees
    rows alike), not the trace's order: a (row 3) then c (row 1) onto the free list [0] -> [0, 3, 1]; d pops 1,
    b's continuation gives row 2 back and takes it again, e pops 3. In the trace's order (c, a) d and e would
    swap rows."""
    _skip_missing(backend)
    path = _write(tmp_path, _frees_then_adds(finished, preempted))
    assert validate(Trace(path)).valid
    dumps, res = _dumps(path, backend, "mrv2")
    assert {r: i for r, i in zip(dumps[0]["req_ids"], dumps[0]["idx_mapping"])} == {"a": 4 - 1, "b": 4 - 2,
                                                                                   "c": 4 - 3}
    d = dumps[1]
    assert d["req_ids"] == ["b", "d", "e"]  # sorted by scheduled tokens (1, 2, 2), ties in scheduler order
    assert d["idx_mapping"] == [2, 1, 3]
    assert d["block_tables"] == [[[2], [4], [5]]]
    assert d["slot_mapping"] == [[2 * 16 + 2, 4 * 16 + 0, 4 * 16 + 1, 5 * 16 + 0, 5 * 16 + 1]]
    assert res.kv_mismatches == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_dumps_what_the_reference_dumps(tmp_path, backend):
    _skip_missing(backend)
    path = _write(tmp_path, _two_sessions())
    for order in ORDERS:
        assert _dumps(path, backend, order)[0] == _dumps(path, "reference", order)[0]


def test_validate_accepts_continuations(tmp_path):
    for path in (SESSION, _write(tmp_path, _two_sessions())):
        r = validate(Trace(path))
        assert r.valid, [(p.kind, p.step, p.req_id, p.message) for p in r.problems]


def _prompt_not_extended(L):  # the kept output 105 replaced
    L[3]["scheduler_output"]["scheduled_new_reqs"][0]["prompt_token_ids"][5] = 999
    L[3]["scheduler_output"]["scheduled_new_reqs"][0]["prefill_token_ids"][5] = 999


def _block_dropped(L):  # the held block 1 replaced by block 2
    L[3]["scheduler_output"]["scheduled_new_reqs"][0]["block_ids"] = [[2]]


def _no_blocks(L):  # the held block gone
    L[3]["scheduler_output"]["scheduled_new_reqs"][0]["block_ids"] = [[]]


def _computed_past_kept(L):  # position 6 (a chunk token) claimed cached
    L[3]["scheduler_output"]["scheduled_new_reqs"][0]["num_computed_tokens"] = 7
    so = L[3]["scheduler_output"]
    so["num_scheduled_tokens"]["s"] = 2
    so["total_num_scheduled_tokens"] = 2


REFUSALS = [  # (fault, field, group)
    (_prompt_not_extended, "prefill_token_ids", None),
    (_block_dropped, "block_ids", 0),
    (_no_blocks, "block_ids", 0),
    (_computed_past_kept, "num_computed_tokens", None),
]


def _refusal(path: Path, backend: str, order: str):
    trace = Trace(path)
    worker = make_worker(backend, trace.header, batch_order=order)
    try:
        for step in trace.steps():
            worker.run_step(step)
            worker.append_sampled()
    except TraceError as e:
        return e.kind, e.step, e.req_id, e.group, e.field, e.message
    return None


@pytest.mark.parametrize("fault,field,group", REFUSALS, ids=[f[0].__name__.strip("_") for f in REFUSALS])
def test_a_continuation_that_does_not_fit_is_named_and_refused(tmp_path, fault, field, group):
    L = copy.deepcopy(_lines())
    fault(L)
    path = _write(tmp_path, L)
    r = validate(Trace(path))
    hits = [p for p in r.problems if p.kind == "continuation_mismatch"]
    assert hits, [(p.kind, p.step, p.req_id, p.message) for p in r.problems]
    p = hits[0]
    assert (p.step, p.line, p.req_id, p.field, p.group) == (2, 2 + 2, "s", field, group)
    want = _refusal(path, "reference", "mrv2")
    assert want is not None and want[:5] == ("continuation_mismatch", 2, "s", group, field)
    for backend in BACKENDS:
        if backend == "triton" and not _has_triton():
            continue
        for order in ORDERS:
            assert _refusal(path, backend, order) == want, (backend, order)


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _windowed(kind: str) -> list[dict]:
    """The session on blocks of 4 tokens in one group of `kind` (window 2): [1, 2] hold positions 0..7; the
    continuation runs positions 6..8, whose window starts at 6 - 2 + 1 = 5, so the scheduler freed block 1
    (positions 0..3) and sends the null block in its place, then block 3 for position 8."""
    L = copy.deepcopy(_lines())
    L[0]["block_size"] = 4
    L[0]["kv_cache_groups"] = [{"group_id": 0, "kind": kind, "block_size": 4,
                                "sliding_window": 2 if kind == "sliding_window" else None}]
    L[1]["scheduler_output"]["scheduled_new_reqs"][0]["block_ids"] = [[1, 2]]
    L[3]["scheduler_output"]["scheduled_new_reqs"][0]["block_ids"] = [[0, 2, 3]]
    return L


@pytest.mark.parametrize("backend", BACKENDS)
def test_outside_full_attention_a_held_block_may_come_back_as_the_null_block(tmp_path, backend):
    _skip_missing(backend)
    path = _write(tmp_path, _windowed("sliding_window"))
    assert validate(Trace(path)).valid
    dumps, res = _dumps(path, backend, "mrv2")
    assert dumps[2]["block_tables"] == [[[0, 2, 3]]]
    assert dumps[2]["slot_mapping"] == [[2 * 4 + 2, 2 * 4 + 3, 3 * 4 + 0]]
    assert res.kv_mismatches == 0


def test_in_full_attention_the_null_block_drops_a_held_block(tmp_path):
    path = _write(tmp_path, _windowed("full_attention"))
    p = next(p for p in validate(Trace(path)).problems if p.kind == "continuation_mismatch")
    assert (p.step, p.req_id, p.group, p.field) == (2, "s", 0, "block_ids")
    assert _refusal(path, "numpy", "mrv2")[:5] == ("continuation_mismatch", 2, "s", 0, "block_ids")
    assert _refusal(path, "reference", "mrv2") == _refusal(path, "numpy", "mrv2")


def test_explain_names_the_continued_session_and_what_changed():
    d = explain(Trace(SESSION), 2, "s")
    assert d["scheduler_order"][0]["origin"] == "continued session"
    assert d["request"]["origin"] == "continued session"
    assert d["changes"]["added"] == []
    c = d["changes"]["continued"]["s"]
    assert c == {"held_tokens": 5 + 2, "prompt_len": 5 + 1 + 3, "num_computed_tokens": 5 + 1,
                 "blocks": [[[1], [1]]]}
    assert explain(Trace(SESSION), 0)["scheduler_order"][0]["origin"] == "new"


def test_a_preempted_request_sent_as_new_is_still_refused(tmp_path):
    """v1 protocol: a preempted request keeps its row, not live, and must come back resumed."""
    L = copy.deepcopy(_lines())
    L[0]["model_runner_protocol"] = "v1"
    L[2]["scheduler_output"]["preempted_req_ids"] = ["s"]  # preempted while step 1 was scheduled ...
    so = L[2]["scheduler_output"]
    so["scheduled_cached_reqs"].update(req_ids=[], new_block_ids=[], num_computed_tokens=[], num_output_tokens=[])
    so["num_scheduled_tokens"], so["total_num_scheduled_tokens"] = {}, 0
    L[2]["sampled_token_ids"] = {}
    L[3]["scheduler_output"]["scheduled_new_reqs"][0]["num_computed_tokens"] = 0  # ... and sent as new
    L[3]["scheduler_output"]["num_scheduled_tokens"]["s"] = 5 + 1 + 3 - 1
    L[3]["scheduler_output"]["total_num_scheduled_tokens"] = 5 + 1 + 3 - 1
    path = _write(tmp_path, L[:4])
    r = validate(Trace(path))
    assert [(p.step, p.req_id) for p in r.problems if p.kind == "new_id_not_new"] == [(2, "s")]
    for backend in ("reference", "numpy"):
        assert _refusal(path, backend, "mrv2")[:3] == ("new_id_not_new", 2, "s")


# ------------------------------------------------------------------------------ recorded from vLLM's scheduler

DATA = Path(__file__).parent / "data"
BUNDLED = Path(__file__).parent.parent / "traces"
# `kvmap record` of the workload of the same name: the bundled trace (traces/workloads/) and its async twin
RECORDED = [BUNDLED / "streaming_sessions.jsonl", DATA / "streaming_sessions_async.jsonl"]


def _workload(path: Path) -> Path:
    return (BUNDLED / "workloads" if path.parent == BUNDLED else DATA) / path.name.replace(".jsonl", ".yaml")


def _continuations(path: Path) -> list[tuple[int, list[str]]]:
    """(step, continued ids) of every step that continues a live session."""
    live: set[str] = set()
    out = []
    for L in _lines(path)[1:]:
        so = L["scheduler_output"]
        live -= set(so["finished_req_ids"])
        cont = [nr["req_id"] for nr in so["scheduled_new_reqs"] if nr["req_id"] in live]
        if cont:
            out.append((L["step"], cont))
        live |= {nr["req_id"] for nr in so["scheduled_new_reqs"]}
    return out


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.name)
def test_recorded_sessions_validate_and_replay_alike_in_every_backend(path):
    cont = _continuations(path)
    assert len(cont) == 3 and any(len(ids) == 2 for _, ids in cont)  # talk, chat (queued), talk2 + chat together
    r = validate(Trace(path))
    assert r.valid, [(p.kind, p.step, p.req_id, p.message) for p in r.problems]
    for order in ORDERS:
        want, res = _dumps(path, "reference", order)
        assert res.kv_mismatches == 0 and res.kv_checked > 0
        for backend in BACKENDS[1:]:
            if backend == "triton" and not _has_triton():
                continue
            got, res = _dumps(path, backend, order)
            assert got == want and res.kv_mismatches == 0, (backend, order)


def test_the_chunks_key_of_a_workload(tmp_path):
    from kvmap.errors import KvmapError
    from kvmap.record.workload import arrivals, load_workload

    w = load_workload(BUNDLED / "workloads" / "streaming_sessions.yaml")
    a = arrivals(w)
    chat = [(x.step, len(x.prompt), x.max_tokens, x.resumable, x.end) for x in a if x.req_id == "chat"]
    assert chat == [(0, 40, 6, True, False), (0, 12, 4, True, False), (30, 20, 5, True, False), (30, 0, 1, False, True)]
    assert [x.step for x in a] == sorted(x.step for x in a)
    bad = tmp_path / "bad.yaml"
    bad.write_text("requests: [{req_id: s, prompt_len: 5, max_tokens: 2, chunks: [{prompt_len: 0, max_tokens: 1}]}]\n")
    with pytest.raises(KvmapError, match="prompt_len and max_tokens must be > 0"):
        load_workload(bad)


HAVE_VLLM = __import__("importlib").util.find_spec("vllm") is not None


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (CI records in .venv-record)")
@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.name)
def test_recording_the_sessions_reproduces_the_trace(tmp_path, path):
    from kvmap.record.engine import record
    from kvmap.record.workload import load_workload

    out = tmp_path / path.name
    record(load_workload(_workload(path)), str(out))
    assert out.read_bytes() == path.read_bytes()
