"""`kvmap record`: workload files are checked without vLLM; with vLLM installed (CI's record environment),
recording reproduces the bundled traces byte for byte and the live plugin writes the same trace."""

from __future__ import annotations

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app
from kvmap.record.workload import load_workload

from .conftest import TRACES

runner = CliRunner()
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (CI records in .venv-record)")
WORKLOADS = TRACES / "workloads"


@pytest.mark.parametrize("text, fragment", [
    ("block_size: 16\nbogus: 1\n", "field bogus: unknown key"),
    ("block_size: sixteen\n", "field block_size: expected int"),
    ("protocol: v9\nrequests: [{req_id: a, prompt_len: 4, max_tokens: 2}]\n", "field protocol: must be v1 or v2"),
    ("requests: [{req_id: a, prompt_len: 4}]\n", "max_tokens"),
    ("requests: [{req_id: a, prompt_len: 4, max_tokens: 2, colour: red}]\n", "field requests[0].colour: unknown key"),
    ("generate: {prompt_len: [9, 3]}\n", "field generate.prompt_len: expected [lo, hi]"),
    ("kv_cache_groups: [{kind: sliding_window}]\nrequests: [{req_id: a, prompt_len: 4, max_tokens: 2}]\n",
     "needs a window"),
    ("max_model_len: 8\nrequests: [{req_id: a, prompt_len: 6, max_tokens: 4}]\n", "exceeds max_model_len"),
    ("requests: [\n", "not valid YAML"),
    ("block_size: 16\n", "no requests"),
    ("cp_kv_cache_interleave_size: 5\ndecode_context_parallel_size: 2\ntensor_parallel_size: 2\n"
     "requests: [{req_id: a, prompt_len: 4, max_tokens: 2}]\n",
     "field cp_kv_cache_interleave_size: must be >= 1 and divide"),
    ("decode_context_parallel_size: 2\nrequests: [{req_id: a, prompt_len: 4, max_tokens: 2}]\n",
     "field tensor_parallel_size: must be >= 1 and a multiple of decode_context_parallel_size"),
    ("block_size: 64\nkv_cache_groups: [{kind: full_attention, kernel_block_size: 24}]\n"
     "requests: [{req_id: a, prompt_len: 4, max_tokens: 2}]\n", "field kv_cache_groups[0].kernel_block_size: must be"),
    ("decode_context_parallel_size: 2\ntensor_parallel_size: 2\nkv_cache_groups: [{kind: sliding_window, "
     "sliding_window: 32}]\nrequests: [{req_id: a, prompt_len: 4, max_tokens: 2}]\n",
     "does not support sliding window"),
    ("runner: v3\nrequests: [{req_id: a, prompt_len: 4, max_tokens: 2}]\n", "field runner: must be mrv2 or v1"),
    ("cudagraph_mode: FULL\nrequests: [{req_id: a, prompt_len: 4, max_tokens: 2}]\n",
     "field cudagraph_capture_sizes: cudagraph_mode FULL needs"),
    ("cudagraph_capture_sizes: [0, 4]\nrequests: [{req_id: a, prompt_len: 4, max_tokens: 2}]\n",
     "field cudagraph_capture_sizes: expected a list of token counts"),
    ("kv_cache_groups: [{attention_backend: flash}]\nrequests: [{req_id: a, prompt_len: 4, max_tokens: 2}]\n",
     "field kv_cache_groups[0].attention_backend: expected"),
])
def test_bad_workload_is_one_located_line(tmp_path, text, fragment):
    w = tmp_path / "w.yaml"
    w.write_text(text)
    res = runner.invoke(app, ["record", str(w), "-o", str(tmp_path / "t.jsonl")])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and str(w) in lines[0] and fragment in lines[0], res.stderr
    assert not (tmp_path / "t.jsonl").exists()


def test_every_bundled_workload_loads():
    names = sorted(p.stem for p in WORKLOADS.glob("*.yaml"))
    assert len(names) >= 7
    for n in names:
        assert load_workload(WORKLOADS / f"{n}.yaml").request_list()


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
def test_missing_vllm_says_how_to_install(tmp_path):
    res = runner.invoke(app, ["record", str(WORKLOADS / "chunked_prefill.yaml"), "-o", str(tmp_path / "t.jsonl")])
    assert res.exit_code == 2 and "pip install --no-deps vllm==0.33.0" in res.stderr


