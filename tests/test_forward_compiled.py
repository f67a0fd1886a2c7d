"""kvmap.forward's numba forms (forward/kernels.py, composed by forward/compiled.py for the numba worker) equal
their rules' scalar specs on fuzzed batches, as the numpy forms do (tests/test_forward.py); the kernels check
their bounds. The whole parts are held to the specs through the numba worker's dumps (test_forward_wired.py)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from kvmap.aot import load
from kvmap.forward import attention as fa
from kvmap.forward import compiled as nf
from kvmap.forward import cudagraph as cg
from kvmap.forward import flashinfer as fib
from kvmap.forward import padded_tails as pt
from kvmap.forward import sampler as S
from kvmap.layout import PAD_SLOT_ID

from .test_forward import _metadata, assert_equal, fuzz_modes, random_batch
from .test_forward_sampler import rows, same

pytest.importorskip("numba")
K = load("kvmap.forward.kernels")


def step_rows(qsl, computed, lens, idx, drafts, mrv2, m, up, rule=(-1, False), has_drafts=True):
    """kernels.step_rows over fresh buffers: (key, shape [4], sampler buffers, is_prefilling, split out)."""
    R, T = len(idx), int(qsl[-1])
    shape, sb = np.zeros(4, np.int64), nf.SamplerBuffers(SimpleNamespace(max_num_seqs=max(R, 1),
                                                                        num_speculative_tokens=max(T, 1)), T)
    pre, out = np.zeros(max(R, 1), bool), np.full(6, -7, np.int64)
    key = K.step_rows(qsl, computed, lens, idx, drafts, has_drafts, S.NUM_NEW_SAMPLED_TOKENS, mrv2, m, shape,
                      sb.cu_num_logits, sb.logits_indices, sb.expanded_idx_mapping, sb.expanded_local_pos, up,
                      rule[0], rule[1], pre, out)
    return key, shape, sb, pre[:R], out


@pytest.mark.parametrize("runner", ["mrv2", "v1"])
def test_shape_and_padded_tails_equal_the_specs_fuzzed(runner):
    for rng, k, mode in fuzz_modes(2601):
        q, computed, seq = random_batch(rng, 16, k)
        R, T = len(q), int(q.sum())
        qsl = np.zeros(R + 1, dtype=np.int32)
        np.cumsum(q, out=qsl[1:])
        idx = rng.permutation(20)[:R].astype(np.int32)
        prefill = rng.integers(0, 250, 20).astype(np.int32)
        drafts = np.minimum(rng.integers(0, k + 1, R), q - 1).astype(np.int32)
        key, shape = step_rows(qsl, computed, prefill, idx, drafts, runner == "mrv2", 5000, seq)[:2]
        pre = [int(prefill[j]) for j in idx]
        eligible = cg.decode_graph_eligible(q.tolist(), drafts.tolist(), np.minimum(computed, pre).tolist(), pre)
        e = int(eligible) if runner == "mrv2" else 1
        assert shape[:3].tolist() == [T, int(q.max()), e]
        assert key == ((R * 5000 + T) * 5000 + int(q.max())) * 2 + e
        sizes = cg.resolve_capture_sizes(runner, mode, None, 16, 4096, k)
        desc = cg.dispatch(runner, mode, sizes, 16, k, R, T, int(q.max()), eligible)
        slots = rng.integers(0, 10**6, (2, T)).astype(np.int64)
        positions = np.arange(T, dtype=np.int64) + 7
        spec = pt.pad_tails_spec(runner, desc, qsl, seq, slots, [], positions)
        Rp, Tp, n = desc.num_reqs_padded, desc.num_tokens_padded, spec.slot_mapping.shape[1]
        out = (np.zeros(Rp + 1, np.int32), np.zeros(Rp, np.int32), np.zeros((2, n), np.int64),
               np.zeros(Tp if runner == "v1" else 0, np.int64), np.zeros(Tp, bool))
        K.pad_tails(qsl, seq, slots, positions, R, T, Rp, Tp, n, PAD_SLOT_ID, *out)
        got = pt.PaddedTails(*out[:3], [], out[4], out[3] if runner == "v1" else None)
        assert_equal(got, spec)


@pytest.mark.parametrize("runner", ["mrv2", "v1"])
def test_common_metadata_and_split_equal_the_specs_fuzzed(runner):
    for rng, k, mode in fuzz_modes(2602):
        desc, cms = _metadata(rng, runner, mode, k, groups=1)
        cm, R = cms[0], desc.num_reqs
        # the rule's inputs again, per request row (the kernel reads them through idx_mapping)
        idx = np.arange(R, dtype=np.int32)[::-1].copy()
        computed = rng.integers(0, 200, R).astype(np.int32)
        prompt = rng.integers(0, 260, R).astype(np.int32)
        by_row = np.zeros(R, np.int32)
        by_row[idx] = prompt
        want = fa.common_metadata_spec(runner, desc, _tails(cm, desc), 0, computed, prompt)
        pre = np.zeros(cm.num_reqs if runner == "v1" else R, dtype=bool)
        out = np.zeros(6, dtype=np.int64)
        for t, u in ((1, False), (1, True), (1 + k, True), (128, True), (3, False)):
            K.common_split(cm.query_start_loc, cm.seq_lens, computed, by_row, idx, cm.num_reqs, cm.num_actual_tokens,
                           runner == "v1", t, u, pre, out)
            assert out[:2].tolist() == [want.max_query_len, want.max_seq_len]
            assert pre.tolist() == want.is_prefilling.tolist()
            sp = fa.split_decodes_and_prefills_spec(cm.query_start_loc, cm.num_reqs, cm.num_actual_tokens,
                                                    want.max_query_len, t, u)
            assert fa.Split(*out[2:].tolist()) == sp, (t, u)
            if not desc.pad_attn:  # step_rows' rule over the unpadded rows gives the same (NumbaForward.run)
                R0 = cm.num_reqs
                _, _, _, pre1, out1 = step_rows(cm.query_start_loc[: R0 + 1], computed, by_row, idx,
                                                np.zeros(R0, np.int32), runner == "mrv2", 5000, cm.seq_lens, (t, u))
                assert out1.tolist() == out.tolist() and pre1.tolist() == pre[:R0].tolist(), (t, u)


def _tails(cm, desc):
    """The padded tails a metadata was built from (the fields the rule reads)."""
    return pt.PaddedTails(cm.query_start_loc, cm.seq_lens, cm.slot_mapping[None], [cm.block_table_tensor], None, None)


@pytest.mark.parametrize("runner", ["mrv2", "v1"])
def test_flashinfer_numba_equals_the_spec_fuzzed(runner):
    buf = fib.NumbaBuffers(K)
    for rng, k, mode in fuzz_modes(2603):
        _, cms = _metadata(rng, runner, mode, k)
        cm = cms[0]
        for cp, rank, inter in ((1, 0, 1), (2, 1, 1), (4, 3, 8), (4, 0, 16)):
            sp = fa.split(cm, "FLASHINFER", k, cp, runner=runner)
            for fa2 in (False, True):
                if fa2 and sp.num_decodes and sp.num_decode_tokens % sp.num_decodes:
                    continue
                a = (cm, sp, 16, k, cp, rank, inter, fa2)
                assert_equal(fib.build_numba(buf, *a), fib.build_spec(*a))


def test_flashinfer_kernel_checks_its_bounds():
    """A row claiming more pages than its table row holds is an IndexError, not a read past the table."""
    kv = np.array([16 * 5 + 1], dtype=np.int32)  # 6 pages
    table = np.arange(5, dtype=np.int32).reshape(1, 5)
    with pytest.raises(IndexError):
        K.paged_kv(kv, table, 16, 1, np.zeros(2, np.int32), np.zeros(64, np.int32), np.zeros(1, np.int32))


def test_deferred_flashinfer_metadata_is_made_on_first_read():
    """The numba worker's attention and backends parts leave their objects to the first read (forward/deferred.py),
    over the worker's own core arrays (forward/core.py, the same as its mappings'):
    after prepare_forward the part is pending; an attribute read makes it once, and the values are the numpy
    worker's."""
    from kvmap.forward.core import from_mappings
    from kvmap.forward.deferred import Deferred
    from kvmap.run.config import ReplayConfig
    from kvmap.run.replay import replay
    from kvmap.trace import Trace
    from kvmap.workers.registry import make_worker

    from .conftest import TRACES

    trace = Trace(TRACES / "spec_decode.jsonl")
    cfg = ReplayConfig(forward=True, nvtx=False, warmup=0, write_kv=False, attention_backend="FLASHINFER",
                       cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes="default")
    want: list[dict] = []
    replay(trace, replace(cfg, backend="numpy"), on_mappings=want.append)
    w = make_worker("numba", trace.header)
    seen: list[int] = []

    def check(step: int) -> None:
        f = w.forward
        if not want[step]["req_ids"]:  # no request: no metadata, nothing deferred
            assert f.backends.metadata == [None]
            return
        assert type(f.parts["backends"]) is Deferred and type(f.parts["attention"]) is Deferred
        core, want_core = w.forward_step().core, from_mappings(w.mappings())  # the worker's arrays: the mappings'
        assert [np.array_equal(getattr(core, k), getattr(want_core, k)) for k in ("slot_mapping", "positions")] == [
            True, True] and core.rank == want_core.rank
        assert [t.tolist() for t in core.tables] == [t.tolist() for t in want_core.tables]
        md = f.backends.metadata[0]
        assert isinstance(md, fib.FlashInferMetadata) and f.backends is f.parts["backends"]
        assert md.paged_kv_indptr.tolist() == want[step]["paged_kv_indptr"][0]
        assert w.mappings_dict() == want[step]
        seen.append(step)

    replay(trace, cfg, worker=w, on_step=check)
    assert len(seen) == sum(1 for d in want if d["req_ids"]) > 0


