"""The paged KV cache: canary bits identical on every path, -1 never written, corruption always found."""

from __future__ import annotations

import numpy as np
import pytest

from kvmap.kv_cache import KV_DTYPES, KVGeometry, PagedKVCache, canary
from kvmap.replay import replay
from kvmap.trace import Trace
from kvmap.worker import make_worker, run_step

from .conftest import TRACES


def test_numba_canary_equals_numpy_canary():
    kc = pytest.importorskip("kvmap.kernels_cpu")
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 2**31 - 1, 50)
    pos = rng.integers(0, 2**20, 50)
    want = canary(toks, pos, 12)
    got = np.array([[kc._canary(int(t), int(p), lane) for lane in range(12)] for t, p in zip(toks, pos)],
                   dtype=np.uint64)
    assert np.array_equal(got, want.astype(np.uint64))


def _replayed_cache(path, use_kernels, dtype, steps=None):
    t = Trace(path)
    w = make_worker("numpy", t.header)
    kv = PagedKVCache(t.header, KVGeometry(2, 4, dtype), use_kernels=use_kernels)
    for s in t.steps(0, steps):
        run_step(w, s)
        kv.write(w.mappings())
        w.append_sampled()
    return t, w, kv


@pytest.mark.parametrize("dtype", sorted(set(KV_DTYPES) - {"fp8"}))
def test_kernel_and_torch_writes_are_bit_identical(dtype):
    pytest.importorskip("numba")
    path = TRACES / "hybrid_sliding_window.jsonl"
    _, _, a = _replayed_cache(path, True, dtype)
    _, _, b = _replayed_cache(path, False, dtype)
    for x, y in zip(a.bits, b.bits):
        assert x.size and bool((x == y).all())


def test_pad_slots_are_skipped():
    t = Trace(TRACES / "worked_example.jsonl")
    for use_kernels in (True, False):
        w = make_worker("numpy", t.header)
        kv = PagedKVCache(t.header, KVGeometry(), use_kernels=use_kernels)
        run_step(w, next(t.steps()))
        m = w.mappings()
        m.slot_mapping[0, :5] = -1  # pretend the first 5 tokens are padding
        kv.write(m)
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
    r = replay(Trace(path), stop=None, verify_kv=True, nvtx=False)  # a clean replay finds nothing
    assert r.kv_mismatches == 0
    run_step(w, next(t.steps(6, 7)))
    kv.write(w.mappings())
    res = kv.verify(w, 6, w.mappings().req_ids)
    assert res.mismatches == 1
    e = res.examples[0]
    assert (e.req_id, e.position, e.slot, e.step) == ("a", 3, blk * 16 + 3, 6)
