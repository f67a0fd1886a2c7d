"""The backends that run vLLM's own code (vllm-mrv2, vllm-v1): every bundled trace replays with dumps identical to
the reference's in that runner's batch order, the forward keys included; each runner gets the other protocol's
preemptions as its own scheduler sends them; a broken copy of one vLLM kernel is named at its step, request and DCP
rank; without vLLM, one clear line. The forward parts taken from vLLM: test_vllm_backends_forward.py. The vLLM
tests run in CI's vLLM environments and skip elsewhere."""

from __future__ import annotations

import importlib.util
import subprocess
from dataclasses import replace
import sys

import pytest

from kvmap import vllm_compat
from kvmap.errors import KvmapError
from kvmap.trace import Trace
from kvmap.validate import validate

from .conftest import ROOT, TRACES, load_script, read_lines, write_lines
from .vllm_backends_helpers import CPU_BUILD, FORWARD_CONFIGS, GPU, assert_same_dumps, dumps, needs_mrv2, needs_v1

HAS_VLLM = importlib.util.find_spec("vllm") is not None
LONG_SLICE = 40  # steps of long_mixed through the interpreted kernels (about 0.1 s a step here)


def _traces():
    return sorted(p for p in TRACES.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))


@needs_mrv2
@pytest.mark.parametrize("config", FORWARD_CONFIGS)
@pytest.mark.parametrize("path", _traces(), ids=lambda p: p.name.split(".")[0])
def test_mrv2_dumps_equal_the_reference(path, config):
    name = path.name.split(".")[0]
    stop = LONG_SLICE if name == "long_mixed" else None
    if not GPU and Trace(path).header.decode_context_parallel_size > 1 and \
            vllm_compat.installed("triton") not in vllm_compat.INTERPRETER_MRV2_DCP:
        with pytest.raises(KvmapError, match="interpreter rejects Model Runner V2's DCP"):
            dumps(Trace(path), "vllm-mrv2")
        return
    got = dumps(Trace(path), "vllm-mrv2", stop, forward=True, config=config)
    want = dumps(Trace(path), "reference", stop, forward=True, config=config)
    assert_same_dumps(got, want, name)


@needs_v1
@pytest.mark.parametrize("config", FORWARD_CONFIGS)
@pytest.mark.parametrize("path", _traces(), ids=lambda p: p.name.split(".")[0])
def test_v1_dumps_equal_the_reference_in_v1_order(path, config):
    name = path.name.split(".")[0]
    stop = LONG_SLICE if name == "long_mixed" and not CPU_BUILD else None
    trace = Trace(path)
    if CPU_BUILD and trace.header.decode_context_parallel_size > 1:
        with pytest.raises(KvmapError, match="CPU build computes no DCP slot mappings"):
            dumps(trace, "vllm-v1", batch_order="v1")
        return
    got = dumps(trace, "vllm-v1", stop, batch_order="v1", forward=True, config=config)
    want = dumps(Trace(path), "reference", stop, batch_order="v1", forward=True, config=config)
    assert_same_dumps(got, want, name)


@needs_mrv2
def test_mrv2_gets_a_v1_resume_as_a_new_request_in_its_kept_row(tmp_path):
    """preemption_v1's req-3 (40 prompt tokens), preempted at step 27, resumes at step 48 with 40 + 25 tokens:
    Model Runner V2 keeps its row through the preemption and re-adds it there, with every token as prefill tokens
    and its prompt length; a resume without `all_token_ids` is named at its step, request and field."""
    from kvmap.workers.registry import make_worker

    trace = Trace(TRACES / "preemption_v1.jsonl")
    rows = [d["idx_mapping"][d["req_ids"].index("req-3")] for d in dumps(trace, "reference", stop=49)
            if "req-3" in d["req_ids"]]
    worker = make_worker("vllm-mrv2", trace.header, "cuda" if GPU else "cpu", "mrv2")
    dumps(trace, "vllm-mrv2", stop=49, worker=worker)
    st = worker.ops.runner.req_states
    i = st.req_id_to_index["req-3"]
    assert i == rows[0] == rows[-1] and (st.prompt_len.np[i], st.prefill_len.np[i]) == (40, 40 + 25)

    lines = read_lines(TRACES / "preemption_v1.jsonl")
    del lines[1 + 48]["scheduler_output"]["scheduled_cached_reqs"]["all_token_ids"]["req-3"]
    with pytest.raises(KvmapError) as e:
        dumps(Trace(write_lines(tmp_path / "bad.jsonl", lines)), "vllm-mrv2")
    assert (e.value.step, e.value.req_id, e.value.field) == (48, "req-3", "scheduled_cached_reqs.all_token_ids")