@needs_vllm
@pytest.mark.parametrize("name", ["chunked_prefill", "prefix_caching", "preemption_v1", "preemption_v2",
                                  "hybrid_sliding_window", "chunked_local", "spec_decode", "dcp2", "dcp4_interleave8",
                                  "kernel_block_split", "vllm51031", "dcp2_mamba", "full_graphs_spec"])
def test_recording_reproduces_the_bundled_trace(tmp_path, name):
    out = tmp_path / f"{name}.jsonl"
    res = runner.invoke(app, ["record", str(WORKLOADS / f"{name}.yaml"), "-o", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert out.read_bytes() == (TRACES / f"{name}.jsonl").read_bytes()


@needs_vllm
def test_live_plugin_records_what_offline_records(tmp_path):
    """The plugin patches an engine class's __init__; an engine built from the workload's scheduler then
    records exactly the steps offline recording writes (the header differs only in informational keys)."""
    from kvmap.record.engine import build_scheduler, drive
    from kvmap.record.plugin import install

    w = load_workload(WORKLOADS / "prefix_caching.yaml")

    class FakeEngineCore:  # stands in for vllm.v1.engine.core.EngineCore: builds its scheduler in __init__
        def __init__(self, vllm_config):
            _, kvc, self.scheduler, self.hasher = build_scheduler(w)

    live = tmp_path / "live.jsonl"
    install(FakeEngineCore, str(live))
    vc, _, _, _ = build_scheduler(w)
    core = FakeEngineCore(vc)
    assert type(core.scheduler).__name__ == "RecordingScheduler"
    drive(w, core.scheduler, core.hasher)
    core.scheduler.close()
    got = [json.loads(x) for x in live.read_text().splitlines()]
    want = [json.loads(x) for x in (TRACES / "prefix_caching.jsonl").read_text().splitlines()]
    assert got[1:] == want[1:]
    info = {"workload", "description"}
    forward = {"runner", "cudagraph_mode", "cudagraph_capture_sizes"}  # a live engine's, written live only
    assert {k: v for k, v in got[0].items() if k not in info | forward} == {k: v for k, v in want[0].items()
                                                                           if k not in info}
    assert {k: got[0][k] for k in forward} == {"runner": "mrv2", "cudagraph_mode": "NONE",
                                               "cudagraph_capture_sizes": []}


@needs_vllm
def test_a_workload_records_its_forward_keys(tmp_path):
    from kvmap.forward.config import resolve
    from kvmap.trace import Trace

    text = (WORKLOADS / "spec_decode.yaml").read_text()
    text += ("runner: v1\ncudagraph_mode: FULL_DECODE_ONLY\ncudagraph_capture_sizes: [8, 1, 2, 4]\n"
             "kv_cache_groups: [{kind: full_attention, attention_backend: FLASHINFER}]\n")
    w = tmp_path / "w.yaml"
    w.write_text(text)
    out = tmp_path / "t.jsonl"
    res = runner.invoke(app, ["record", str(w), "-o", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    head = json.loads(out.read_text().splitlines()[0])
    assert (head["runner"], head["cudagraph_mode"], head["cudagraph_capture_sizes"]) == ("v1", "FULL_DECODE_ONLY",
                                                                                       [1, 2, 4, 8])
    assert head["kv_cache_groups"][0]["attention_backend"] == "FLASHINFER"
    cfg = resolve(Trace(out).header)
    assert (cfg.runner, cfg.cudagraph_capture_sizes, cfg.groups[0].attention_backend) == ("v1", (1, 2, 4, 8),
                                                                                           "FLASHINFER")


@needs_vllm
def test_writer_failure_never_breaks_the_engine(tmp_path, capsys):
    from kvmap.record.engine import build_scheduler, drive
    from kvmap.record.recorder import RecordingScheduler, TraceWriter

    w = load_workload(WORKLOADS / "chunked_prefill.yaml")
    _, _, scheduler, hasher = build_scheduler(w)
    rec = RecordingScheduler(scheduler, TraceWriter(str(tmp_path / "missing-dir" / "t.jsonl"), {"kind": "header"}))
    tokens, _ = drive(w, rec, hasher)
    assert tokens == 310
    assert "recording stops, the engine goes on" in capsys.readouterr().err
