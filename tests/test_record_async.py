"""The recorder under async scheduling (issue #13).

- Without vLLM: `RecordingScheduler` over a stand-in scheduler, driven in the engine's batch-queue order
  (schedule N+1 before update N): every output lands on its own step, lines come out in step order, nothing is
  lost at close; synchronous spec decoding still attaches drafts to their step. The bundled async traces obey
  the async rules of docs/trace-format.md (checked here in plain Python, independent of kvmap's replay).
- With vLLM 0.33 (CI's record environment): re-recording the async workloads is byte-identical, and the live
  plugin under async scheduling writes what offline recording writes.
- kvmap's replay/validate on the async traces: async spec decoding (-1 placeholders, optimistic
  num_computed_tokens and its correction) validates clean and replays with --verify-kv, and planted async faults
  are named at their step and request.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmap.record.recorder import RecordingScheduler, TraceWriter

from .conftest import ROOT, TRACES

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (CI records in .venv-record)")
WORKLOADS = TRACES / "workloads"
ASYNC_DECODE = TRACES / "async_decode.jsonl"
# waits outside the bundled set (tests iterate traces/*.jsonl) until replay/validate know async spec decoding
ASYNC_SPEC = TRACES / "async_spec_decode.jsonl"


# ------------------------------------------------------------------------------ the recorder, no vLLM


@dataclasses.dataclass
class _SO:  # a SchedulerOutput stand-in: the recorder serializes every dataclass field
    step: int
    num_scheduled_tokens: dict
    scheduled_spec_decode_tokens: dict = dataclasses.field(default_factory=dict)
    scheduled_new_reqs: list = dataclasses.field(default_factory=list)
    scheduled_cached_reqs: dict = dataclasses.field(default_factory=dict)
    finished_req_ids: set = dataclasses.field(default_factory=set)
    preempted_req_ids: set = dataclasses.field(default_factory=set)
    total_num_scheduled_tokens: int = 0


@dataclasses.dataclass
class _MRO:
    req_ids: list
    req_id_to_index: dict
    sampled_token_ids: list


class _Sched:
    """Schedules a fixed list of outputs; trims sampled lists in place like vLLM does at max_tokens."""

    def __init__(self, outs):
        self.outs = list(outs)
        self.updates = []

    def schedule(self):
        return self.outs.pop(0)

    def update_from_output(self, so, mro):
        self.updates.append(so.step)
        for s in mro.sampled_token_ids:
            s.clear()
        return {}

    def update_draft_token_ids(self, d):
        pass


def _mro(so, toks):
    ids = list(so.num_scheduled_tokens)
    return _MRO(ids, {r: i for i, r in enumerate(ids)}, [list(toks[r]) for r in ids])


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_batch_queue_order_puts_each_output_on_its_own_step(tmp_path):
    outs = [_SO(i, {"a": 1, "b": 1}, total_num_scheduled_tokens=2) for i in range(4)]
    rec = RecordingScheduler(_Sched(outs), TraceWriter(str(tmp_path / "t.jsonl"), {"kind": "header"}),
                             async_scheduling=True)
    s0 = rec.schedule()
    s1 = rec.schedule()  # N+1 scheduled before N's output
    rec.update_from_output(s0, _mro(s0, {"a": [10], "b": [20]}))
    s2 = rec.schedule()
    rec.update_from_output(s1, _mro(s1, {"a": [11], "b": [21]}))
    assert [x["step"] for x in _lines(tmp_path / "t.jsonl")[1:]] == [0, 1]  # written as soon as known
    s3 = rec.schedule()
    rec.update_from_output(s2, _mro(s2, {"a": [12], "b": [22]}))
    rec.close()  # s3's output never came (the engine stopped): written, not lost
    lines = _lines(tmp_path / "t.jsonl")[1:]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    assert [x["sampled_token_ids"] for x in lines] == [{"a": [10], "b": [20]}, {"a": [11], "b": [21]},
                                                       {"a": [12], "b": [22]}, None]
    assert rec.unmatched_outputs == 0
    del s3


def test_outputs_matched_by_identity_not_by_position(tmp_path):
    """Two equal-looking outputs: the one passed to update_from_output is the one that gets the tokens; an
    output the recorder never scheduled is counted, not attached anywhere."""
    outs = [_SO(0, {"a": 1}), _SO(0, {"a": 1})]
    rec = RecordingScheduler(_Sched(outs), TraceWriter(str(tmp_path / "t.jsonl"), {"kind": "header"}),
                             async_scheduling=True)
    s0, s1 = rec.schedule(), rec.schedule()
    assert s0 == s1 and s0 is not s1
    rec.update_from_output(_SO(0, {"a": 1}), _mro(s0, {"a": [99]}))
    rec.update_from_output(s1, _mro(s1, {"a": [2]}))  # the second line's output first: it waits its turn
    assert len(_lines(tmp_path / "t.jsonl")) == 1
    rec.update_from_output(s0, _mro(s0, {"a": [1]}))
    rec.close()
    lines = _lines(tmp_path / "t.jsonl")[1:]
    assert [x["sampled_token_ids"] for x in lines] == [{"a": [1]}, {"a": [2]}]
    assert rec.unmatched_outputs == 1


def test_sync_spec_decoding_drafts_stay_on_their_step(tmp_path):
    from types import SimpleNamespace

    outs = [_SO(i, {"a": 1}) for i in range(3)]
    rec = RecordingScheduler(_Sched(outs), TraceWriter(str(tmp_path / "t.jsonl"), {"kind": "header"}),
                             async_scheduling=False, num_speculative_tokens=2)
    for i in range(3):
        so = rec.schedule()
        rec.update_from_output(so, _mro(so, {"a": [i]}))
        rec.update_draft_token_ids(SimpleNamespace(req_ids=["a"], draft_token_ids=[[i, i + 1]]))
    rec.close()
    lines = _lines(tmp_path / "t.jsonl")[1:]
    assert [x["draft_token_ids"] for x in lines] == [{"a": [0, 1]}, {"a": [1, 2]}, {"a": [2, 3]}]
    assert [x["sampled_token_ids"] for x in lines] == [{"a": [0]}, {"a": [1]}, {"a": [2]}]


def test_async_spec_keys_from_what_the_scheduler_sees(tmp_path):
    """num_rejected_tokens from drafts and sampled lengths; the correction of step N+1 is the rejections of
    step N, which was still in flight when N+1 was scheduled."""
    outs = [_SO(0, {"a": 4}, {"a": [-1, -1, -1]}, scheduled_cached_reqs={"req_ids": ["a"], "resumed_req_ids": []}),
            _SO(1, {"a": 4}, {"a": [-1, -1, -1]}, scheduled_cached_reqs={"req_ids": ["a"], "resumed_req_ids": []}),
            _SO(2, {"a": 4}, {"a": [-1, -1, -1]}, scheduled_cached_reqs={"req_ids": ["a"], "resumed_req_ids": []})]
    rec = RecordingScheduler(_Sched(outs), TraceWriter(str(tmp_path / "t.jsonl"), {"kind": "header"}),
                             async_scheduling=True, num_speculative_tokens=3)
    s0 = rec.schedule()
    rec.note_spec_drafts(s0, {"a": [5, 6, 7]})
    s1 = rec.schedule()
    rec.update_from_output(s0, _mro(s0, {"a": [5, 8]}))  # 1 accepted + bonus: 2 rejected
    s2 = rec.schedule()
    rec.update_from_output(s1, _mro(s1, {"a": [1, 2, 3, 4]}))  # all accepted
    rec.update_from_output(s2, _mro(s2, {"a": [9]}))
    rec.close()
    lines = _lines(tmp_path / "t.jsonl")[1:]
    assert [x["num_rejected_tokens"] for x in lines] == [{"a": 2}, {"a": 0}, {"a": 3}]
    assert [x["num_computed_tokens_correction"] for x in lines] == [{"a": 0}, {"a": 2}, {"a": 0}]
    assert lines[0]["spec_draft_token_ids"] == {"a": [5, 6, 7]} and "spec_draft_token_ids" not in lines[1]


# ------------------------------------------------------------- the async rules on the bundled traces


def _check_async_rules(path: Path) -> dict:
    """docs/trace-format.md's async rules, in plain Python: every executed step has its own output; placeholders
    are -1 with real drafts of the same length; the worker-true start (num_computed_tokens - correction)
    follows from the previous step's start, query length and rejections. Returns counts."""
    lines = _lines(path)
    h, steps = lines[0], lines[1:]
    assert h["async_scheduling"] is True and h["max_concurrent_batches"] == 2
    stops = {h.get("eos_token_id"), *(h.get("stop_token_ids") or [])} - {None}
    true_next: dict[str, int] = {}
    stopped: dict[str, int] = {}
    n = {"discarded": 0, "corrections": 0, "placeholder_steps": 0}
    for s in steps:
        so = s["scheduler_output"]
        assert s["sampled_token_ids"] is not None, f"step {s['step']} has no output"
        assert list(s["sampled_token_ids"]) == list(so["num_scheduled_tokens"]), s["step"]
        for r in so["finished_req_ids"]:
            true_next.pop(r, None)
        for r in so["num_scheduled_tokens"]:
            if r in stopped:
                n["discarded"] += 1
        for nr in so["scheduled_new_reqs"]:
            true_next[nr["req_id"]] = nr["num_computed_tokens"]
        c = so["scheduled_cached_reqs"]
        corr = s.get("num_computed_tokens_correction") or {}
        for r, nct in zip(c["req_ids"], c["num_computed_tokens"]):
            if r in c["resumed_req_ids"]:
                true_next[r] = nct
                continue
            assert nct - corr.get(r, 0) == true_next[r], (s["step"], r)
            n["corrections"] += bool(corr.get(r))
        spec = so["scheduled_spec_decode_tokens"]
        if spec:
            n["placeholder_steps"] += 1
            real = s["spec_draft_token_ids"]
            for r, d in spec.items():
                assert set(d) == {-1} and len(real[r]) == len(d), (s["step"], r)
        rej = s.get("num_rejected_tokens") or {}
        for r, q in so["num_scheduled_tokens"].items():
            true_next[r] = true_next[r] + q - rej.get(r, 0)
            toks = s["sampled_token_ids"][r]
            if r in spec and toks:
                assert rej[r] == len(spec[r]) - (len(toks) - 1)
            if r not in stopped and any(t in stops for t in toks):
                stopped[r] = s["step"]
    return n


