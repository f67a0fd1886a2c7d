"""The address arithmetic has one spec (`GroupLayout.slot`, plain integers); the slot rule's one form per
language (numpy `GroupLayout.slots`, numba `slot_of`, torch `slots`, Triton `_slots`), each through every
kernel that calls it, and the read-back window, are held to it: cp = 1, DCP with interleave, a kernel split,
the read-back."""

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
    """docs/trace-format.md's per-rank rule: cp 2, interleave 4, block 16: a block id spans 32 positions."""
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


# ---------------------------------------------------------------- the one form per language, held to the spec
# Each form is checked on the same batches: cp = 1 and DCP with interleave (CASES), a kernel split (the kernel
# row's slot equals the manager row's), and its read-back. Worked values first, as arithmetic.

CASES = [(1, 1), (2, 1), (2, 4), (4, 8), (2, 16), (4, 1)]  # (cp, interleave), interleave divides BS
WORKED = [  # (layout, row, position, slot)
    (GroupLayout(BS), [37, 12], 31, 12 * 16 + 15),
    (GroupLayout(BS, cp_size=2, cp_rank=1, interleave=4), [7, 9], 37, 9 * 16 + 1),  # vb 1, off 5, local 1
    (GroupLayout(BS, cp_size=2, cp_rank=0, interleave=4), [7, 9], 37, PAD_SLOT_ID),
    (GroupLayout(64, kernel_block_size=16, cp_size=2, cp_rank=0, interleave=32), [7, 3], 200, 3 * 64 + 40),
]


def _case(cp=1, seed=0, rows=6, width=6, nreq=4):
    """A persistent table of rows of block ids spanning BS * cp positions each, and a batch over it."""
    rng = np.random.default_rng(seed)
    table = rng.permutation(rows * width * 3)[: rows * width].astype(np.int32).reshape(rows, width)
    idx = rng.choice(rows, nreq, replace=False).astype(np.int32)
    n = rng.integers(1, 50, nreq).astype(np.int32)
    nc = rng.integers(0, width * BS * cp - 50, nreq).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    pos = np.concatenate([np.arange(a, a + m) for a, m in zip(nc, n)]).astype(np.int64)
    return table, idx, n, nc, qsl, pos


def _spec_slots(lay, table, idx, n, nc):
    """The spec, token by token; through the kernel row too when the layout splits blocks."""
    want = [lay.slot(table[idx[b]].tolist(), int(p)) for b in range(len(idx)) for p in range(nc[b], nc[b] + n[b])]
    if lay.kernel_blocks_per_block > 1:
        krows = [lay.kernel_row(table[idx[b]].tolist()) for b in range(len(idx))]
        assert want == [lay.kernel_slot(krows[b], int(p)) for b in range(len(idx)) for p in range(nc[b], nc[b] + n[b])]
    return want