def test_mrv2_sampler_numba_equals_the_spec_fuzzed():
    """The numba pass's MRV2 indices (kernels.step_rows, the object made by `SamplerBuffers.mrv2`) equal the
    spec's, with drafts and without (the fast path: one logit per request, the drafts array not read), through
    one set of buffers, step after step."""
    rng = np.random.default_rng(2602)
    cfg = SimpleNamespace(runner="mrv2", max_num_seqs=16, num_speculative_tokens=3)
    buf, shape = nf.SamplerBuffers(cfg, 16 * 8), np.zeros(4, np.int64)
    pre, no_split = np.zeros(16, bool), np.zeros(0, np.int64)
    for i in range(200):
        R = int(rng.integers(0, 17))
        d = rng.integers(0, 4, R) if i % 2 else np.zeros(R, np.int64)
        qs = d + rng.integers(1, 5, R)
        r, _ = rows(qs.tolist(), [10] * R, d.tolist(), [20] * R, idx=rng.permutation(16)[:R].tolist())
        r = replace(r, has_drafts=bool(i % 2))
        K.step_rows(r.query_start_loc, r.num_computed_tokens, r.prefill_len, r.idx_mapping, r.num_draft_tokens,
                    r.has_drafts, S.NUM_NEW_SAMPLED_TOKENS, True, 5000, shape, buf.cu_num_logits,
                    buf.logits_indices, buf.expanded_idx_mapping, buf.expanded_local_pos, r.seq_lens, -1, False,
                    pre, no_split)
        same(buf.mrv2(R, int(shape[3])), S.mrv2_spec(r))