def test_bundled_async_decode_has_discarded_outputs():
    n = _check_async_rules(ASYNC_DECODE)
    assert n["discarded"] >= 3 and n["placeholder_steps"] == 0


def test_bundled_async_spec_decode_carries_drafts_rejections_and_corrections():
    n = _check_async_rules(ASYNC_SPEC)
    assert n["discarded"] >= 1 and n["placeholder_steps"] >= 10 and n["corrections"] >= 10


# ------------------------------------------------------------------------------------- with vLLM 0.33


@needs_vllm
@pytest.mark.parametrize("name, path", [("async_decode", ASYNC_DECODE), ("async_spec_decode", ASYNC_SPEC)])
def test_async_recording_is_byte_identical(tmp_path, name, path):
    out = tmp_path / f"{name}.jsonl"
    res = subprocess.run([sys.executable, "-m", "kvmap", "record", str(WORKLOADS / f"{name}.yaml"), "-o", str(out),
                          "--no-progress"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert out.read_bytes() == path.read_bytes()


@needs_vllm
def test_live_plugin_under_async_records_what_offline_records(tmp_path):
    from kvmap.record.engine import build_scheduler, drive_async
    from kvmap.record.plugin import install
    from kvmap.record.workload import load_workload

    w = load_workload(WORKLOADS / "async_decode.yaml")

    class FakeEngineCore:  # stands in for EngineCore: builds its scheduler in __init__, has a batch queue
        batch_queue_size = 2

        def __init__(self, vllm_config):
            self.vc, _, self.scheduler, self.hasher = build_scheduler(w)

    live = tmp_path / "live.jsonl"
    install(FakeEngineCore, str(live))
    vc, _, _, _ = build_scheduler(w)
    core = FakeEngineCore(vc)
    assert type(core.scheduler).__name__ == "RecordingScheduler" and core.scheduler.async_scheduling
    drive_async(w, core.scheduler, core.hasher, core.vc.max_concurrent_batches)
    core.scheduler.close()
    got, want = _lines(live), _lines(ASYNC_DECODE)
    assert got[1:] == want[1:]
    assert got[0]["async_scheduling"] is True and got[0]["max_concurrent_batches"] == 2


@needs_vllm
def test_async_spec_with_the_v1_protocol_is_refused_as_vllm_does(tmp_path):
    w = tmp_path / "w.yaml"
    text = (WORKLOADS / "async_spec_decode.yaml").read_text().replace("protocol: v2", "protocol: v1")
    w.write_text(text)
    res = subprocess.run([sys.executable, "-m", "kvmap", "record", str(w), "-o", str(tmp_path / "t.jsonl"),
                          "--no-progress"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and "not supported by the V1 model runner" in res.stderr, res.stderr


# --------------------------------------------------------------- kvmap replay / validate on async traces


def _kvmap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmap", *args], capture_output=True, text=True, cwd=ROOT)


def _validate(path: Path, tmp_path: Path) -> dict:
    out = tmp_path / "v.json"
    _kvmap("validate", str(path), "--json", str(out))
    return json.loads(out.read_text())


def test_async_decode_validates_and_replays_with_verify_kv(tmp_path):
    v = _validate(ASYNC_DECODE, tmp_path)
    assert v["valid"] and not v["problems"], v["problems"][:3]
    res = _kvmap("replay", str(ASYNC_DECODE), "--verify-kv", "--no-progress", "-q")
    assert res.returncode == 0, res.stderr


def test_async_spec_decode_validates_and_replays_with_verify_kv(tmp_path):
    v = _validate(ASYNC_SPEC, tmp_path)
    assert v["valid"] and not v["problems"], v["problems"][:3]
    res = _kvmap("replay", str(ASYNC_SPEC), "--verify-kv", "--no-progress", "-q")
    assert res.returncode == 0, res.stderr


def test_async_spec_decode_as_the_worker_saw_it_validates_and_replays(tmp_path):
    """The async spec rule, shown sufficient and applied: with each num_computed_tokens lowered by its correction
    (the worker-true start) and the -1 placeholders replaced by spec_draft_token_ids (the real drafts), the trace
    is an ordinary spec-decoding trace that validates clean, replays with --verify-kv, and gives the same mappings,
    step for step, as kvmap's replay of the async trace itself."""
    lines = _lines(ASYNC_SPEC)
    for s in lines[1:]:
        so, c = s["scheduler_output"], s["scheduler_output"]["scheduled_cached_reqs"]
        corr = s.pop("num_computed_tokens_correction", None) or {}
        c["num_computed_tokens"] = [n - corr.get(r, 0) for r, n in zip(c["req_ids"], c["num_computed_tokens"])]
        real = s.pop("spec_draft_token_ids", None) or {}
        s.pop("num_rejected_tokens", None)
        for r in so["scheduled_spec_decode_tokens"]:
            so["scheduled_spec_decode_tokens"][r] = real[r]
    p = tmp_path / "worker_view.jsonl"
    p.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    v = _validate(p, tmp_path)
    assert v["valid"] and not v["problems"], v["problems"][:3]
    res = _kvmap("replay", str(p), "--verify-kv", "--no-progress", "-q", "--dump-mappings", str(tmp_path / "a.jsonl"))
    assert res.returncode == 0, res.stderr
    res = _kvmap("replay", str(ASYNC_SPEC), "--verify-kv", "--no-progress", "-q", "--dump-mappings",
                 str(tmp_path / "b.jsonl"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def _planted(tmp_path: Path, edit) -> Path:
    lines = _lines(ASYNC_SPEC)
    edit(lines)
    p = tmp_path / "planted.jsonl"
    p.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    return p


def _first_correction(lines):
    for s in lines[1:]:
        for r, v in (s.get("num_computed_tokens_correction") or {}).items():
            if v:
                return s, r
    raise AssertionError("no correction in the trace")


def test_validate_names_a_wrong_correction_at_its_step_and_request(tmp_path):
    step = req = None

    def edit(lines):
        nonlocal step, req
        s, req = _first_correction(lines)
        s["num_computed_tokens_correction"][req] += 1
        step = s["step"]

    v = _validate(_planted(tmp_path, edit), tmp_path)
    assert not v["valid"]
    assert (v["problems"][0]["step"], v["problems"][0]["req_id"]) == (step, req)
    assert v["problems"][0]["field"] == "num_computed_tokens_correction"


def test_validate_names_a_wrong_rejection_count_at_its_step_and_request(tmp_path):
    step = req = None

    def edit(lines):
        nonlocal step, req
        for s in lines[1:]:
            rej = s.get("num_rejected_tokens") or {}
            for r, v in rej.items():
                if v:
                    rej[r] = v - 1
                    step, req = s["step"], r
                    return

    v = _validate(_planted(tmp_path, edit), tmp_path)
    assert not v["valid"]
    assert (v["problems"][0]["step"], v["problems"][0]["req_id"]) == (step, req)
    assert v["problems"][0]["field"] == "num_rejected_tokens"


def test_plugin_writes_pending_lines_when_the_engine_shuts_down(tmp_path, monkeypatch):
    """The plugin wraps EngineCore.shutdown: a step still in the batch queue is written, not lost."""
    from kvmap.record import plugin

    monkeypatch.setattr(plugin, "header_from_config", lambda *a, **k: {"kind": "header"})

    class Core:
        def __init__(self, vllm_config):
            self.scheduler = _Sched([_SO(0, {"a": 1}), _SO(1, {"a": 1})])
            self.scheduler.kv_cache_config = None
            self.batch_queue_size = 2
            self.shut = False

        def shutdown(self):
            self.shut = True

    class Cfg:
        scheduler_config = type("S", (), {"async_scheduling": True})()
        speculative_config = None
        model_config = None

    plugin.install(Core, str(tmp_path / "t.jsonl"))
    core = Core(Cfg())
    s0 = core.scheduler.schedule()
    core.scheduler.schedule()
    core.scheduler.update_from_output(s0, _mro(s0, {"a": [5]}))
    core.shutdown()
    assert core.shut
    lines = _lines(tmp_path / "t.jsonl")[1:]
    assert [x["sampled_token_ids"] for x in lines] == [{"a": [5]}, None]


@needs_vllm
@pytest.mark.parametrize("protocol", ["v1", "v2"])
def test_async_preemption_records_validates_and_replays(tmp_path, protocol):
    """Async scheduling under KV pressure (preempted requests with a step in flight), both protocols: the
    recorded trace validates clean and replays with --verify-kv."""
    w = tmp_path / "w.yaml"
    w.write_text((WORKLOADS / "preemption_v1.yaml").read_text().replace("protocol: v1", f"protocol: {protocol}")
                 + "async_scheduling: true\n")
    out = tmp_path / "t.jsonl"
    res = _kvmap("record", str(w), "-o", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr
    lines = _lines(out)
    assert sum(len(s["scheduler_output"]["preempted_req_ids"]) for s in lines[1:]) > 0
    v = _validate(out, tmp_path)
    assert v["valid"] and not v["problems"], v["problems"][:3]
    res = _kvmap("replay", str(out), "--verify-kv", "--no-progress", "-q")
    assert res.returncode == 0, res.stderr
