"""`kvmap record`: workload files are checked without vLLM (every bad one is one line naming the file and the key,
exit 2, no trace written); with vLLM installed (CI's record environment), recording reproduces the bundled traces
byte for byte, the live plugin writes the same trace, what vLLM refuses or fails at is one line naming the file,
and the fake model's temporary folder never outlives a run."""

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
ONE = "requests: [{req_id: a, prompt_len: 20, max_tokens: 5}]\n"
GEN = "generate: {{num_requests: 3, prompt_len: [10, 20], output_len: [2, 4], {}}}\n"


@pytest.mark.parametrize("text, fragment", [
    ("block_size: 16\nbogus: 1\n", "field bogus: unknown key"),
    ("block_size: sixteen\n", "field block_size: expected int"),
    ("protocol: v9\nrequests: [{req_id: a, prompt_len: 4, max_tokens: 2}]\n", "field protocol: must be v1 or v2"),
    ("requests: [{req_id: a, prompt_len: 4}]\n", "field requests[0]: missing key max_tokens"),
    ("requests: [{req_id: a, max_tokens: 5}]\n", "field requests[0]: missing key prompt_len"),
    ("", "expected a mapping, got an empty file"),
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
    # ranges the generator and the scheduler need
    ("vocab_size: 0\n" + ONE, "field vocab_size: must be >= 2"),
    ("vocab_size: 1\n" + ONE, "field vocab_size: must be >= 2"),
    ("kv_cache_groups: [{num_layers: 0}]\n" + ONE, "field kv_cache_groups[0].num_layers: must be >= 1"),
    ("kv_cache_groups: [{num_layers: -2}]\n" + ONE, "field kv_cache_groups[0].num_layers: must be >= 1"),
    ("max_steps: 0\n" + ONE, "field max_steps: must be > 0"),
    ("requests: [{req_id: a, prompt_len: 20, max_tokens: 5, prefix: p, prefix_len: -5}]\n",
     "field requests[0].prefix_len: must be >= 0"),
    ("requests: [{req_id: a, prompt_len: 20, max_tokens: 5, prefix_len: 10}]\n",
     "field requests[0].prefix_len: needs `prefix`"),
    ("requests: [{req_id: a, prompt_len: 20, max_tokens: 5, arrival_step: -3}]\n",
     "field requests[0].arrival_step: must be >= 0"),
    (GEN.format("shared_prefix_len: 8, num_prefixes: 0, prefix_fraction: 1.0"),
     "field generate.num_prefixes: must be >= 1"),
    (GEN.format("shared_prefix_len: 8, prefix_fraction: 2.0"), "field generate.prefix_fraction: must be within [0, 1]"),
    (GEN.format("shared_prefix_len: 8, prefix_fraction: -0.5"), "field generate.prefix_fraction: must be within"),
    (GEN.format("arrival_rate: -1.0"), "field generate.arrival_rate: must be >= 0"),
    (GEN.format("shared_prefix_len: -8, prefix_fraction: 1.0"), "field generate.shared_prefix_len: must be >= 0"),
    (GEN.format("num_requests: -3"), "field generate.num_requests: must be >= 0"),
    # a request the block pool can never hold (block 0 is vLLM's null block)
    ("num_gpu_blocks: 2\nrequests: [{req_id: a, prompt_len: 100, max_tokens: 5}]\n",
     "field requests[0]: can never be scheduled: its 104 tokens need at least 7 KV cache blocks at once, and "
     "num_gpu_blocks 2 gives one request at most 1"),
    ("num_gpu_blocks: 3\nrequests: [{req_id: a, prompt_len: 40, max_tokens: 8}]\n",
     "field requests[0]: can never be scheduled: its 47 tokens need at least 3 KV cache blocks"),
    ("num_gpu_blocks: 4\nrequests: [{req_id: a, prompt_len: 20, max_tokens: 2}, {req_id: b, prompt_len: 9, "
     "max_tokens: 2, chunks: [{prompt_len: 40, max_tokens: 9}]}]\n", "field requests[1]: can never be scheduled"),
    ("num_gpu_blocks: 3\ndecode_context_parallel_size: 2\ntensor_parallel_size: 2\nkv_cache_groups: [{}, {}]\n"
     "requests: [{req_id: a, prompt_len: 30, max_tokens: 4}]\n", "need at least 4 KV cache blocks"),
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


@pytest.mark.parametrize("make, fragment", [
    (lambda p: p.mkdir(), "is a folder, not a workload file"),
    (lambda p: p.write_bytes(b"\xff\xfe block_size: 16\n"), "not a text file (UTF-8): byte 0xff at offset 0"),
])
def test_an_unreadable_workload_is_one_line(tmp_path, make, fragment):
    w = tmp_path / "w.yaml"
    make(w)
    res = runner.invoke(app, ["record", str(w), "-o", str(tmp_path / "t.jsonl")])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and f"{w}: {fragment}" in lines[0], res.stderr
    assert not (tmp_path / "t.jsonl").exists()


def test_null_is_not_given_where_the_default_is_none(tmp_path):
    w = tmp_path / "w.yaml"
    w.write_text("runner: null\ncudagraph_mode: null\neos_token_id: null\ngenerate: null\n"
                 "kv_cache_groups: [{kind: full_attention, kernel_block_size: null, sliding_window: null}]\n"
                 "requests: [{req_id: a, prompt_len: 20, max_tokens: 5, prefix: null,\n"
                 "            chunks: [{prompt_len: 3, max_tokens: 2, arrival_step: null}]}]\n")
    got = load_workload(w)
    assert (got.runner, got.cudagraph_mode, got.eos_token_id, got.generate) == (None, None, None, None)
    assert got.kv_cache_groups[0].kernel_block_size is None and got.requests[0].chunks[0].arrival_step is None
    assert got.source == str(w)


def test_the_block_pool_check_spares_what_can_run(tmp_path):
    """Only full-attention groups need the whole sequence; a stop token can end a request after its prompt; a
    session's chunks count; and every bundled workload still loads (test_every_bundled_workload_loads)."""
    from kvmap.record.workload import least_blocks

    w = tmp_path / "w.yaml"
    w.write_text("num_gpu_blocks: 4\nkv_cache_groups: [{kind: sliding_window, sliding_window: 16}, {kind: mamba}]\n"
                 "requests: [{req_id: a, prompt_len: 100, max_tokens: 5}]\n")
    got = load_workload(w)
    assert least_blocks(got, got.requests[0]) == (104, 2)
    w.write_text("num_gpu_blocks: 3\neos_token_id: 7\nrequests: [{req_id: a, prompt_len: 32, max_tokens: 90}]\n")
    got = load_workload(w)
    assert least_blocks(got, got.requests[0]) == (32, 2)
    w.write_text("requests: [{req_id: a, prompt_len: 20, max_tokens: 5, chunks: [{prompt_len: 3, max_tokens: 2}]}]\n")
    got = load_workload(w)
    assert least_blocks(got, got.requests[0]) == (28, 2)


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
                                  "kernel_block_split", "vllm51031", "dcp2_mamba", "full_graphs_spec",
                                  "long_mixed.jsonl.gz"])
