"""kvmap.forward equals vLLM 0.33's own code, step by step, on every bundled trace and both runners.

Each trace is replayed by the numpy worker in the runner's batch order (the long trace: its first LONG_STEPS
steps); each step's mappings, with the requests' prompt/prefill lengths and draft counts read from the trace,
feed both kvmap.forward and vLLM's own functions (stand-ins made with `object.__new__` where a constructor needs
a GPU; no vLLM rule is copied into the test):
- capture sizes: `VllmConfig._set_cudagraph_sizes` (+ V1's `adjust_cudagraph_sizes_for_spec_decode`);
- dispatch, in five cudagraph modes with the default sizes: V1 `CudagraphDispatcher` after
  `GPUModelRunner._is_uniform_decode`; MRV2 `CudaGraphManager._init_candidates` + `dispatch_cg_and_sync_dp`
  after MRV2's own `gather_batch_req_state` (its batch order, is_prefilling, uniform token count); fuzzed too;
- DP padding: MRV2 `dispatch_cg_and_sync_dp` (all-reduce replaced by the ranks' columns), V1
  `_determine_batch_execution_and_padding` (`_run_ar` replaced likewise);
- CommonAttentionMetadata: V1 `_build_attention_metadata` (stale padded rows in its buffers), MRV2
  `DefaultModelState.prepare_attn` + `build_attn_metadata`, in eager, FULL_AND_PIECEWISE and FULL_DECODE_ONLY;
- `split_decodes_and_prefills` (five backends' thresholds), `split_decodes_prefills_and_extends`;
- `FlashInferMetadataBuilder.build` (native paths, plan() recorded; DCP on every rank);
- `FlashAttentionMetadataBuilder.build` (`aot_schedule=False`: all but FA3's scheduler_metadata);
- `make_local_attention_virtual_batches` (chunked_local groups, then FlashAttention's build).
Runs where vLLM is installed (CI's record environment, with flashinfer-python); skipped elsewhere. vLLM is
imported once per module.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

import numpy as np
import pytest

from kvmap.forward import attention as fa
from kvmap.forward import cudagraph as cg
from kvmap.forward import dp_padding as dpp
from kvmap.forward import padded_tails as pt
from kvmap.trace import Trace
from kvmap.workers import vllm_forward as vf
from kvmap.workers.vllm_forward import RecordGroup, mrv2_prepare_attn, rebind, vllm_cm

from .conftest import TRACES, bundled_traces

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
TRACE_NAMES = [p.name for p in bundled_traces()]
CONFIGS = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]  # default capture sizes
RUNNERS = ["mrv2", "v1"]
LONG_STEPS = 400  # steps of the long trace checked (its first ones: fill-up, preemption, mixed batches)


@dataclass
class Batch:
    """One step's inputs in the runner's batch order (copies)."""

    step: int
    req_ids: list
    num_scheduled_tokens: np.ndarray  # [R] int32
    num_computed_tokens: np.ndarray  # [R] int32
    query_start_loc: np.ndarray  # [R + 1] int32
    seq_lens: np.ndarray  # [R] int32
    positions: np.ndarray  # [T] int64
    block_tables: list  # [G] x [R, W] int32 (kernel tables where the trace splits blocks)
    slot_mapping: np.ndarray  # [G, T] int64
    num_draft_tokens: np.ndarray  # [R] int32
    prompt_len: np.ndarray  # [R] int32
    prefill_len: np.ndarray  # [R] int32
    sched_order: dict  # req_id -> num_scheduled_tokens, scheduler order
    spec: dict  # req_id -> draft ids


@lru_cache(maxsize=None)
def batches(name: str, runner: str) -> tuple:
    from kvmap.workers.registry import make_worker

    trace = Trace(TRACES / name)
    h = trace.header
    w = make_worker("numpy", h, "cpu", runner, 1 if runner == "v1" else None)
    prompt, prefill = {}, {}
    out = []
    for i, step in enumerate(trace.steps()):
        if name.endswith(".gz") and i >= LONG_STEPS:
            break
        so = step.scheduler_output
        for nr in so.scheduled_new_reqs:
            prompt[nr.req_id], prefill[nr.req_id] = len(nr.prompt_token_ids), len(nr.token_ids)
        w.run_step(step)
        m = w.mappings()
        ids = list(m.req_ids)
        if ids:
            tables = m.kernel_block_tables if m.kernel_block_tables is not None else m.block_tables
            out.append(Batch(
                step.step, ids, m.num_scheduled_tokens.copy(), m.num_computed_tokens.copy(),
                m.query_start_loc.copy(), m.seq_lens.copy(), m.positions.copy(), [t.copy() for t in tables],
                m.slot_mapping.copy(),
                np.array([len(so.scheduled_spec_decode_tokens.get(r, ())) for r in ids], dtype=np.int32),
                np.array([prompt[r] for r in ids], dtype=np.int32), np.array([prefill[r] for r in ids], np.int32),
                dict(so.num_scheduled_tokens), dict(so.scheduled_spec_decode_tokens)))
        w.append_sampled()
    return h, tuple(out)


@pytest.fixture(scope="module")
def vllm():
    from vllm.config import VllmConfig
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as MRV2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    for _name, mod in list(sys.modules.items()):
        if _name.startswith("vllm") and mod is not None and mod.__dict__.get("PIN_MEMORY") is True:
            mod.PIN_MEMORY = False  # no accelerator: host copies are plain memory
    return SimpleNamespace(VllmConfig=VllmConfig, CompilationConfig=CompilationConfig, CUDAGraphMode=CUDAGraphMode,
                           CudagraphDispatcher=CudagraphDispatcher, CudaGraphManager=CudaGraphManager,
                           dispatch_cg_and_sync_dp=dispatch_cg_and_sync_dp, MRV2Runner=MRV2Runner,
                           V1Runner=V1Runner)


# ---------------------------------------------------------------------------------------- CUDA graphs

def vllm_config(V, h, mode: str, runner: str):
    """kvmap's stand-in VllmConfig with vLLM's own capture sizes (`_set_cudagraph_sizes`, V1's spec rounding)."""
    k = h.num_speculative_tokens
    cfg = vf.vllm_config(mode, h.max_num_seqs, h.max_num_batched_tokens, k)
    cc = cfg.compilation_config
    V.VllmConfig._set_cudagraph_sizes(cfg)  # the platform default (not Blackwell) on this machine
    if runner == "v1" and cc.cudagraph_mode.decode_mode() == V.CUDAGraphMode.FULL and k:
        cc.adjust_cudagraph_sizes_for_spec_decode(1 + k)
    return cfg


def v1_dispatcher(V, cfg):
    return vf.v1_dispatcher(cfg)


def mrv2_manager(V, cfg):
    return vf.mrv2_manager(cfg)


def mrv2_state(V, b: Batch, k: int):
    """MRV2's own `gather_batch_req_state` on a stand-in runner: its batch order, is_prefilling and uniform token
    count for this step."""
    r = object.__new__(V.MRV2Runner)
    idx = {rid: i for i, rid in enumerate(b.req_ids)}
    r.req_states = SimpleNamespace(
        req_id_to_index=idx, prefill_len=SimpleNamespace(np=b.prefill_len.copy()),
        num_computed_prefill_tokens=np.minimum(b.num_computed_tokens, b.prefill_len).astype(np.int32))
    r.use_pp, r.adaptive_verification, r.pcp_manager, r.decode_query_len = False, None, None, 1 + k
    so = SimpleNamespace(num_scheduled_tokens=b.sched_order, total_num_scheduled_tokens=int(b.query_start_loc[-1]),
                         scheduled_spec_decode_tokens=b.spec)
    return r.gather_batch_req_state(so, dummy_run=False)


def vllm_dispatch(V, runner, disp, b: Batch, k: int):
    R, T, max_q = len(b.req_ids), int(b.query_start_loc[-1]), int(b.num_scheduled_tokens.max())
    if runner == "v1":
        uniform = V.V1Runner._is_uniform_decode(max_q, 1 + k, T, R)
        mode, desc = disp.dispatch(num_tokens=T, uniform_decode=uniform)
        return mode.name, desc.num_tokens, desc.num_reqs if desc.num_reqs is not None else R
    state, utc = mrv2_state(V, b, k)
    assert state.req_ids == b.req_ids, f"step {b.step}: MRV2's batch order"
    desc, _ = V.dispatch_cg_and_sync_dp(disp, R, T, utc, dp_size=1, dp_rank=0,
                                        max_query_len=None if state.has_prefill else max_q)
    return desc.cg_mode.name, max(T, desc.num_tokens), desc.num_reqs or R


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("name", TRACE_NAMES)
def test_cudagraph_dispatch_equals_vllms(name, runner, vllm):
    V = vllm
    h, bs = batches(name, runner)
    k = h.num_speculative_tokens
    counted = 0
    for mode in CONFIGS:
        cfg = vllm_config(V, h, mode, runner)
        sizes = cfg.compilation_config.cudagraph_capture_sizes
        assert cg.resolve_capture_sizes(runner, mode, None, h.max_num_seqs, h.max_num_batched_tokens, k) == sizes
        disp = v1_dispatcher(V, cfg) if runner == "v1" else mrv2_manager(V, cfg)
        mine = cg.Dispatcher(runner, mode, sizes, h.max_num_seqs, k)
        for b in bs:
            R, T, max_q = len(b.req_ids), int(b.query_start_loc[-1]), int(b.num_scheduled_tokens.max())
            elig = cg.decode_graph_eligible(b.num_scheduled_tokens.tolist(), b.num_draft_tokens.tolist(),
                                            np.minimum(b.num_computed_tokens, b.prefill_len).tolist(),
                                            b.prefill_len.tolist())
            want = vllm_dispatch(V, runner, disp, b, k)
            spec = cg.dispatch_spec(runner, mode, sizes, h.max_num_seqs, k, R, T, max_q, elig)
            fast = mine.dispatch(R, T, max_q, elig)
            where = f"{name} {runner} {mode} step {b.step}"
            assert (spec.cudagraph_mode, spec.num_tokens_padded, spec.num_reqs_padded) == want, where
            assert fast == spec, where
            counted += 1
    assert counted == len(CONFIGS) * len(bs) > 0


# ---------------------------------------------------------------------------------------- attention metadata

ATTN_CONFIGS = ["NONE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"]


def steps_with_metadata(name: str, runner: str, mode: str, stride: int = 1):
    """(header, batch, descriptor, padded tails, [group] CommonAttentionMetadata) per step."""
    h, bs = batches(name, runner)
    k = h.num_speculative_tokens
    sizes = cg.resolve_capture_sizes(runner, mode, None, h.max_num_seqs, h.max_num_batched_tokens, k)
    disp = cg.Dispatcher(runner, mode, sizes, h.max_num_seqs, k)
    for b in bs[::stride]:
        R, T, max_q = len(b.req_ids), int(b.query_start_loc[-1]), int(b.num_scheduled_tokens.max())
        elig = cg.decode_graph_eligible(b.num_scheduled_tokens.tolist(), b.num_draft_tokens.tolist(),
                                        np.minimum(b.num_computed_tokens, b.prefill_len).tolist(),
                                        b.prefill_len.tolist())
        desc = disp.dispatch(R, T, max_q, elig)
        tails = pt.pad_tails(runner, desc, b.query_start_loc, b.seq_lens, b.slot_mapping, b.block_tables,
                             b.positions)
        spec = pt.pad_tails_spec(runner, desc, b.query_start_loc, b.seq_lens, b.slot_mapping, b.block_tables,
                                 b.positions)
        assert_same(tails, spec, f"{name} {runner} {mode} step {b.step} tails")
        lens = b.prefill_len if runner == "mrv2" else b.prompt_len
        cms = []
        for g in range(len(b.block_tables)):
            cm = fa.common_metadata(runner, desc, tails, g, b.num_computed_tokens, lens)
            assert_same(cm, fa.common_metadata_spec(runner, desc, tails, g, b.num_computed_tokens, lens),
                        f"{name} {runner} {mode} step {b.step} group {g}")
            cms.append(cm)
        yield h, b, desc, tails, cms


def assert_same(a, b, where: str) -> None:
    """Two results field by field: arrays equal in value, dtype and shape."""
    for f in a.__dataclass_fields__ if hasattr(a, "__dataclass_fields__") else a.__slots__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and (x == y).all(), f"{where}: {f}"
        elif isinstance(x, list):
            assert all((u == v).all() and u.dtype == v.dtype for u, v in zip(x, y)), f"{where}: {f}"
        elif hasattr(x, "__slots__") and not isinstance(x, (int, str, bool)):
            assert_same(x, y, f"{where}.{f}")
        else:
            assert x == y, f"{where}: {f} {x} != {y}"


@pytest.fixture(scope="module")
def vllm_attn(vllm):
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends import utils as bu

    return SimpleNamespace(torch=torch, CM=CommonAttentionMetadata, bu=bu)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("name", TRACE_NAMES)
def test_split_equals_vllms(name, runner, vllm_attn):
    A = vllm_attn
    counted = 0
    for mode in ATTN_CONFIGS:
        for h, b, _desc, _tails, cms in steps_with_metadata(name, runner, mode):
            k = h.num_speculative_tokens
            for g, cm in enumerate(cms):
                vcm = vllm_cm(cm, A.torch, A.CM)
                where = f"{name} {runner} {mode} step {b.step} group {g}"
                for backend, fi_decode in (("FLASHINFER", "native"), ("FLASHINFER", "xqa"), ("FLASHMLA", "native"),
                                           ("TRITON_MLA", "native"), ("FLASH_ATTN_MLA", "native")):
                    t = fa.reorder_batch_threshold(backend, k, h.cp_size, runner=runner, flashinfer_decode=fi_decode)
                    u = fa.require_uniform(backend, fi_decode)
                    want = A.bu.split_decodes_and_prefills(vcm, decode_threshold=t, require_uniform=u)
                    args = (cm.query_start_loc, cm.num_reqs, cm.num_actual_tokens, cm.max_query_len, t, u)
                    got = fa.split_decodes_and_prefills(*args)
                    assert got == fa.split_decodes_and_prefills_spec(*args), where
                    assert (got.num_decodes, got.num_prefills, got.num_decode_tokens,
                            got.num_prefill_tokens) == tuple(int(x) for x in want), f"{where} {backend}"
                if len(cm.is_prefilling) == cm.num_reqs:  # MRV2's is_prefilling has R rows (FULL pads to R_pad)
                    want = A.bu.split_decodes_and_prefills(vcm, decode_threshold=1 + k,
                                                           treat_short_extends_as_decodes=False)
                    args = (cm.query_start_loc, cm.num_reqs, cm.num_actual_tokens, cm.max_query_len, 1 + k, False,
                            False, cm.is_prefilling)
                    got = fa.split_decodes_and_prefills(*args)
                    assert got == fa.split_decodes_and_prefills_spec(*args), where
                    assert (got.num_decodes, got.num_prefills, got.num_decode_tokens,
                            got.num_prefill_tokens) == tuple(int(x) for x in want), f"{where} short extends"
                want = A.bu.split_decodes_prefills_and_extends(vcm, decode_threshold=1 + k)
                args = (cm.query_start_loc, cm.seq_lens_cpu_upper_bound, cm.num_reqs, cm.num_actual_tokens,
                        cm.max_query_len, 1 + k)
                got = fa.split_decodes_prefills_and_extends(*args)
                assert got == fa.split_decodes_prefills_and_extends_spec(*args), where
                assert (got.num_decodes, got.num_extends, got.num_prefills, got.num_decode_tokens,
                        got.num_extend_tokens, got.num_prefill_tokens) == tuple(int(x) for x in want), where
                counted += 1
    assert counted > 0


# ---------------------------------------------------------------------------------------- FlashInfer

@pytest.fixture(scope="module")
def vllm_fi(vllm_attn):
    import vllm.v1.attention.backends.flashinfer as fi
    from vllm.v1.utils import CpuGpuBuffer

    vllm_attn.CpuGpuBuffer = CpuGpuBuffer
    return vllm_attn, fi


def _eq(a, b) -> bool:
    return a.shape == b.shape and (a == b).all()


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("name", TRACE_NAMES)
def test_flashinfer_equals_vllms(name, runner, vllm_fi):
    """chunked_local groups go through the virtual batches first; where those outnumber max_num_seqs vLLM's
    builder fails (vllm#49980: chunked_local.jsonl steps 5 and 6) while kvmap computes them."""
    from kvmap.forward import flashinfer as fib
    from kvmap.forward import local_attention as la

    A, fi = vllm_fi
    counted = 0
    overflows: list = []
    stride = 8 if name.endswith(".gz") else 1  # the interpreted page-copy kernel is slow on long batches
    builders: dict = {}
    for mode in ATTN_CONFIGS:
        for h, b, _desc, _tails, cms in steps_with_metadata(name, runner, mode, stride):
            k, cp = h.num_speculative_tokens, h.cp_size
            for g, (grp, cm) in enumerate(zip(h.kv_cache_groups, cms)):
                if grp.kind == "mamba":
                    continue
                page = grp.kernel_block_size or grp.block_size
                vcm = vllm_cm(cm, A.torch, A.CM)
                if grp.kind == "chunked_local":  # ChunkedLocalAttentionBuilder: the virtual batches, then build
                    vcm, _ = A.bu.make_local_attention_virtual_batches(grp.attention_chunk_size, vcm, page)
                    cm = la.virtual_batches(cm, grp.attention_chunk_size, page)
                    if cm.num_reqs > h.max_num_seqs:  # vllm#49980: the builder's per-request buffers overflow
                        B = builders[g, page] = _rebind(builders.get((g, page)), A, fi, h, page, cp, {})
                        with pytest.raises(ValueError, match="wrong size"):  # np.cumsum into indptr
                            B.build(0, vcm)
                        overflows.append((runner, mode, b.step))
                        continue
                decodes = ("native", "fa2_native") if k and cp == 1 else ("native",)
                for rank, decode in ((r, d) for r in range(cp) for d in decodes):
                    plans: dict = {}
                    B = builders[g, page] = _rebind(builders.get((g, page)), A, fi, h, page, cp, plans)
                    B.dcp_rank = rank
                    if decode == "fa2_native":  # pre-SM90 FA2 decode: spec tokens as decodes, per-request plan
                        B.use_fa2_native_decode = True
                        B.reorder_batch_threshold = fa.reorder_batch_threshold("FLASHINFER", k,
                                                                               flashinfer_decode=decode)
                    md = B.build(0, vcm)
                    sp = fa.split(cm, "FLASHINFER", k, cp, runner=runner, flashinfer_decode=decode)
                    args = (cm, sp, page, k, cp, rank, h.cp_kv_cache_interleave_size, decode == "fa2_native")
                    mine = fib.build(*args)
                    assert_same(mine, fib.build_spec(*args), f"{name} step {b.step} group {g} spec")
                    where = f"{name} {runner} {mode} step {b.step} group {g} rank {rank} {decode}"
                    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == \
                        (mine.num_decodes, mine.num_prefills, mine.num_decode_tokens, mine.num_prefill_tokens), where
                    n = cm.num_reqs
                    assert _eq(B.paged_kv_indptr.np[: n + 1], mine.paged_kv_indptr), where
                    assert _eq(B.paged_kv_last_page_len.np[:n], mine.paged_kv_last_page_len), where
                    assert _eq(B.paged_kv_indices[: mine.paged_kv_indptr[-1]].numpy(), mine.paged_kv_indices), where
                    check_plans(plans, mine, cp, where)
                    counted += 1
    assert counted > 0
    if name == "chunked_local.jsonl":
        assert {s for _r, _m, s in overflows} == {5, 6}, overflows


def _rebind(B, A, fi, h, page, cp, plans):
    """kvmap.workers.vllm_forward.rebind on the host (the one copy of the stand-in builder)."""
    return rebind(B, fi, h, page, cp, plans, A.torch.device("cpu"))


def check_plans(plans: dict, mine, cp: int, where: str) -> None:
    if mine.prefill is None:
        assert "prefill" not in plans, where
    else:
        p = plans["prefill"]
        if cp > 1:
            got = (p["qo_indptr_cpu"], p["paged_kv_indptr_cpu"], p["paged_kv_last_page_len_cpu"], p["kv_lens_cpu"])
        else:
            got = (p["qo_indptr"], p["paged_kv_indptr"], p["paged_kv_last_page_len"], p["seq_lens"])
        want = (mine.prefill.qo_indptr, mine.prefill.paged_kv_indptr, mine.prefill.paged_kv_last_page_len,
                mine.prefill.seq_lens)
        assert all(_eq(x, y) for x, y in zip(got, want)), f"{where} prefill plan"
        assert _eq(p["paged_kv_indices"][: mine.paged_kv_indptr[-1]], mine.paged_kv_indices), f"{where} indices"
        assert p["page_size"] == mine.prefill.page_size, where
    if mine.decode is None:
        assert "decode" not in plans, where
    else:
        d = plans["decode"]
        assert _eq(d["indptr"], mine.decode.indptr) and _eq(d["last_page_len"], mine.decode.last_page_len), \
            f"{where} decode plan"
        assert _eq(d["seq_lens"], mine.decode.seq_lens), f"{where} decode kv lens"
        assert _eq(d["indices"][: mine.paged_kv_indptr[-1]], mine.paged_kv_indices), f"{where} indices"
        assert (d["page_size"], d["q_len_per_req"], d["num_qo_heads"]) == \
            (mine.decode.page_size, mine.decode.q_len_per_req, 8 * mine.decode.num_qo_heads_factor), where


# ---------------------------------------------------------------------------------------- FlashAttention

@pytest.fixture(scope="module")
def vllm_fa(vllm_attn):
    import vllm.v1.attention.backends.flash_attn as fl
    import vllm.v1.attention.backends.triton_attn as triton

    vllm_attn.triton = triton
    return vllm_attn, fl


def flash_attn_builder(A, fl, h, mode: str, max_size: int, rank: int):
    """vLLM's builder without __init__, as FA3 would be set up but with `aot_schedule=False`: everything but
    `get_scheduler_metadata` (a CUDA op) runs."""
    B = object.__new__(fl.FlashAttentionMetadataBuilder)
    full = mode in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
    B.__dict__.update(
        aot_schedule=False, aot_sliding_window=None, use_full_cuda_graph=full, max_cudagraph_size=max_size,
        max_num_splits=32 if full else 0, dcp_world_size=h.cp_size, dcp_rank=rank,
        cp_kv_cache_interleave_size=h.cp_kv_cache_interleave_size, rswa_window=None,
        mm_prefix_query_ranges_np=None, scheduler_metadata=None,
        _dcp_context_kv_lens=A.torch.zeros(h.max_num_seqs, dtype=A.torch.int32))
    return B


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("name", TRACE_NAMES)
def test_flash_attn_equals_vllms(name, runner, vllm_fa):
    from kvmap.forward import flash_attn as fab
    from kvmap.forward import local_attention as la

    A, fl = vllm_fa
    counted = 0
    for mode in ATTN_CONFIGS:
        h, _ = batches(name, runner)
        sizes = cg.resolve_capture_sizes(runner, mode, None, h.max_num_seqs, h.max_num_batched_tokens,
                                         h.num_speculative_tokens)
        top = max(sizes, default=0)
        for h, b, _desc, _tails, cms in steps_with_metadata(name, runner, mode):
            for g, (grp, cm) in enumerate(zip(h.kv_cache_groups, cms)):
                if grp.kind == "mamba":
                    continue
                vcm = vllm_cm(cm, A.torch, A.CM)
                if grp.kind == "chunked_local":  # ChunkedLocalAttentionBuilder: the virtual batches, then FA's build
                    bs = grp.kernel_block_size or grp.block_size
                    vcm, _ = A.bu.make_local_attention_virtual_batches(grp.attention_chunk_size, vcm, bs)
                    cm = la.virtual_batches(cm, grp.attention_chunk_size, bs)
                for rank in range(h.cp_size):
                    md = flash_attn_builder(A, fl, h, mode, top, rank).build(0, vcm)
                    args = (cm, mode, top, 3, h.cp_size, rank, h.cp_kv_cache_interleave_size)
                    mine = fab.build(*args)
                    where = f"{name} {runner} {mode} step {b.step} group {g} rank {rank}"
                    assert_same(mine, fab.build_spec(*args), where)
                    assert md.scheduler_metadata is None and mine.scheduler_metadata is None
                    for f in ("num_actual_tokens", "max_query_len", "max_seq_len", "max_dcp_context_kv_len",
                              "num_decode_reqs", "num_prefill_reqs", "num_decode_tokens", "num_prefill_tokens",
                              "max_num_splits", "causal"):
                        assert int(getattr(md, f)) == int(getattr(mine, f)), f"{where}: {f}"
                    for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
                        assert _eq(getattr(md, f).numpy(), getattr(mine, f)), f"{where}: {f}"
                    if h.cp_size > 1:
                        assert _eq(md.dcp_context_kv_lens.numpy(), mine.dcp_context_kv_lens), where
                    else:
                        assert md.dcp_context_kv_lens is None and mine.dcp_context_kv_lens is None, where
                    counted += 1
                tb = object.__new__(A.triton.TritonAttentionMetadataBuilder)
                tb.__dict__.update(seq_threshold_3D=128, num_par_softmax_segments=16, softmax_segm_output=None,
                                   softmax_segm_max=None, softmax_segm_expsum=None, max_seqs_64_segments=0,
                                   rswa_window=None)
                tm, mine = tb.build(0, vcm), fab.triton_attn(cm)
                for f in ("num_actual_tokens", "max_query_len", "max_seq_len", "causal"):
                    assert int(getattr(tm, f)) == int(getattr(mine, f)), f"{where} triton: {f}"
                for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
                    assert _eq(getattr(tm, f).numpy(), getattr(mine, f)), f"{where} triton: {f}"
    assert counted > 0


# ---------------------------------------------------------------------------------------- chunked local

@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("name", TRACE_NAMES)
def test_local_virtual_batches_equal_vllms(name, runner, vllm_attn):
    """Every group's batches go through the rule with chunk sizes of one, two and four kernel blocks (the rule is
    index arithmetic over the common metadata), chunked_local groups (chunked_local.jsonl) with their own too."""
    from kvmap.forward import local_attention as la

    A = vllm_attn
    counted = 0
    for mode in ATTN_CONFIGS:
        for h, b, _desc, _tails, cms in steps_with_metadata(name, runner, mode, 4 if name.endswith(".gz") else 1):
            for g, (grp, cm) in enumerate(zip(h.kv_cache_groups, cms)):
                if grp.kind == "mamba":
                    continue
                bs = grp.kernel_block_size or grp.block_size
                for chunk in sorted({bs, 2 * bs, 4 * bs, grp.attention_chunk_size or bs}):
                    want, _ = A.bu.make_local_attention_virtual_batches(chunk, vllm_cm(cm, A.torch, A.CM), bs)
                    mine = la.virtual_batches(cm, chunk, bs)
                    where = f"{name} {runner} {mode} step {b.step} group {g} chunk {chunk}"
                    assert_same(mine, la.virtual_batches_spec(cm, chunk, bs), where)
                    for f in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping",
                              "seq_lens_cpu_upper_bound"):
                        got = getattr(mine, f)
                        assert _eq(getattr(want, f).numpy(), got) and got.dtype == getattr(want, f).numpy().dtype, \
                            f"{where}: {f}"
                    assert _eq(want.query_start_loc_cpu.numpy(), mine.query_start_loc), where
                    for f in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len"):
                        assert int(getattr(want, f)) == getattr(mine, f), f"{where}: {f}"
                    counted += 1
    assert counted > 0