def test_shape_key_bounds_are_checked_at_the_boundary():
    """The dispatch answers are remembered by one int key (kernels.step_shape): limits whose key would not fit
    in 63 bits are a located error, not a silent collision."""
    from kvmap.errors import KvmapError
    from kvmap.forward.config import ForwardConfig, GroupForward

    cfg = ForwardConfig("mrv2", "NONE", (), (GroupForward("full_attention", 16, 16, None, None, None),), 256,
                        2048, 4096, 0, 1)
    assert nf.PaddingBuffers(cfg, 2048).m == 2048 + 1
    with pytest.raises(KvmapError, match="too large"):
        nf.PaddingBuffers(cfg, 2**31)


def test_forward_parts_script_times_the_one_pass():
    """scripts/forward_parts.py (docs/performance.md's per-piece figures) runs against the numba worker's one
    pass and the numpy forms, and names each kernel it timed with its count of calls."""
    import subprocess
    import sys

    from .conftest import ROOT

    def run(*args: str) -> str:
        cmd = [sys.executable, str(ROOT / "scripts/forward_parts.py"), "--trace",
               str(ROOT / "traces/spec_decode.jsonl"), "--warmup", "0", *args]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        return res.stdout

    out = run("--cudagraph-mode", "FULL_AND_PIECEWISE", "--attention-backend", "FLASHINFER")
    assert "NumbaForward.run" in out and "prepare_forward" in out
    calls = {line.split()[0]: line for line in out.splitlines() if "calls)" in line}
    assert {"step_rows", "pad_tails", "paged_kv"} <= set(calls), out
    assert "sampler" in run("--backend", "numpy")
