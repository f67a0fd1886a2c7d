"""The address arithmetic has one spec (`GroupLayout.slot`, plain integers); every vectorized, compiled and
Triton form of the slot rule, and the read-back window, is held to it."""

from __future__ import annotations

import numpy as np
import pytest

from kvmap.layout import PAD_SLOT_ID, GroupLayout

BS = 16


def test_the_spec_on_the_worked_example():
    lay = GroupLayout(BS)
    assert lay.slot([37, 12], 31) == 12 * 16 + 15  # block 31 // 16 = 1 -> 12, offset 31 % 16 = 15
    assert [lay.slot([81, 44], p) for p in (16, 23)] == [44 * 16 + 0, 44 * 16 + 7]
    assert GroupLayout(BS, kind="mamba").slot([5], 3) == PAD_SLOT_ID


def test_the_spec_per_rank_with_context_parallelism():
    """trace-format.md's per-rank rule: cp 2, interleave 4, block 16: a block id spans 32 positions."""
    lays = [GroupLayout(BS, cp_size=2, cp_rank=r, interleave=4) for r in range(2)]
    row = [7, 9]
    # position 37: virtual block 37 // 32 = 1, offset 5; (5 // 4) % 2 = 1 -> rank 1, local 5 // 8 * 4 + 5 % 4 = 1
    assert [lay.slot(row, 37) for lay in lays] == [PAD_SLOT_ID, 9 * 16 + 1]
    for p in range(64):  # every token is local on exactly one rank
        assert sum(lay.slot(row, p) != PAD_SLOT_ID for lay in lays) == 1


def test_window_rule():
    assert GroupLayout(BS, "sliding_window", sliding_window=8).readable_start(20) == 20 - 8 + 1
    assert GroupLayout(BS, "chunked_local", attention_chunk_size=32).readable_start(70) == 64
    assert GroupLayout(BS).readable_start(70) == 0
    nc = np.array([0, 5, 20, 70])
    for lay in (GroupLayout(BS, "sliding_window", sliding_window=8),
                GroupLayout(BS, "chunked_local", attention_chunk_size=32), GroupLayout(BS)):
        assert lay.readable_lo(nc).tolist() == [lay.readable_start(int(x)) for x in nc]


def _case(seed=0, rows=6, width=12, nreq=4):
    rng = np.random.default_rng(seed)
    table = rng.permutation(rows * width * 3)[: rows * width].astype(np.int32).reshape(rows, width)
    idx = rng.choice(rows, nreq, replace=False).astype(np.int32)
    n = rng.integers(1, 40, nreq).astype(np.int32)
    nc = rng.integers(0, width * BS - 40, nreq).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    pos = np.concatenate([np.arange(a, a + m) for a, m in zip(nc, n)]).astype(np.int64)
    lay = GroupLayout(BS)
    want = [lay.slot(table[idx[b]].tolist(), int(p)) for b in range(nreq) for p in range(nc[b], nc[b] + n[b])]
    return table, idx, n, nc, qsl, pos, want


