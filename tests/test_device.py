"""Device workers on CPU tensors: the torch worker and the Triton kernels (under TRITON_INTERPRET=1) equal the
reference bit for bit, write the same KV bits as the other paths, and their KV read-back finds corruption."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app
from kvmap.kv.cache import KVCheckResult, canary, canary_torch
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.run.timing import EventTimer
from kvmap.trace import Trace

from .conftest import TRACES, bundled_traces

runner = CliRunner()
SMALL = ["worked_example.jsonl", "chunked_prefill.jsonl", "prefix_caching.jsonl", "spec_decode.jsonl",
         "hybrid_sliding_window.jsonl"]


def reference(path):
    out: list = []
    replay(Trace(path), ReplayConfig(backend="reference", write_kv=False, nvtx=False), on_mappings=out.append)
    return out


@pytest.mark.parametrize("path", bundled_traces(), ids=lambda p: p.name)
def test_torch_worker_equals_reference_and_kv_reads_back(path):
    got: list = []
    verify = "long_mixed" not in path.name  # 57 M read-backs in torch on CPU: the numba path checks that one
    r = replay(Trace(path), ReplayConfig(backend="torch", verify_kv=verify, nvtx=False), on_mappings=got.append)
    assert got == reference(path)
    assert r.kv_mismatches == 0 and (r.kv_checked > 0 or not verify)
    assert "h2d" in r.phases and r.h2d_bytes > 0


@pytest.mark.parametrize("name", SMALL)
def test_triton_kernels_equal_reference_under_the_interpreter(name):
    pytest.importorskip("triton")
    got: list = []
    r = replay(Trace(TRACES / name), ReplayConfig(backend="triton", verify_kv=True, nvtx=False), on_mappings=got.append)
    assert got == reference(TRACES / name)
    assert r.kv_checked > 0 and r.kv_mismatches == 0


def test_canary_torch_equals_numpy():
    import torch

    rng = np.random.default_rng(3)
    toks, pos = rng.integers(0, 2**31 - 1, 64), rng.integers(0, 2**24, 64)
    assert np.array_equal(canary_torch(torch.from_numpy(toks), torch.from_numpy(pos), 10).numpy(),
                          canary(toks, pos, 10).astype(np.int64))


def _cache_after(backend, path, steps=None):
    from kvmap.kv.cache import KVGeometry
    from kvmap.workers.registry import make_worker

    t = Trace(path)
    w = make_worker(backend, t.header)
    kv = w.make_kv_cache(KVGeometry(2, 4, "float16"))
    for s in t.steps(0, steps):
        w.run_step(s)
        w.write_kv(kv)
        last = s
        w.append_sampled()
    return w, kv, last


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_device_kv_bits_equal_the_host_path(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    path = TRACES / "spec_decode.jsonl"
    _, host, _ = _cache_after("numpy", path)
    _, dev, _ = _cache_after(backend, path)
    for a, b in zip(host.bits, dev.bits):
        assert np.array_equal(a, b.cpu().numpy())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_device_read_back_finds_a_corrupted_slot(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    path = TRACES / "chunked_prefill.jsonl"
    w, kv, last = _cache_after(backend, path, steps=7)
    row = w.state.req_id_to_index["a"]
    blk = int(w.state.block_tables[0][row, 0])
    kv.bits[0][1, blk * 16 + 5, 0] += 1  # one V lane of position 5
    res = KVCheckResult()
    w.verify_kv(kv, res)
    assert res.mismatches == 1
    e = res.examples[0]
    assert (e.req_id, e.position, e.slot) == ("a", 5, blk * 16 + 5)


def test_cuda_device_without_cuda_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    res = runner.invoke(app, ["replay", "--device", "cuda"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "cuda is not available here" in res.stderr and "--device cpu" in res.stderr


class FakeEvent:
    clock = 0

    def record(self):
        FakeEvent.clock += 1000
        self.t = FakeEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, other):  # ms
        return (other.t - self.t) / 1e6


def test_event_timer_resolves_late_and_reuses_events():
    made = []
    timer = EventTimer(3, lambda: made.append(FakeEvent()) or made[-1], lag=2)
    for step in range(10):
        for _ in range(4):  # a boundary before the first phase and after each of 3
            timer.mark()
        timer.end_step(keep=step >= 2)
    rows = timer.finish()
    assert rows.shape == (8, 3) and (rows == 1000).all()
    assert len(made) <= 4 * 4  # events come back to the pool
