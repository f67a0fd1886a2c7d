"""GPU-only checks (skipped without CUDA): device workers on the GPU equal the reference bit for bit, keep
their buffers at fixed addresses (CUDA-graph ready), time phases with CUDA events, and read the KV back."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay  # noqa: E402
from kvmap.trace import Trace  # noqa: E402
from kvmap.workers.registry import make_worker  # noqa: E402

from .conftest import TRACES, bundled_traces  # noqa: E402


def reference(path):
    out: list = []
    replay(Trace(path), ReplayConfig(backend="reference", write_kv=False, nvtx=False), on_mappings=out.append)
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("path", bundled_traces(), ids=lambda p: p.name)
def test_gpu_worker_equals_reference(path, backend):
    got: list = []
    r = replay(Trace(path), ReplayConfig(backend=backend, device="cuda", verify_kv=True, nvtx=False),
               on_mappings=got.append)
    assert got == reference(path)
    assert r.kv_mismatches == 0 and r.kv_checked > 0
    assert r.device_phase_ns.shape == r.phase_ns.shape  # one CUDA-event time per phase and step


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_buffers_keep_their_addresses(backend):
    t = Trace(TRACES / "chunked_prefill.jsonl")
    w = make_worker(backend, t.header, "cuda")
    names = ["o_idx_mapping", "o_query_start_loc", "o_seq_lens", "o_positions", "o_input_ids", "o_slot_mapping",
             "d_token_ids"]
    before = {n: getattr(w.mirror, n).data_ptr() for n in names}
    for s in t.steps():
        w.run_step(s)
        w.append_sampled()
    torch.cuda.synchronize()
    assert {n: getattr(w.mirror, n).data_ptr() for n in names} == before


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL across ranks needs one GPU per rank (2)")
def test_nccl_processes_equal_the_emulation(tmp_path):
    """The distributed replay on NCCL, one GPU per rank, Triton workers: the dump equals the emulation."""
    from kvmap.run.distributed import launch
    from kvmap.workers.mappings import dump_line

    path = TRACES / "dcp2.jsonl"
    dump = tmp_path / "nccl.jsonl"
    r = launch(path, 2, backend="triton", device="cuda", verify_kv=True, dump_mappings=dump, timeout=300)
    want: list[str] = []
    replay(Trace(path), ReplayConfig(backend="reference", write_kv=False, nvtx=False),
           on_mappings=lambda d: want.append(dump_line(d)))
    assert dump.read_text() == "".join(want)
    assert r.kv_mismatches == 0 and r.world_size == 2