@needs_v1
def test_v1_reorder_is_vllms_own_and_validate_deep_compares_in_v1_order():
    path = TRACES / "preemption_v2.jsonl"  # a trace whose order the 4-region reorder changes
    want = dumps(Trace(path), "reference", batch_order="v1", threshold=4)
    assert want != dumps(Trace(path), "reference", batch_order="v1")
    assert dumps(Trace(path), "vllm-v1", batch_order="v1", threshold=4) == want
    r = validate(Trace(path), deep=True, backends=["vllm-v1"])
    assert r.valid and not r.problems, [p.message for p in r.problems[:3]]


@needs_v1
def test_v1_gets_a_v2_resume_as_its_own_scheduler_sends_it(tmp_path):
    """preemption_v2's req-3 (40 prompt tokens) comes back at step 48 as a new request with 40 + 25 prefill tokens:
    V1 gets it resumed and keeps its prompt length (its `is_prefilling` rule then gives the reference's values). Sent
    before the new req-5 at step 50, the resumed req-4 still joins V1's batch after it (into the row left by
    req-2, req-5; appended, req-4), as in the reference's V1 order; a resume whose prefill tokens are not the
    prompt and outputs V1 holds is named at its step, request and field."""
    from kvmap.workers.registry import make_worker

    trace = Trace(TRACES / "preemption_v2.jsonl")
    worker = make_worker("vllm-v1", trace.header, "cuda" if GPU else "cpu", "v1")
    dumps(trace, "vllm-v1", stop=49, batch_order="v1", worker=worker)
    ib = worker.ops.runner.input_batch
    i = ib.req_id_to_index["req-3"]
    assert (ib.num_prompt_tokens[i], ib.num_tokens_no_spec[i]) == (40, 40 + 25 + 1)  # + step 48's sample

    lines = read_lines(TRACES / "preemption_v2.jsonl")
    new = lines[1 + 50]["scheduler_output"]["scheduled_new_reqs"]
    assert [nr["req_id"] for nr in new] == ["req-5", "req-4"]
    new.reverse()
    swapped = write_lines(tmp_path / "swapped.jsonl", lines)
    want = dumps(Trace(swapped), "reference", batch_order="v1")
    assert want[50]["req_ids"] == ["req-3", "req-1", "req-5", "req-4"]
    assert dumps(Trace(swapped), "vllm-v1", batch_order="v1") == want

    lines[1 + 48]["scheduler_output"]["scheduled_new_reqs"][0]["prefill_token_ids"][40 + 24] += 1
    with pytest.raises(KvmapError) as e:
        dumps(Trace(write_lines(tmp_path / "bad.jsonl", lines)), "vllm-v1", batch_order="v1")
    assert (e.value.step, e.value.req_id, e.value.field) == (48, "req-3", "prefill_token_ids")


# recorded by tests/real_engine/run_engine.py (workload "preemption") on vLLM's CPU build 0.32.0: a real engine
REAL_032 = ROOT / "tests" / "data" / "real_engine_preemption_vllm032.jsonl.gz"


@needs_v1
def test_a_trace_recorded_by_another_vllm_replays_when_its_rules_did_not_change():
    trace = Trace(REAL_032)
    assert trace.header.vllm_version == "0.32.0"
    assert dumps(trace, "vllm-v1", batch_order="v1") == dumps(Trace(REAL_032), "reference", batch_order="v1")


def planted_51031_slot(row: list[int], pos: int, block_size: int, kbs: int, cp: int, rank: int, interleave: int):
    """The planted rule in plain Python: the virtual block from kbs * cp (vLLM: block_size * cp)."""
    vb, off = divmod(pos, kbs * cp)
    if off // interleave % cp != rank:
        return -1
    local = vb * block_size + off // (interleave * cp) * interleave + off % interleave
    i = local // block_size
    return (row[i] if i < len(row) else 0) * block_size + local % block_size  # past the row: the kernel reads 0s