def test_recording_reproduces_the_bundled_trace(tmp_path, name):
    """The async workloads: tests/test_record_async.py; streaming_sessions: tests/test_continuations.py."""
    file = name if name.endswith(".gz") else f"{name}.jsonl"
    out = tmp_path / file
    res = runner.invoke(app, ["record", str(WORKLOADS / f"{name.split('.')[0]}.yaml"), "-o", str(out),
                              "--no-progress"])
    assert res.exit_code == 0, res.output
    assert out.read_bytes() == (TRACES / file).read_bytes()


def _record_in(tmp_path, monkeypatch, text: str):
    """Record workload `text` through the CLI with tempfile's folder under tmp_path (the fake model's folder must
    be gone afterwards): (result, workload path, trace path, that folder)."""
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    w, out = tmp_path / "w.yaml", tmp_path / "t.jsonl"
    w.write_text(text)
    return runner.invoke(app, ["record", str(w), "-o", str(out), "--no-progress"]), w, out, tmp


def _base(**over) -> str:
    """A workload's settings (the requests not included): small ones, with `over` replacing or adding keys."""
    keys = {"block_size": 16, "num_gpu_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64,
            "max_model_len": 256, **over}
    return "".join(f"{k}: {v}\n" for k, v in keys.items())


@needs_vllm
@pytest.mark.parametrize("text, fragment", [
    (_base(max_num_batched_tokens=1) + ONE, "field max_num_batched_tokens: vLLM refuses this configuration: "
     "max_num_batched_tokens (1) must be greater than or equal to max_num_seqs (4)"),
    (_base(enable_chunked_prefill="false") + ONE, "field max_num_batched_tokens: vLLM refuses this configuration: "
     "max_num_batched_tokens (64) is smaller than max_model_len (256)"),
    (_base(max_steps=3) + ONE, "field max_steps: still running after max_steps=3 steps"),
])
def test_what_vllm_refuses_is_one_line_naming_the_file(tmp_path, monkeypatch, text, fragment):
    res, w, out, tmp = _record_in(tmp_path, monkeypatch, text)
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert "Traceback" not in res.output
    errors = [x for x in res.stderr.splitlines() if "error" in x.lower()]
    assert len(errors) == 1 and f"{w}, {fragment}" in errors[0], res.stderr
    assert not out.exists() and not list(tmp_path.glob(".t.jsonl*"))
    assert not list(tmp.glob("kvmap-model-*"))  # the fake model's folder went with the failure


@needs_vllm
def test_a_vllm_failure_building_the_scheduler_is_one_line(tmp_path, monkeypatch):
    import vllm.v1.core.kv_cache_utils as utils

    def broken(*args):
        raise AssertionError

    monkeypatch.setattr(utils, "resolve_kv_cache_block_sizes", broken)
    res, w, out, tmp = _record_in(tmp_path, monkeypatch, _base() + ONE)
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert f"{w}: vLLM cannot build a scheduler for this workload: AssertionError" in res.stderr
    assert not out.exists() and not list(tmp.glob("kvmap-model-*"))


@needs_vllm
@pytest.mark.parametrize("settings, block_size", [
    ({"kv_cache_groups": "[{kind: mamba}]"}, 256),  # vLLM's engine: the state block's size, max_model_len
    ({"kv_cache_groups": "[{kind: mamba, num_layers: 2}, {kind: mamba}]", "async_scheduling": "true"}, 256),
    ({"decode_context_parallel_size": 3, "tensor_parallel_size": 3}, 16),  # 3 heads: hidden size 192
])
def test_workloads_vllm_can_run_record_and_validate(tmp_path, monkeypatch, settings, block_size):
    from kvmap.trace import Trace

    res, w, out, tmp = _record_in(tmp_path, monkeypatch, _base(**settings) + ONE)
    assert res.exit_code == 0, res.output
    assert Trace(out).header.block_size == block_size
    assert not list(tmp.glob("kvmap-model-*"))  # the fake model's folder is removed after a run too
    check = runner.invoke(app, ["validate", str(out)])
    assert check.exit_code == 0 and "no problems" in check.output, check.output


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
