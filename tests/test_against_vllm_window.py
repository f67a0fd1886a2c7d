"""kvmap's gathered block tables under Model Runner V2 equal vLLM 0.33's own `_gather_block_tables_kernel`
(vllm/v1/worker/gpu/block_table.py, run on CPU under TRITON_INTERPRET=1 with pointer tables of CPU tensors, as
`BlockTables` builds them), sliding-window nulling on, with the reach taken from vLLM's own
`SlidingWindowSpec.num_retained_tokens`: every step of the bundled hybrid trace, and fuzzed states with
`extra_retained_tokens`. Runs where vLLM is installed (CI's record environment); skipped elsewhere."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest

from kvmap.trace import Trace
from kvmap.workers.registry import make_worker

from .conftest import TRACES
from .test_window_history import fill_state, fuzz_cases

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@pytest.fixture(scope="module")
def vllm_gather():
    """gather(worker, reach) -> [G] gathered tables [B, W] by vLLM's kernel, from the worker's persistent state
    (rows, num_blocks, num_computed_tokens: vLLM's req_states, indexed by row) and this step's idx_mapping."""
    import torch
    import vllm.v1.utils as vu

    vu.PIN_MEMORY = False  # no accelerator
    from vllm.v1.worker.gpu.block_table import _gather_block_tables_kernel

    def gather(worker, reach: list[int]) -> list[np.ndarray]:
        st, m = worker.state, worker.mappings()
        B = m.num_reqs
        src = [torch.from_numpy(t.copy()) for t in st.block_tables]
        dst = [torch.full_like(t, -7) for t in src]
        ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
        num_blocks = torch.from_numpy(st.num_blocks.copy())
        _gather_block_tables_kernel[(len(src), B)](
            torch.from_numpy(m.idx_mapping.astype(np.int32)), ptrs(src), ptrs(dst),
            torch.tensor([t.stride(0) for t in src], dtype=torch.int64), num_blocks, num_blocks.stride(0), B,
            torch.from_numpy(st.num_computed_tokens.astype(np.int32)), torch.tensor(reach, dtype=torch.int32),
            torch.tensor([g.block_size for g in worker.header.kv_cache_groups], dtype=torch.int32),
            MASK_SLIDING_WINDOW=True, BLOCK_SIZE=1024)
        return [d[:B].numpy() for d in dst]

    return gather


def vllm_reach(header) -> list[int]:
    """vLLM's `sliding_window_reach` (model_runner.py:648-661) from its own spec classes."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    out = []
    for g in header.kv_cache_groups:
        if g.kind == "sliding_window":
            spec = SlidingWindowSpec(block_size=g.block_size, num_kv_heads=1, head_size=8, dtype=torch.float16,
                                     sliding_window=g.sliding_window, extra_retained_tokens=g.extra_retained_tokens)
        else:
            spec = FullAttentionSpec(block_size=g.block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
        out.append(spec.num_retained_tokens if isinstance(spec, SlidingWindowSpec) else 0)
    return out


def check_step(worker, gather, reach) -> int:
    """kvmap's gathered rows (valid entries) equal vLLM's; returns how many entries vLLM nulled."""
    m = worker.mappings()
    got = gather(worker, reach)
    nulled = 0
    for g, table in enumerate(got):
        for b in range(m.num_reqs):
            nb = int(m.num_blocks[g, b])
            assert m.block_tables[g][b, :nb].tolist() == table[b, :nb].tolist(), (g, b)
            row = worker.state.block_tables[g][int(m.idx_mapping[b]), :nb]
            nulled += int(((table[b, :nb] == 0) & (row != 0)).sum())
    return nulled


@pytest.mark.parametrize("extra", [0, 3])
def test_hybrid_trace_gathered_tables_equal_vllms_kernel(vllm_gather, extra):
    trace = Trace(TRACES / "hybrid_sliding_window.jsonl")
    h = trace.header
    if extra:  # as vLLM's planner tags every SlidingWindowSpec under multi-module MTP drafting
        h = dataclasses.replace(h, kv_cache_groups=tuple(dataclasses.replace(g, extra_retained_tokens=extra)
                                                         if g.kind == "sliding_window" else g
                                                         for g in h.kv_cache_groups))
    reach = vllm_reach(h)
    assert reach == [0, 32 - 1 + extra]
    worker = make_worker("numpy", h)
    nulled = steps = 0
    for s in trace.steps():
        worker.run_step(s)
        if worker.batch.num_reqs:
            nulled += check_step(worker, vllm_gather, reach)
            steps += 1
        worker.append_sampled()
    assert steps == 53 - 2 and nulled >= 100, (steps, nulled)  # 2 of the 53 steps schedule nothing


@pytest.mark.parametrize("seed", range(4))
def test_fuzzed_states_equal_vllms_kernel(vllm_gather, seed):
    h, nc, batches, state_seed = fuzz_cases(100 + seed, 3, kernel_split=seed % 2 == 1)
    reach = vllm_reach(h)
    for name in ("numpy", "numba"):
        w = make_worker(name, h)
        fill_state(w, nc, state_seed)
        for rows, counts in batches:
            w.schedule(rows, counts, [str(r) for r in rows])
            w.mapping_phases()
            check_step(w, vllm_gather, reach)


def test_the_recorder_writes_extra_retained_tokens():
    """A live engine's header carries a sliding-window spec's extra_retained_tokens (only where nonzero)."""
    import types

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from kvmap.record.header import header_from_config

    kw = dict(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
    groups = [KVCacheGroupSpec(["a"], FullAttentionSpec(**kw)),
              KVCacheGroupSpec(["b"], SlidingWindowSpec(**kw, sliding_window=32, extra_retained_tokens=2)),
              KVCacheGroupSpec(["c"], SlidingWindowSpec(**kw, sliding_window=32))]
    kvc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    ns = types.SimpleNamespace
    vc = ns(scheduler_config=ns(max_num_seqs=4, max_num_batched_tokens=64, enable_chunked_prefill=True,
                                async_scheduling=False, policy="fcfs"),
            cache_config=ns(block_size=16, enable_prefix_caching=True),
            parallel_config=ns(decode_context_parallel_size=1, cp_kv_cache_interleave_size=1, tensor_parallel_size=1),
            speculative_config=None, use_v2_model_runner=True, model_config=ns(max_model_len=256))
    try:
        header = header_from_config(vc, kvc)
    except AttributeError as e:  # a config field this stand-in lacks: the test's, not the recorder's
        pytest.skip(f"the stand-in config lacks {e}")
    got = [g.get("extra_retained_tokens") for g in header["kv_cache_groups"]]
    assert got == [None, 2, None]
