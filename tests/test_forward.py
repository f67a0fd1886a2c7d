"""kvmap.forward: each rule's numpy form equals its scalar spec on fuzzed batches (padding rows, q = 0 rows,
DCP), and the worked examples of the issue 26 forward-pass notes hold with their arithmetic visible. vLLM
itself checks these rules in tests/test_forward_metadata_against_vllm.py (record environment)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmap.forward import attention as fa
from kvmap.forward import cudagraph as cg
from kvmap.forward import flash_attn as fab
from kvmap.forward import flashinfer as fib
from kvmap.forward import local_attention as la
from kvmap.forward import padded_tails as pt

MODES = list(cg.MODES)


def random_batch(rng, max_num_seqs=16, k=0):
    """A batch in decode -> extend -> prefill order (scheduled rows have q >= 1; q = 0 rows come from padding)."""
    R = int(rng.integers(1, max_num_seqs + 1))
    kind = rng.integers(0, 3)
    if kind == 0:  # uniform decode
        q = np.full(R, 1 + k)
    elif kind == 1:  # mixed
        q = np.sort(rng.integers(1, 40, R))
    else:  # mostly decodes, a few short extends
        q = np.sort(rng.integers(1, 4, R))
    computed = rng.integers(0, 200, R) * (rng.random(R) < 0.8)
    seq = (computed + q).astype(np.int32)
    return q.astype(np.int32), computed.astype(np.int32), seq


def fuzz_modes(seed: int, n: int = 150):
    """(rng, k, mode) per fuzzed case: k drafts in 0..2 drawn first, the four FULL-graph modes in turn."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield rng, int(rng.integers(0, 3)), ("NONE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL")[i % 4]


def test_default_capture_sizes_arithmetic():
    assert cg.default_capture_sizes(256, 8192) == [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 512 + 1, 16))
    # k = 2: decode sizes n * 3 for n in 1, 2, 4, 8 .. 120, 128, within min(128 * 3 * 2, 512) = 512
    sizes = cg.default_capture_sizes(128, 2048, 2)
    assert sizes[-1] == 512 and {1 * 3, 2 * 3, 4 * 3, 128 * 3} <= set(sizes)
    assert cg.adjust_sizes_for_spec_decode([1, 2, 4, 8, 16], 4) == [4, 8, 16]


def test_dispatch_worked_examples():
    """The forward-pass notes' probes (sections 4.2, 4.3)."""
    sizes = cg.default_capture_sizes(256, 8192)
    v1 = cg.Dispatcher("v1", "FULL_AND_PIECEWISE", sizes, 256, 0)
    assert v1.dispatch(3, 3, 1) == cg.BatchDescriptor("FULL", 3, 3, 4, 4, True)
    assert v1.dispatch(17, 17, 1) == cg.BatchDescriptor("FULL", 17, 17, 24, 24, True)
    assert v1.dispatch(3, 17, 15).cudagraph_mode == "PIECEWISE"
    assert v1.dispatch(3, 513, 500) == cg.BatchDescriptor("NONE", 513, 3, 513, 3, False)
    mrv2 = cg.Dispatcher("mrv2", "FULL_AND_PIECEWISE", cg.default_capture_sizes(128, 2048, 3), 128, 3)
    # 5 requests of 1 + 3 tokens: the decode graph of round_up(24, 4) = 24 tokens holds 24 // 4 = 6 requests
    assert mrv2.dispatch(5, 20, 4) == cg.BatchDescriptor("FULL", 20, 5, 24, 6, True)
    # the same shape from prompt chunks (not decode_graph_eligible) gets the piecewise graph, no request padding
    assert mrv2.dispatch(5, 20, 4, decode_eligible=False) == cg.BatchDescriptor("PIECEWISE", 20, 5, 24, 5, False)


@pytest.mark.parametrize("runner", ["mrv2", "v1"])
def test_dispatch_numpy_equals_spec_fuzzed(runner):
    rng = np.random.default_rng(26)
    for _ in range(60):
        k = int(rng.integers(0, 4))
        max_num_seqs = int(rng.integers(1, 40))
        mode = MODES[int(rng.integers(0, len(MODES)))]
        user = sorted(set(rng.integers(1, 300, int(rng.integers(1, 12))).tolist())) if rng.random() < 0.5 else None
        sizes = cg.resolve_capture_sizes(runner, mode, user, max_num_seqs, 4096, k)
        d = cg.Dispatcher(runner, mode, sizes, max_num_seqs, k)
        R = rng.integers(1, max_num_seqs + 1, 200)
        Q = np.where(rng.random(200) < 0.5, 1 + k, rng.integers(1, 30, 200))
        T = np.where(rng.random(200) < 0.6, R * Q, R + rng.integers(0, 400, 200))
        Q = np.minimum(Q, T)
        E = rng.random(200) < 0.7
        for i in range(200):
            args = (int(R[i]), int(T[i]), int(Q[i]), bool(E[i]))
            want = cg.dispatch_spec(runner, mode, sizes, max_num_seqs, k, *args)
            assert d.dispatch(*args) == want, (runner, mode, sizes, max_num_seqs, k, args)


