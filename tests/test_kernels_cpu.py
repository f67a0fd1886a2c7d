"""The numba kernels against plain numpy on random batches, including the shapes the bundled traces never
reach: large batches (the merge sort), spec-decode keys, block sizes that are not powers of two."""

from __future__ import annotations

import numpy as np
import pytest

from kvmap.layout import GroupLayout
from kvmap.workers.buffers import batch_order

kc = pytest.importorskip("kvmap.workers.kernels_cpu")


@pytest.mark.parametrize("n", [0, 1, 5, 48, 49, 300, 1024])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_batch_order_matches_numpy(n, k):
    rng = np.random.default_rng(n * 10 + k)
    for _ in range(5):
        counts = rng.choice([1, 1, 1, 2, 1 + k, 64, 300], size=n).astype(np.int32)
        if n and rng.random() < 0.5:
            counts[:] = rng.integers(1, 600, size=n)  # mostly distinct keys: the sort does the work
        drafts = np.where(rng.random(n) < 0.5, np.minimum(counts - 1, k), 0).astype(np.int32)
        order = np.full(1024, -1, np.int32)
        got = kc.batch_order(counts, drafts, k, order, np.zeros(1024, np.int64), np.zeros(1024, np.int32))
        assert got == n
        assert order[:n].tolist() == batch_order(counts, drafts, k).tolist()


@pytest.mark.parametrize("block_size", [1, 7, 12, 16, 64])
def test_inputs_and_slots_match_numpy(block_size):
    rng = np.random.default_rng(block_size)
    R, L = 64, 600
    W = -(-L // block_size)
    token_ids = rng.integers(0, 2**31, size=(R, L), dtype=np.int32)
    table = rng.permutation(R * W).astype(np.int32).reshape(R, W)
    num_computed = rng.integers(0, 300, size=R).astype(np.int32)
    rows = rng.choice(R, size=40, replace=False).astype(np.int32)
    counts = np.where(rng.random(40) < 0.3, rng.integers(2, 200, size=40), 1).astype(np.int32)
    order = np.argsort(counts, kind="stable").astype(np.int32)
    T = int(counts.sum())
    idx, ns, nc, seq = (np.zeros(40, np.int32) for _ in range(4))
    qsl = np.zeros(41, np.int32)
    positions, input_ids = np.zeros(T + 5, np.int64), np.zeros(T + 5, np.int32)
    assert kc.prepare_inputs(rows, counts, order, num_computed, token_ids, idx, ns, nc, qsl, seq, positions,
                             input_ids) == T
    r, n = rows[order], counts[order]
    want_pos = np.concatenate([np.arange(num_computed[x], num_computed[x] + c) for x, c in zip(r, n)])
    assert idx.tolist() == r.tolist() and qsl.tolist() == [0, *np.cumsum(n).tolist()]
    assert seq.tolist() == (num_computed[r] + n).tolist()
    assert positions[:T].tolist() == want_pos.tolist()
    assert input_ids[:T].tolist() == token_ids[np.repeat(r, n), want_pos].tolist()
    slots = np.full(T + 5, -1, np.int64)
    kc.slot_mapping(idx, ns, nc, table, block_size, slots)
    rr = np.repeat(r, n)
    want = GroupLayout(block_size).slots(table[rr, want_pos // block_size], want_pos)  # the rule's numpy form
    assert slots[:T].tolist() == want.tolist() and slots[T:].tolist() == [-1] * 5