@pytest.mark.parametrize("runner", RUNNERS)
def test_cudagraph_dispatch_fuzzed_equals_vllms(runner, vllm):
    """Random batches the bundled traces rarely make: one-token prompt chunks beside decodes (MRV2 runs them as a
    decode graph, V1 by shape alone), uniform prompt chunks of 1+k tokens, user capture sizes."""
    V = vllm
    rng = np.random.default_rng(2026)
    for trial in range(24):
        k = int(rng.integers(0, 4))
        mode = CONFIGS[trial % len(CONFIGS)]
        max_num_seqs = int(rng.integers(2, 24))
        h = SimpleNamespace(num_speculative_tokens=k, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
        cfg = vllm_config(V, h, mode, runner)
        if trial % 3 == 0 and mode != "NONE":  # user sizes, as the engine resolved them
            user = sorted(set(rng.integers(1, 200, 6).tolist()) | {1 + k})
            cfg.compilation_config.cudagraph_capture_sizes = cg.resolve_capture_sizes(
                runner, mode, user, max_num_seqs, 2048, k)
            cfg.compilation_config.max_cudagraph_capture_size = cfg.compilation_config.cudagraph_capture_sizes[-1]
        sizes = cfg.compilation_config.cudagraph_capture_sizes
        disp = v1_dispatcher(V, cfg) if runner == "v1" else mrv2_manager(V, cfg)
        mine = cg.Dispatcher(runner, mode, sizes, max_num_seqs, k)
        for _ in range(40):
            R = int(rng.integers(1, max_num_seqs + 1))
            ids = [f"r{i}" for i in range(R)]
            kind = rng.integers(0, 3)
            prefill = rng.integers(20, 60, R).astype(np.int32)
            computed = np.where(rng.random(R) < 0.5, prefill + rng.integers(0, 9, R), rng.integers(0, 20, R))
            drafts = np.where(computed >= prefill, k if kind else rng.integers(0, k + 1, R), 0).astype(np.int32)
            q = np.where(computed >= prefill, 1 + drafts, 1 if kind != 2 else 1 + k).astype(np.int32)
            q = np.where(computed < prefill, np.minimum(q, prefill - computed), q).astype(np.int32)
            order = np.argsort(computed < prefill, kind="stable")  # decodes first (MRV2 sorts its own)
            qsl = np.zeros(R + 1, dtype=np.int32)
            np.cumsum(q[order], out=qsl[1:])
            b = Batch(0, [ids[i] for i in order], q[order], computed[order].astype(np.int32), qsl, None, None, [],
                      None, drafts[order], prefill[order], prefill[order], {ids[i]: int(q[i]) for i in range(R)},
                      {ids[i]: [7] * int(drafts[i]) for i in range(R) if drafts[i]})
            if runner == "mrv2":
                state, _ = mrv2_state(V, b, k)  # MRV2's own order first, then the same batch in it
                pos = [b.req_ids.index(r) for r in state.req_ids]
                b = Batch(0, list(state.req_ids), b.num_scheduled_tokens[pos], b.num_computed_tokens[pos], qsl, None,
                          None, [], None, b.num_draft_tokens[pos], b.prompt_len[pos], b.prefill_len[pos],
                          b.sched_order, b.spec)
            T, max_q = int(q.sum()), int(q.max())
            elig = cg.decode_graph_eligible(b.num_scheduled_tokens.tolist(), b.num_draft_tokens.tolist(),
                                            np.minimum(b.num_computed_tokens, b.prefill_len).tolist(),
                                            b.prefill_len.tolist())
            want = vllm_dispatch(V, runner, disp, b, k)
            spec = cg.dispatch_spec(runner, mode, sizes, max_num_seqs, k, R, T, max_q, elig)
            where = f"{runner} {mode} k={k} seqs={max_num_seqs} sizes={sizes} q={b.num_scheduled_tokens.tolist()}"
            assert (spec.cudagraph_mode, spec.num_tokens_padded, spec.num_reqs_padded) == want, where
            assert mine.dispatch(R, T, max_q, elig) == spec, where


# ---------------------------------------------------------------------------------------- common metadata

STALE = 777  # what a padded row of a reused buffer may still hold: vLLM must overwrite or drop it


def v1_common(A, h, b: Batch, desc, tails):
    """V1's own `_build_attention_metadata` on a stand-in runner whose buffers hold this step (stale past R)."""
    torch, R, G = A.torch, len(b.req_ids), len(b.block_tables)
    r = object.__new__(A.V1Runner)
    rows = h.max_num_seqs + 1
    stale = lambda x, n, fill=STALE: torch.from_numpy(np.concatenate([x, np.full(n - len(x), fill, x.dtype)]))  # noqa: E731
    r.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=object()) for _ in range(G)])
    r.max_model_len = h.max_model_len
    r.optimistic_seq_lens_cpu = stale(b.seq_lens, rows, 0)  # vLLM zeroes past R (gpu_model_runner.py 2045-2050)
    tables = []
    for t in b.block_tables:
        full = np.full((rows, t.shape[1]), STALE, dtype=np.int32)
        full[:R] = t
        tables.append(SimpleNamespace(get_device_tensor=lambda n, f=full: torch.from_numpy(f[:n].copy())))
    r.input_batch = SimpleNamespace(block_table=tables, req_ids=b.req_ids,
                                    num_computed_tokens_cpu_tensor=stale(b.num_computed_tokens, rows, 0),
                                    num_prompt_tokens_cpu_tensor=stale(b.prompt_len, rows))
    r.is_mm_prefix_lm, r.speculative_config, r.dcp_world_size = False, None, 1
    r.model_config = SimpleNamespace(rswa_window=None)
    r.cache_config = SimpleNamespace(use_replayssm=False, kv_sharing_fast_prefill=False)
    qsl = stale(tails.query_start_loc, rows + 1, desc.num_tokens)  # V1 writes the tail on the whole buffer
    r.query_start_loc = SimpleNamespace(gpu=qsl, cpu=qsl)
    r.seq_lens = stale(b.seq_lens, rows, 0)
    r.positions = torch.zeros(max(desc.num_tokens_padded, 1), dtype=torch.int64)
    r._get_encoder_seq_lens = lambda *a, **k: (None, None)
    r.attn_groups = [[RecordGroup(g)] for g in range(G)]
    pad = desc.pad_attn
    md, _ = r._build_attention_metadata(
        num_tokens=desc.num_tokens, num_tokens_padded=desc.num_tokens_padded if pad else None, num_reqs=R,
        num_reqs_padded=desc.num_reqs_padded if pad else None, max_query_len=int(b.num_scheduled_tokens.max()),
        slot_mappings={g: torch.from_numpy(tails.slot_mapping[g].copy()) for g in range(G)})
    return [md[f"layer{g}"] for g in range(G)]