def _metadata(rng, runner, mode="FULL_AND_PIECEWISE", k=0, groups=2, max_num_seqs=16):
    q, computed, seq = random_batch(rng, max_num_seqs, k)
    R, T = len(q), int(q.sum())
    qsl = np.zeros(R + 1, dtype=np.int32)
    np.cumsum(q, out=qsl[1:])
    tables = [rng.integers(1, 1000, (R, 20)).astype(np.int32) for _ in range(groups)]
    slots = rng.integers(0, 10**6, (groups, T)).astype(np.int64)
    positions = np.arange(T, dtype=np.int64)
    sizes = cg.resolve_capture_sizes(runner, mode, None, max_num_seqs, 4096, k)
    desc = cg.dispatch(runner, mode, sizes, max_num_seqs, k, R, T, int(q.max()))
    tails = pt.pad_tails(runner, desc, qsl, seq, slots, tables, positions)
    spec = pt.pad_tails_spec(runner, desc, qsl, seq, slots, tables, positions)
    for f in ("query_start_loc", "seq_lens", "slot_mapping", "is_padding", "positions"):
        a, b = getattr(tails, f), getattr(spec, f)
        assert (a is None and b is None) or (a.dtype == b.dtype and a.shape == b.shape and (a == b).all()), f
    assert all((a == b).all() and a.dtype == b.dtype for a, b in zip(tails.block_tables, spec.block_tables))
    prompt = (computed + rng.integers(-5, 60, R)).astype(np.int32)
    cms = [fa.common_metadata(runner, desc, tails, g, computed, prompt) for g in range(groups)]
    for g, cm in enumerate(cms):
        assert_equal(cm, fa.common_metadata_spec(runner, desc, tails, g, computed, prompt))
    return desc, cms


def assert_equal(a, b):
    for f in a.__slots__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and (x == y).all(), f
        elif hasattr(x, "__slots__"):
            assert_equal(x, y)
        else:
            assert x == y, (f, x, y)


@pytest.mark.parametrize("runner", ["mrv2", "v1"])
def test_metadata_numpy_equals_spec_fuzzed(runner):
    for rng, k, mode in fuzz_modes(260):
        _, cms = _metadata(rng, runner, mode, k)
        cm = cms[0]
        for t, u in ((1, False), (1, True), (1 + k, True), (128, True), (3, False)):
            args = (cm.query_start_loc, cm.num_reqs, cm.num_actual_tokens, cm.max_query_len, t, u)
            assert fa.split_decodes_and_prefills(*args) == fa.split_decodes_and_prefills_spec(*args)
        args = (cm.query_start_loc, cm.seq_lens_cpu_upper_bound, cm.num_reqs, cm.num_actual_tokens,
                cm.max_query_len, 1 + k)
        assert fa.split_decodes_prefills_and_extends(*args) == fa.split_decodes_prefills_and_extends_spec(*args)
        for cp, rank, inter in ((1, 0, 1), (2, 1, 1), (4, 3, 8), (4, 0, 16)):
            sp = fa.split(cm, "FLASHINFER", k, cp, runner=runner)
            for fa2 in (False, True):
                if fa2 and sp.num_decodes and sp.num_decode_tokens % sp.num_decodes:
                    continue
                a = (cm, sp, 16, k, cp, rank, inter, fa2)
                assert_equal(fib.build(*a), fib.build_spec(*a))
            a = (cm, "FULL_AND_PIECEWISE", 512, 3, cp, rank, inter)
            assert_equal(fab.build(*a), fab.build_spec(*a))
        for chunk in (16, 32, 64):
            assert_equal(la.virtual_batches(cm, chunk, 16), la.virtual_batches_spec(cm, chunk, 16))


