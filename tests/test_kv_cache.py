"""The paged KV cache: canary bits identical on every path, -1 never written, corruption always found."""

from __future__ import annotations

import numpy as np
import pytest

from kvmap.kv.cache import KV_DTYPES, KVCheckResult, KVGeometry, PagedKVCache
from kvmap.kv.canary import canary, canary_value
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace
from kvmap.workers.registry import make_worker

from .conftest import TRACES


def _canary_cases():
    rng = np.random.default_rng(0)
    return rng.integers(0, 2**31 - 1, 50), rng.integers(0, 2**20, 50)


def test_numpy_canary_equals_the_spec():
    toks, pos = _canary_cases()
    want = np.array([[canary_value(int(t), int(p), lane) for lane in range(12)] for t, p in zip(toks, pos)],
                    dtype=np.uint64)
    assert np.array_equal(canary(toks, pos, 12).astype(np.uint64), want)
    assert canary_value(0, 0, 0) == 0 and canary_value(7, 3, 1) != canary_value(7, 3, 2)


def test_numba_canary_equals_the_spec():
    kk = pytest.importorskip("kvmap.kv.kernels")
    toks, pos = _canary_cases()
    got = np.array([[kk.canary(int(t), int(p), lane) for lane in range(12)] for t, p in zip(toks, pos)],
                   dtype=np.uint64)
    want = np.array([[canary_value(int(t), int(p), lane) for lane in range(12)] for t, p in zip(toks, pos)],
                    dtype=np.uint64)
    assert np.array_equal(got, want)


def _replayed_cache(path, use_kernels, dtype, steps=None):
    t = Trace(path)
    w = make_worker("numba" if use_kernels else "numpy", t.header)  # numba reads back with the kernel
    kv = PagedKVCache(t.header, KVGeometry(2, 4, dtype), use_kernels=use_kernels)
    for s in t.steps(0, steps):
        w.run_step(s)
        w.write_kv(kv)
        w.append_sampled()
    return t, w, kv


@pytest.mark.parametrize("dtype", sorted(set(KV_DTYPES) - {"fp8"}))
def test_kernel_and_torch_writes_are_bit_identical(dtype):
    pytest.importorskip("numba")
    path = TRACES / "hybrid_sliding_window.jsonl"
    _, _, a = _replayed_cache(path, True, dtype)
    _, _, b = _replayed_cache(path, False, dtype)
    for x, y in zip(a.bits, b.bits):
        assert x.size and np.array_equal(x, y)


def test_pad_slots_are_skipped():
    t = Trace(TRACES / "worked_example.jsonl")
    for use_kernels in (True, False):
        w = make_worker("numpy", t.header)
        kv = PagedKVCache(t.header, KVGeometry(), use_kernels=use_kernels)
        w.run_step(next(t.steps()))
        m = w.mappings()
        m.slot_mapping[0, :5] = -1  # pretend the first 5 tokens are padding
        kv.write(m.input_ids, m.positions, m.slot_mapping)
        last = t.header.num_gpu_blocks * 16 - 1  # where -1 would land if used as an index
        assert not bool(kv.bits[0][:, last].any())
        assert int(kv.written[0].sum()) == m.num_tokens - 5


@pytest.mark.parametrize("use_kernels", [True, False])
def test_verify_finds_a_corrupted_slot(use_kernels):
    """Overwrite one slot of a live request between steps: the next step's read-back names it."""
    path = TRACES / "chunked_prefill.jsonl"
    t, w, kv = _replayed_cache(path, use_kernels, "bfloat16", steps=6)
    # request 'a' holds positions 0.. in its first block; clobber position 3
    row = w.state.req_id_to_index["a"]
    blk = int(w.state.block_tables[0][row, 0])
    slot = blk * 16 + 3
    kv.bits[0][:, slot] += 1
    r = replay(Trace(path), ReplayConfig(stop=None, verify_kv=True, nvtx=False))  # a clean replay finds nothing
    assert r.kv_mismatches == 0
    w.run_step(next(t.steps(6, 7)))
    w.write_kv(kv)
    res = KVCheckResult()
    w.verify_kv(kv, res)
    assert res.mismatches == 1
    e = res.examples[0]
    assert (e.req_id, e.position, e.slot, e.step) == ("a", 3, blk * 16 + 3, 6)