def mrv2_common(A, h, b: Batch, desc, tails):
    """MRV2's own `DefaultModelState.prepare_attn` + `build_attn_metadata`, is_prefilling from its own
    `gather_batch_req_state`."""
    torch, R, G = A.torch, len(b.req_ids), len(b.block_tables)
    state, _ = mrv2_state(A, b, h.num_speculative_tokens)
    ib = SimpleNamespace(
        num_reqs=R, num_tokens=desc.num_tokens, num_reqs_after_padding=desc.num_reqs_padded,
        num_tokens_after_padding=desc.num_tokens_padded, query_start_loc_np=tails.query_start_loc,
        query_start_loc=torch.from_numpy(tails.query_start_loc.copy()), max_query_len=None,
        num_scheduled_tokens=b.num_scheduled_tokens, seq_lens_cpu_upper_bound=torch.from_numpy(tails.seq_lens.copy()),
        seq_lens=torch.from_numpy(tails.seq_lens.copy()), pcp=None, dcp_local_seq_lens=None,
        positions=None, is_prefilling_np=state.is_prefilling_np, prompt_lens=None,
        idx_mapping_np=np.arange(R), fast_prefill=None)
    mode = A.CUDAGraphMode.FULL if desc.pad_attn else A.CUDAGraphMode.NONE
    md = mrv2_prepare_attn(ib, mode, tuple(torch.from_numpy(t.copy()) for t in tails.block_tables),
                           torch.from_numpy(tails.slot_mapping.copy()), [[RecordGroup(g)] for g in range(G)])
    return [md[f"layer{g}"] for g in range(G)]