def test_flashinfer_worked_example():
    """The forward-pass notes, section 6.2: seq_lens [33, 20, 53, 40], q [1, 1, 5, 16], page 16."""
    seq = np.array([33, 20, 53, 40], dtype=np.int32)
    table = np.array([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9], [10, 11, 12, 0]], dtype=np.int32)
    qsl = np.array([0, 1, 1 + 1, 2 + 5, 7 + 16], dtype=np.int32)
    cm = fa.CommonAttentionMetadata(qsl, seq, 4, 23, 16, 53, table, np.zeros(23, np.int64), np.zeros(4, bool), seq)
    sp = fa.split(cm, "FLASHINFER")
    assert sp == fa.Split(2, 2, 2, 5 + 16)
    md = fib.build(cm, sp, 16)
    assert md.paged_kv_indptr.tolist() == [0, 3, 3 + 2, 3 + 2 + 4, 3 + 2 + 4 + 3]
    assert md.paged_kv_last_page_len.tolist() == [33 - 2 * 16, 20 - 16, 53 - 3 * 16, 40 - 2 * 16]
    assert md.paged_kv_indices.tolist() == list(range(1, 13))
    assert md.prefill.qo_indptr.tolist() == [0, 5, 21] and md.prefill.paged_kv_indptr.tolist() == [5, 9, 12]
    assert md.decode.indptr.tolist() == [0, 3, 5] and md.decode.seq_lens.tolist() == [33, 20]


def test_local_worked_example():
    """vLLM's docstring example: chunk 4, block 2, q [4, 10, 5], k [6, 17, 9]."""
    qsl = np.array([0, 4, 14, 19], dtype=np.int32)
    seq = np.array([6, 17, 9], dtype=np.int32)
    table = np.arange(30, dtype=np.int32).reshape(3, 10)
    cm = fa.CommonAttentionMetadata(qsl, seq, 3, 19, 10, 17, table, np.zeros(19, np.int64), None, seq)
    v = la.virtual_batches(cm, 4, 2)
    assert v.query_start_loc.tolist() == [0, 2, 4, 5, 9, 13, 14, 18, 19]
    assert v.seq_lens.tolist() == [4, 2, 4, 4, 4, 1, 4, 1]
    assert v.block_table_tensor.tolist() == [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23],
                                             [24, 25]]


def test_thresholds():
    assert fa.reorder_batch_threshold("FLASH_ATTN", 3) is None
    assert fa.reorder_batch_threshold("FLASHINFER", 3) == 1
    assert fa.reorder_batch_threshold("FLASHINFER", 3, flashinfer_decode="xqa") == 1 + 3
    assert fa.reorder_batch_threshold("FLASHMLA", 3) == 128 and fa.require_uniform("FLASHMLA")
    assert fa.reorder_batch_threshold("FLASHMLA", 3, dcp_size=2) == 1
    assert fa.reorder_batch_threshold("FLASHINFER_MLA", 3, dcp_size=2) == 1 + 3
    assert fa.reorder_batch_threshold("TRITON_MLA", 2, runner="v1", parallel_drafting=True) == 1 + 2 * 2
    with pytest.raises(ValueError, match="unknown attention backend"):
        fa.reorder_batch_threshold("NOPE")


@pytest.mark.parametrize("backend", ["reference", "numpy", "numba"])
def test_mrv2_upper_bound_adds_the_async_spec_correction(backend):
    """Model Runner V2 keeps the scheduler's optimistic num_computed_tokens on the host, so under async spec
    decode `seq_lens_cpu_upper_bound` (and `max_seq_len`, its maximum) is seq_lens + the step's
    num_computed_tokens_correction of each row (vllm/v1/worker/gpu/model_runner.py 1271-1278, 1534-1541); V1
    corrects its own first: there the bound is seq_lens. Checked in every form on async_spec_decode.jsonl."""
    from kvmap.run.config import ReplayConfig
    from kvmap.run.replay import replay
    from kvmap.trace import Trace

    from .conftest import TRACES

    trace = Trace(TRACES / "async_spec_decode.jsonl")
    corr = {s.step: s.async_spec.num_computed_tokens_correction for s in trace.steps() if s.async_spec}
    seen = 0
    for runner in ("mrv2", "v1"):
        got = []
        replay(trace, ReplayConfig(backend=backend, nvtx=False, warmup=0, forward=True, batch_order=runner),
               on_mappings=got.append)
        for d in got:
            c = corr.get(d["step"]) or {}
            extra = [c.get(r, 0) if runner == "mrv2" else 0 for r in d["req_ids"]]
            if d["req_ids"]:
                assert d["max_seq_len"] == max(s + e for s, e in zip(d["seq_lens"], extra)), (runner, d["step"])
                seen += runner == "mrv2" and d["max_seq_len"] > max(d["seq_lens"])
    assert seen >= 5  # steps where the optimistic bound is the larger