def _layouts(cp, I):
    """Every rank's layout, and a kernel split (k = 4) of each."""
    return [GroupLayout(BS, kernel_block_size=kbs, cp_size=cp, cp_rank=r, interleave=I)
            for r in range(cp) for kbs in (None, BS // 4)]


def _read_back_case(lay, table, idx, n, nc, pos, tokens):
    """A cache written at the spec's slots with the 3rd local token's slot corrupted: (bits, want, local)."""
    kk = pytest.importorskip("kvmap.kv.kernels")
    want = np.array(_spec_slots(lay, table, idx, n, nc), np.int64)
    bits = np.zeros((2, int(table.max() + 1) * BS, 4), np.uint16)
    kk.kv_write(tokens[np.repeat(idx, n), pos], pos, want, bits, np.uint64(0xFFFF), np.zeros(bits.shape[1], bool))
    local = np.flatnonzero(want >= 0)
    bits[0, want[local[2]], 0] ^= 1
    return bits, want, local


def test_numpy_form_equals_the_spec():
    """`GroupLayout.slots`, as the numpy worker calls it: cp = 1 (power-of-two and not), DCP, the read-back."""
    from types import SimpleNamespace

    from kvmap.workers import buffers

    for lay, row, p, slot in WORKED:
        assert lay.slots(np.array([row[lay.block_of(p)[0]]]), np.array([p])).tolist() == [slot]
    assert GroupLayout(12).slots(np.array([5], np.int32), np.array([7]), np.zeros(1, np.int64),
                                 np.zeros(1, np.int64)).tolist() == [5 * 12 + 7]
    for cp, I in CASES:
        table, idx, n, nc, qsl, pos = _case(cp, seed=cp * 10 + I)
        lays = _layouts(cp, I)
        T, B = len(pos), len(idx)
        state = SimpleNamespace(block_tables=[table])
        buf = SimpleNamespace(idx_mapping=idx, num_scheduled_tokens=n, positions=pos, layouts=lays[:1],
                              tmp_tok=np.zeros(T, np.int64), tmp_tok2=np.zeros(T, np.int64),
                              tmp_blk=np.zeros(T, np.int32), tmp_req=np.zeros(B, np.int64),
                              slot_mapping=np.full((1, T), -7, np.int64),
                              rank_slot_mapping=np.full((len(lays), 1, T), -7, np.int64))
        if cp == 1:
            buffers.compute_slot_mappings(state, buf, B, T)
            assert buf.slot_mapping[0].tolist() == _spec_slots(lays[0], table, idx, n, nc)
        buffers.compute_rank_slot_mappings(state, buf, [[lay] for lay in lays], B, T)
        for i, lay in enumerate(lays):
            want = _spec_slots(lay, table, idx, n, nc)
            assert buf.rank_slot_mapping[i, 0].tolist() == want
            assert lay.slots(table[np.repeat(idx, n), pos // lay.virtual_block_size], pos).tolist() == want


def test_numba_form_equals_the_spec():
    """`slot_of` and the three kernels that call it: cp = 1 slot mapping, DCP slot mapping, read-back."""
    kk = pytest.importorskip("kvmap.kv.kernels")
    kc = pytest.importorskip("kvmap.workers.kernels_cpu")
    for lay, row, p, slot in WORKED:
        assert kk.slot_of(np.array(row, np.int32), p, lay.block_size, lay.cp_size, lay.cp_rank, lay.interleave) == slot
    for cp, I in CASES:
        table, idx, n, nc, qsl, pos = _case(cp, seed=cp + I)
        tokens = np.arange(table.shape[0] * table.shape[1] * BS * cp, dtype=np.int32).reshape(table.shape[0], -1)
        for lay in _layouts(cp, I):
            want = _spec_slots(lay, table, idx, n, nc)
            out = np.full(len(pos), -7, np.int64)
            kc.slot_mapping_dcp(idx, n, nc, table, BS, cp, lay.cp_rank, I, True, out)
            assert out.tolist() == want
            if cp == 1:
                kc.slot_mapping(idx, n, nc, table, BS, out)
                assert out.tolist() == want
            bits, want, local = _read_back_case(lay, table, idx, n, nc, pos, tokens)
            bad = np.zeros((4, 3), np.int64)
            got = kk.kv_verify_dcp(idx, nc.astype(np.int64), (nc + n).astype(np.int32), tokens, table, BS, cp,
                                   lay.cp_rank, I, bits, np.uint64(0xFFFF), bad)
            assert got == (len(local), 1) and bad[0, 2] == want[local[2]]
        out = np.full(len(pos), -7, np.int64)
        kc.slot_mapping_dcp(idx, n, nc, table, BS, cp, 0, I, False, out)  # a state group
        assert (out == PAD_SLOT_ID).all()


def test_torch_form_equals_the_spec():
    """`torch_worker.slots`, which the torch worker's cp = 1, DCP and read-back paths call."""
    torch = pytest.importorskip("torch")
    from kvmap.workers.torch_worker import slots

    for lay, row, p, slot in WORKED:
        got = slots(torch.tensor([row], dtype=torch.int32), torch.tensor([0]), torch.tensor([p]), lay)
        assert got.tolist() == [slot]
    for cp, I in CASES:
        table, idx, n, nc, qsl, pos = _case(cp, seed=cp * 3 + I)
        rows = torch.from_numpy(np.repeat(idx, n).astype(np.int64))
        for lay in _layouts(cp, I):
            out = torch.full((len(pos),), -7, dtype=torch.int64)
            slots(torch.from_numpy(table), rows, torch.from_numpy(pos), lay, out=out)
            assert out.tolist() == _spec_slots(lay, table, idx, n, nc)


def _triton_device():
    """(torch, device) for a Triton kernel test: CUDA, or CPU tensors under TRITON_INTERPRET=1; else skip."""
    pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    import os

    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET")):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    return torch, "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_form_equals_the_spec():
    """`_slots` through the slot mapping kernel (CP a constexpr branch; padding from the actual count) and the
    read-back kernel, which locates a corrupted slot."""
    torch, dev = _triton_device()
    from kvmap.workers.triton_worker import BLOCK, _kv_verify_kernel, _slot_mapping_kernel

    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    for cp, I in [(1, 1), (4, 8)]:
        table, idx, n, nc, qsl, pos = _case(cp, seed=3)
        T, tab = len(pos), t(table)
        for lay in _layouts(cp, I)[:: max(1, 2 * cp - 2)]:  # cp = 1 with and without a split; ranks 0 and 3
            out = torch.full((T + 3,), 99, dtype=torch.int64, device=dev)
            _slot_mapping_kernel[(len(idx) + 1,)](t(idx.astype(np.int64)), t(n), t(qsl), t(nc), tab, tab.stride(0),
                                                  BS, cp, lay.cp_rank, I, out, len(idx), T, T + 3, CP=cp > 1,
                                                  BLOCK=BLOCK)
            got = out.cpu().numpy().tolist()
            assert got[:T] == _spec_slots(lay, table, idx, n, nc) and got[T:] == [PAD_SLOT_ID] * 3
    table, idx, n, nc, qsl, pos = _case(1, seed=2)
    tokens = np.arange(table.shape[0] * table.shape[1] * BS, dtype=np.int32).reshape(table.shape[0], -1)
    bits, want, local = _read_back_case(GroupLayout(BS), table, idx, n, nc, pos, tokens)
    bits = t(bits.view(np.int16))
    bad, first = (torch.zeros(len(idx), dtype=dt, device=dev) for dt in (torch.int32, torch.int64))
    _kv_verify_kernel[(len(idx),)](t(idx.astype(np.int64)), t(nc.astype(np.int64)), t((nc + n).astype(np.int32)),
                                   t(tokens), tokens.shape[1], t(table), table.shape[1], BS, bits, bits.stride(0), bad,
                                   first, HALF=4, LANES=4, WIDTH=16, BLOCK=32)
    b = int(np.searchsorted(qsl, local[2], side="right")) - 1  # the request of the corrupted token
    assert bad.cpu().tolist() == [int(i == b) for i in range(len(idx))] and int(first[b]) == pos[local[2]]


# ---------------------------------------------------------------- multi-rank: DCP, kernel blocks, state groups

DCP_CASES = CASES[1:]


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


def test_replicated_and_state_groups():
    """A group with dcp_sharded false sees cp = 1 on every rank; a state group has no slots."""
    from kvmap.trace.records import KVCacheGroup

    g = KVCacheGroup(0, "full_attention", BS, dcp_sharded=False)
    lay = GroupLayout.of(g, cp_size=2, cp_rank=1, interleave=4)
    assert (lay.cp_size, lay.virtual_block_size, lay.slot([3], 5)) == (1, BS, 3 * BS + 5)
    m = GroupLayout.of(KVCacheGroup(1, "mamba", 256, uses_slot_mapping=False), cp_size=2, cp_rank=0)
    assert m.slot([4], 0) == PAD_SLOT_ID and not m.has_slots
    assert (m.slots(np.array([4, 4]), np.array([0, 1])) == PAD_SLOT_ID).all()