@pytest.fixture(scope="module")
def vllm_common(vllm, vllm_attn):
    vllm.torch = vllm_attn.torch
    return vllm


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("name", TRACE_NAMES)
def test_common_metadata_equals_vllms(name, runner, vllm_common):
    A = vllm_common
    counted = 0
    for mode in ATTN_CONFIGS:
        for h, b, desc, tails, cms in steps_with_metadata(name, runner, mode, 4 if name.endswith(".gz") else 1):
            want = (v1_common if runner == "v1" else mrv2_common)(A, h, b, desc, tails)
            for g, (w, cm) in enumerate(zip(want, cms)):
                where = f"{name} {runner} {mode} step {b.step} group {g}"
                for f in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "causal"):
                    assert int(getattr(w, f)) == int(getattr(cm, f)), f"{where}: {f}"
                assert _eq(w.query_start_loc_cpu.numpy(), cm.query_start_loc), f"{where}: query_start_loc"
                for f in ("seq_lens", "block_table_tensor", "slot_mapping", "is_prefilling",
                          "seq_lens_cpu_upper_bound"):
                    got = getattr(w, f).numpy()
                    assert _eq(got, getattr(cm, f)) and got.dtype == getattr(cm, f).dtype, f"{where}: {f}"
                counted += 1
    assert counted > 0