@needs_mrv2
@pytest.mark.skipif(GPU, reason="validate --deep runs backends on host tensors: the Triton interpreter, off here")
@pytest.mark.skipif(vllm_compat.installed("triton") not in vllm_compat.INTERPRETER_MRV2_DCP,
                    reason="this Triton's interpreter cannot run MRV2's DCP kernel (CI pins triton 3.7.1)")
def test_broken_mrv2_slot_kernel_is_named_at_its_step_request_and_rank():
    trace = Trace(TRACES / "vllm51031.jsonl")
    h = trace.header
    g = h.kv_cache_groups[0]
    first = None  # (step, req_id, rank) where the planted rule first departs from the reference dump
    for d in dumps(trace, "reference"):
        for b, req_id in enumerate(d["req_ids"]):
            row = d["block_tables"][0][b]
            for t in range(d["query_start_loc"][b], d["query_start_loc"][b + 1]):
                for rank in range(h.decode_context_parallel_size):
                    bad = planted_51031_slot(row, d["positions"][t], g.block_size, g.kernel_block_size,
                                             h.decode_context_parallel_size, rank, h.cp_kv_cache_interleave_size)
                    if first is None and bad != d["slot_mapping"][rank][0][t]:
                        first = (d["step"], req_id, rank)
    assert first is not None
    bug = str(ROOT / "tests" / "backends" / "vllm51031_mrv2_backend.py") + ":MRV2VirtualBlockFromKernelSize"
    r = validate(trace, deep=True, backends=[bug])
    conf = [p for p in r.problems if p.kind == "conformance"]
    assert conf and (conf[0].step, conf[0].req_id, conf[0].field) == (first[0], first[1], "slot_mapping")
    assert f"on DCP rank {first[2]}" in conf[0].message and "the reference chain" in conf[0].message
    assert any(p.kind == "kv_mismatch" for p in r.problems)


@needs_mrv2
def test_mrv2_refuses_the_v1_batch_order():
    with pytest.raises(KvmapError, match="vllm-v1"):
        dumps(Trace(TRACES / "chunked_prefill.jsonl"), "vllm-mrv2", batch_order="v1")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
@pytest.mark.parametrize("backend", ["vllm-mrv2", "vllm-v1"])
def test_without_vllm_one_clear_line(backend):
    p = subprocess.run([sys.executable, "-m", "kvmap", "replay", str(TRACES / "chunked_prefill.jsonl"),
                        "--backend", backend], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "vLLM is not installed: pip install --no-deps vllm==0.33.0" in p.stderr


def test_version_rules_decide_cross_version_replays():
    header = Trace(TRACES / "dcp2.jsonl").header
    vllm_compat.check_trace_version(header, "0.33.0")  # same version
    vllm_compat.check_trace_version(replace(header, vllm_version="0.32.0"), "0.33.0")
    with pytest.raises(KvmapError, match="does not know"):
        vllm_compat.check_trace_version(replace(header, vllm_version="0.20.0"), "0.33.0")
    rules = vllm_compat.RULES
    saved = rules["0.32.0"]["virtual_block"]
    try:
        rules["0.32.0"]["virtual_block"] = "before #51031"
        with pytest.raises(KvmapError, match="virtual_block"):
            vllm_compat.check_trace_version(replace(header, vllm_version="0.32.0"),
                                            "0.33.0")
    finally:
        rules["0.32.0"]["virtual_block"] = saved


def test_gpu_check_vllm_section_skips_cleanly_without_a_gpu():
    lines = load_script("gpu_check").vllm_section("cpu", str(TRACES / "long_mixed.jsonl.gz"))
    assert lines == [l for l in lines if l.startswith("vLLM section: skipped (no GPU")] and len(lines) == 1


@needs_v1
def test_bench_vllm_prints_medians_and_ratios(capsys):
    assert load_script("bench_vllm").main([str(TRACES / "prefix_caching.jsonl"), "--warmup", "2"]) == 0
    out = capsys.readouterr().out
    assert "vLLM/kvmap" in out and "_prepare_inputs" in out and "x\n" in out
    import torch

    assert ("no GPU here" in out) != torch.cuda.is_available()