def test_vectorized_form_equals_the_spec():
    table, idx, n, nc, qsl, pos, want = _case()
    rows = np.repeat(idx, n)
    assert GroupLayout(BS).slots(table[rows, pos // BS], pos).tolist() == want


def test_numpy_worker_form_equals_the_spec():
    from types import SimpleNamespace

    from kvmap.workers import buffers

    for seed in range(5):
        table, idx, n, nc, qsl, pos, want = _case(seed)
        T, B = len(pos), len(idx)
        state = SimpleNamespace(block_tables=[table], block_sizes=[BS], kv_groups=[0])
        buf = SimpleNamespace(idx_mapping=idx, num_scheduled_tokens=n, positions=pos,
                              tmp_tok=np.zeros(T, np.int64), tmp_tok2=np.zeros(T, np.int64),
                              tmp_blk=np.zeros(T, np.int32), tmp_req=np.zeros(B, np.int64),
                              slot_mapping=np.full((1, T), -7, np.int64))
        buffers.compute_slot_mappings(state, buf, B, T)
        assert buf.slot_mapping[0].tolist() == want


def test_numba_form_equals_the_spec():
    kc = pytest.importorskip("kvmap.workers.kernels_cpu")
    for seed in range(5):
        table, idx, n, nc, qsl, pos, want = _case(seed)
        out = np.full(len(pos), -7, np.int64)
        kc.slot_mapping(idx, n, nc, table, BS, out)
        assert out.tolist() == want


def _triton_device():
    """(torch, device) for a Triton kernel test: CUDA, or CPU tensors under TRITON_INTERPRET=1; else skip."""
    pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    import os

    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET")):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    return torch, "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_form_equals_the_spec():
    torch, dev = _triton_device()
    from kvmap.workers.triton_worker import BLOCK, _slot_mapping_kernel

    table, idx, n, nc, qsl, pos, want = _case(1)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    T = len(pos)
    out = torch.full((T + 5,), 99, dtype=torch.int64, device=dev)
    tab = t(table)
    _slot_mapping_kernel[(len(idx) + 1,)](t(idx.astype(np.int64)), t(n), t(qsl), t(nc), tab, tab.stride(0), BS, out,
                                          len(idx), T, T + 5, BLOCK=BLOCK)
    got = out.cpu().numpy().tolist()
    assert got[:T] == want and got[T:] == [PAD_SLOT_ID] * 5  # padding from the actual count


def test_kv_read_back_slot_equals_the_spec():
    """The numba read-back locates a corrupted slot at the spec's address."""
    kk = pytest.importorskip("kvmap.kv.kernels")
    table, idx, n, nc, qsl, pos, want = _case(2)
    tokens = np.zeros((table.shape[0], table.shape[1] * BS), np.int32)
    bits = np.zeros((2, int(table.max() + 1) * BS, 4), np.uint16)
    written = np.zeros(bits.shape[1], bool)
    mask = np.uint64(0xFFFF)
    ids = tokens[np.repeat(idx, n), pos]
    kk.kv_write(ids, pos, np.array(want, np.int64), bits, mask, written)
    bits[0, want[3], 0] ^= 1  # corrupt the 4th token's slot
    bad = np.zeros((4, 3), np.int64)
    seq = (nc + n).astype(np.int32)
    checked, mismatches = kk.kv_verify(idx, nc.astype(np.int64), seq, tokens, table, BS, bits, mask, bad)
    assert (checked, mismatches) == (len(pos), 1) and bad[0, 2] == want[3]


# ---------------------------------------------------------------- multi-rank: DCP, kernel blocks, state groups

DCP_CASES = [(2, 1), (2, 4), (4, 8), (2, 16), (4, 1)]  # (cp, interleave), interleave divides BS


def _dcp_case(cp, seed=0, rows=6, width=6, nreq=4):
    """Rows of block ids spanning BS * cp positions each."""
    rng = np.random.default_rng(seed)
    vbs = BS * cp
    table = rng.permutation(rows * width * 3)[: rows * width].astype(np.int32).reshape(rows, width)
    idx = rng.choice(rows, nreq, replace=False).astype(np.int32)
    n = rng.integers(1, 50, nreq).astype(np.int32)
    nc = rng.integers(0, width * vbs - 50, nreq).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    pos = np.concatenate([np.arange(a, a + m) for a, m in zip(nc, n)]).astype(np.int64)
    return table, idx, n, nc, qsl, pos


def _spec_slots(lay, table, idx, n, nc):
    return [lay.slot(table[idx[b]].tolist(), int(p)) for b in range(len(idx)) for p in range(nc[b], nc[b] + n[b])]


@pytest.mark.parametrize("cp,I", DCP_CASES)
def test_dcp_spec_properties(cp, I):
    """Every token local on exactly one rank; a rank's local tokens fill its blocks densely, no two share a
    slot; the local lengths sum to seq_len and count the local tokens."""
    lays = [GroupLayout(BS, cp_size=cp, cp_rank=r, interleave=I) for r in range(cp)]
    row = [5, 2, 9, 4]
    L = len(row) * BS * cp
    seen = [set() for _ in lays]
    for p in range(L):
        owners = [r for r, lay in enumerate(lays) if lay.slot(row, p) != PAD_SLOT_ID]
        assert len(owners) == 1
        s = lays[owners[0]].slot(row, p)
        assert s not in seen[owners[0]] and s // BS == row[p // (BS * cp)]
        seen[owners[0]].add(s)
    assert all(len(x) == len(row) * BS for x in seen)  # every rank's blocks are full
    for seq_len in range(L + 1):
        locs = [lay.dcp_local_seq_len(seq_len) for lay in lays]
        assert sum(locs) == seq_len
        assert locs == [sum(lay.is_local(p) for p in range(seq_len)) for lay in lays]


def test_dcp_worked_numbers():
    """vllm#51031's configuration: block 64, kernel 16, cp 2, interleave 32: a block id spans 128 positions."""
    lays = [GroupLayout(64, kernel_block_size=16, cp_size=2, cp_rank=r, interleave=32) for r in range(2)]
    row = [7, 3]
    # position 200: vb 200 // 128 = 1, off 72; (72 // 32) % 2 = 0 -> rank 0; local 72 // 64 * 32 + 72 % 32 = 40
    assert [lay.slot(row, 200) for lay in lays] == [3 * 64 + 40, PAD_SLOT_ID]
    krow = lays[0].kernel_row(row)
    assert krow == [28, 29, 30, 31, 12, 13, 14, 15]
    # local position 1 * 64 + 40 = 104 -> kernel block 104 // 16 = 6 (id 14), offset 8: 14 * 16 + 8 = 232
    assert lays[0].kernel_slot(krow, 200) == 14 * 16 + 8 == 3 * 64 + 40
    # the vllm#51031 mistake: the virtual block from the kernel block size (16 * 2 = 32) picks entry 6
    assert 200 // (16 * 2) != 200 // (64 * 2)
    assert [lay.dcp_local_seq_len(200) for lay in lays] == [64 + 40, 32 + 32 + 32]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("cp,I", [(1, 1)] + DCP_CASES[:3])
def test_kernel_slot_equals_slot(cp, I, k):
    for r in range(cp):
        lay = GroupLayout(BS, kernel_block_size=BS // k, cp_size=cp, cp_rank=r, interleave=I)
        row = [11, 3, 8]
        krow = lay.kernel_row(row)
        assert len(krow) == 3 * k
        assert lay.kernel_rows(np.array([row])).tolist() == [krow]
        for p in range(3 * BS * cp):
            assert lay.kernel_slot(krow, p) == lay.slot(row, p)


@pytest.mark.parametrize("cp,I", DCP_CASES)
def test_dcp_vectorized_forms_equal_the_spec(cp, I):
    table, idx, n, nc, qsl, pos, = _dcp_case(cp, seed=cp * 10 + I)
    rows = np.repeat(idx, n)
    seq = (nc + n).astype(np.int32)
    for r in range(cp):
        lay = GroupLayout(BS, cp_size=cp, cp_rank=r, interleave=I)
        want = _spec_slots(lay, table, idx, n, nc)
        assert lay.slots(table[rows, pos // (BS * cp)], pos).tolist() == want
        assert lay.local_mask(pos).tolist() == [lay.is_local(int(p)) for p in pos]
        assert lay.dcp_local_seq_lens(seq).tolist() == [lay.dcp_local_seq_len(int(s)) for s in seq]


@pytest.mark.parametrize("cp,I", DCP_CASES)
def test_dcp_numba_form_equals_the_spec(cp, I):
    kc = pytest.importorskip("kvmap.workers.kernels_cpu")
    table, idx, n, nc, qsl, pos = _dcp_case(cp, seed=cp + I)
    seq = (nc + n).astype(np.int32)
    for r in range(cp):
        lay = GroupLayout(BS, cp_size=cp, cp_rank=r, interleave=I)
        out = np.full(len(pos), -7, np.int64)
        kc.slot_mapping_dcp(idx, n, nc, table, BS, cp, r, I, True, out)
        assert out.tolist() == _spec_slots(lay, table, idx, n, nc)
        lens = np.zeros(len(seq), np.int32)
        kc.dcp_local_seq_lens(seq, cp, r, I, lens)
        assert lens.tolist() == [lay.dcp_local_seq_len(int(s)) for s in seq]
    out = np.full(len(pos), -7, np.int64)
    kc.slot_mapping_dcp(idx, n, nc, table, BS, cp, 0, I, False, out)  # a state group
    assert (out == PAD_SLOT_ID).all()


def test_dcp_triton_form_equals_the_spec():
    torch, dev = _triton_device()
    from kvmap.workers.triton_worker import BLOCK, _slot_mapping_dcp_kernel

    cp, I = 4, 8
    table, idx, n, nc, qsl, pos = _dcp_case(cp, seed=3)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    T = len(pos)
    tab = t(table)
    for r in (0, 3):
        out = torch.full((T + 3,), 99, dtype=torch.int64, device=dev)
        _slot_mapping_dcp_kernel[(len(idx) + 1,)](t(idx.astype(np.int64)), t(n), t(qsl), t(nc), tab, tab.stride(0),
                                                  BS, cp, r, I, out, len(idx), T, T + 3, BLOCK=BLOCK)
        got = out.cpu().numpy().tolist()
        want = _spec_slots(GroupLayout(BS, cp_size=cp, cp_rank=r, interleave=I), table, idx, n, nc)
        assert got[:T] == want and got[T:] == [PAD_SLOT_ID] * 3


def test_replicated_and_state_groups():
    """A group with dcp_sharded false sees cp = 1 on every rank; a state group has no slots."""
    from kvmap.trace.records import KVCacheGroup

    g = KVCacheGroup(0, "full_attention", BS, dcp_sharded=False)
    lay = GroupLayout.of(g, cp_size=2, cp_rank=1, interleave=4)
    assert (lay.cp_size, lay.virtual_block_size, lay.slot([3], 5)) == (1, BS, 3 * BS + 5)
    m = GroupLayout.of(KVCacheGroup(1, "mamba", 256, uses_slot_mapping=False), cp_size=2, cp_rank=0)
    assert m.slot([4], 0) == PAD_SLOT_ID and not m.has_slots
    assert (m.slots(np.array([4, 4]), np.array([0, 1])) == PAD_SLOT_ID).all()


@pytest.mark.parametrize("cp,I", DCP_CASES[:3])
def test_dcp_kv_read_back_slot_equals_the_spec(cp, I):
    """The compiled per-rank read-back reads only the rank's positions, at the spec's slot."""
    kk = pytest.importorskip("kvmap.kv.kernels")
    table, idx, n, nc, qsl, pos = _dcp_case(cp, seed=7)
    tokens = np.zeros((table.shape[0], table.shape[1] * BS * cp), np.int32)
    mask = np.uint64(0xFFFF)
    for r in range(cp):
        lay = GroupLayout(BS, cp_size=cp, cp_rank=r, interleave=I)
        want = np.array(_spec_slots(lay, table, idx, n, nc), np.int64)
        bits = np.zeros((2, int(table.max() + 1) * BS, 4), np.uint16)
        written = np.zeros(bits.shape[1], bool)
        kk.kv_write(tokens[np.repeat(idx, n), pos], pos, want, bits, mask, written)
        local = np.flatnonzero(want >= 0)
        bits[0, want[local[2]], 0] ^= 1  # corrupt the third local token's slot
        bad = np.zeros((4, 3), np.int64)
        checked, mismatches = kk.kv_verify_dcp(idx, nc.astype(np.int64), (nc + n).astype(np.int32), tokens, table,
                                               BS, cp, r, I, bits, mask, bad)
        assert (checked, mismatches) == (len(local), 1) and bad[0, 2] == want[local[2]]