# ---------------------------------------------------------------------------------------- data parallelism

class _Collected(Exception):
    pass


def mrv2_dp(V, mgr, ranks, k):
    """vLLM's `dispatch_cg_and_sync_dp` on every rank, its all-reduce replaced by the sum of the ranks' own
    columns (collected by a first pass that stops at the all-reduce)."""
    import vllm.v1.worker.gpu.dp_utils as du

    dp = len(ranks)
    cols = {}

    def call(r, reduce):
        rb = ranks[r]
        utc = rb.max_query_len if rb.decode_eligible and rb.num_tokens == rb.max_query_len * rb.num_reqs else None
        du.get_dp_group = lambda: SimpleNamespace(cpu_all_reduce_=reduce)
        return V.dispatch_cg_and_sync_dp(mgr, rb.num_reqs, rb.num_tokens, utc, dp_size=dp, dp_rank=r,
                                         max_query_len=rb.max_query_len)

    saved = du.get_dp_group
    try:
        for r in range(dp):
            def collect(t, r=r):
                cols[r] = t[:, r].clone()
                raise _Collected
            with pytest.raises(_Collected):
                call(r, collect)

        def reduce(t):
            for r, c in cols.items():
                t[:, r] = c
        return [call(r, reduce)[0] for r in range(dp)]
    finally:
        du.get_dp_group = saved


def v1_dp(V, disp, ranks, k):
    """V1's own `_determine_batch_execution_and_padding` per rank, `_run_ar` replaced by the ranks' columns."""
    import torch
    import vllm.v1.worker.dp_utils as du

    dp = len(ranks)
    cols = []
    for rb in ranks:  # each rank's own dispatch, as _determine_batch_execution_and_padding does first
        u = V.V1Runner._is_uniform_decode(rb.max_query_len, 1 + k, rb.num_tokens, rb.num_reqs)
        mode, desc = disp.dispatch(num_tokens=rb.num_tokens, uniform_decode=u)
        cols.append((rb.num_tokens, desc.num_tokens, 0, mode.value))
    saved = du._run_ar
    du._run_ar = lambda **kw: torch.tensor(cols, dtype=torch.int32).T.contiguous()
    try:
        out = []
        for r, rb in enumerate(ranks):
            run = object.__new__(V.V1Runner)
            pc = SimpleNamespace(data_parallel_size=dp, data_parallel_rank=r, num_ubatches=1,
                                 disable_nccl_for_dp_synchronization=True)
            run.uniform_decode_query_len, run.cudagraph_dispatcher = 1 + k, disp
            run.model_config = SimpleNamespace(is_encoder_decoder=False)
            run.input_batch = SimpleNamespace(lora_id_to_lora_request={})
            run.vllm_config = SimpleNamespace(parallel_config=pc,
                                              observability_config=SimpleNamespace(cudagraph_metrics=False))
            run.parallel_config = pc
            mode, desc, _, _, _ = run._determine_batch_execution_and_padding(
                rb.num_tokens, rb.num_reqs, None, rb.max_query_len, allow_microbatching=False)
            out.append((mode.name, desc.num_tokens, desc.num_reqs if desc.num_reqs is not None else rb.num_reqs))
        return out
    finally:
        du._run_ar = saved


@pytest.mark.parametrize("runner", RUNNERS)
def test_dp_padding_equals_vllms(runner, vllm):
    """DP padding from every rank's counts (no bundled trace has dp > 1): random steps of 2-4 ranks."""
    V = vllm
    rng = np.random.default_rng(4)
    for trial in range(30):
        k = int(rng.integers(0, 3))
        mode = CONFIGS[trial % len(CONFIGS)]
        seqs = int(rng.integers(2, 20))
        h = SimpleNamespace(num_speculative_tokens=k, max_num_seqs=seqs, max_num_batched_tokens=1024)
        cfg = vllm_config(V, h, mode, runner)
        sizes = cfg.compilation_config.cudagraph_capture_sizes
        disp = v1_dispatcher(V, cfg) if runner == "v1" else mrv2_manager(V, cfg)
        for _ in range(10):
            ranks = []
            for _r in range(int(rng.integers(2, 5))):
                R = int(rng.integers(1, seqs + 1))
                Q = 1 + k if rng.random() < 0.6 else int(rng.integers(1 + k, 300))
                T = R * Q if rng.random() < 0.6 else int(rng.integers(R + Q - 1, R * Q + 1))
                ranks.append(dpp.RankBatch(R, T, Q, bool(rng.random() < 0.8)))
            if runner == "mrv2":
                want = [(d.cg_mode.name, max(rb.num_tokens, d.num_tokens), d.num_reqs or rb.num_reqs)
                        for d, rb in zip(mrv2_dp(V, disp, ranks, k), ranks)]
            else:
                try:
                    want = v1_dp(V, disp, ranks, k)
                except AssertionError:  # vLLM V1 itself fails on some agreed modes; so does the spec
                    with pytest.raises(AssertionError):
                        [dpp.dp_dispatch_spec(runner, mode, sizes, seqs, k, ranks, r) for r in range(len(ranks))]
                    continue
            got = [dpp.dp_dispatch_spec(runner, mode, sizes, seqs, k, ranks, r) for r in range(len(ranks))]
            assert [(d.cudagraph_mode, d.num_tokens_padded, d.num_reqs_padded) for d in got] == want, \
                (runner, mode, k, seqs, ranks)
