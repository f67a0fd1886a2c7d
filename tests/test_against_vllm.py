"""kvmap's slot mappings equal vLLM's own: for every step of the small bundled traces and every KV cache group,
vLLM's V1 `BlockTable` (its Triton slot-mapping kernel, run on CPU under TRITON_INTERPRET=1) is fed kvmap's
batch block table, `query_start_loc` and `positions`, and must write kvmap's `slot_mapping` exactly.
Runs where vLLM is installed (CI's record environment); skipped elsewhere."""

from __future__ import annotations

import importlib.util

import pytest

from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace

from .conftest import TRACES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
SMALL = ["worked_example.jsonl", "chunked_prefill.jsonl", "prefix_caching.jsonl", "spec_decode.jsonl",
         "hybrid_sliding_window.jsonl", "preemption_v1.jsonl", "preemption_v2.jsonl", "streaming_sessions.jsonl"]


@pytest.fixture(scope="module")
def vllm_block_table():
    import torch
    import vllm.v1.utils as vu

    vu.PIN_MEMORY = False  # no accelerator: vLLM's CpuGpuBuffer copies plain memory
    from vllm.v1.worker.block_table import BlockTable

    def make(block_size, max_num_reqs, width, max_tokens):
        return BlockTable(block_size=block_size, max_num_reqs=max_num_reqs, max_num_blocks_per_req=width,
                          max_num_batched_tokens=max_tokens, pin_memory=False, device=torch.device("cpu"),
                          cp_kv_cache_interleave_size=1)

    return make, torch


@pytest.mark.parametrize("name", SMALL)
def test_slot_mapping_equals_vllms_kernel(name, vllm_block_table):
    make, torch = vllm_block_table
    trace = Trace(TRACES / name)
    h = trace.header
    dumps: list = []
    replay(trace, ReplayConfig(write_kv=False, nvtx=False), on_mappings=dumps.append)
    steps = 0
    for g, grp in enumerate(h.kv_cache_groups):
        width = -(-(h.max_model_len + h.num_speculative_tokens) // grp.block_size)
        bt = make(grp.block_size, h.max_num_seqs, width, h.max_num_batched_tokens)
        for d in dumps:
            B, T = len(d["req_ids"]), len(d["positions"])
            if not B:
                continue
            for b, row in enumerate(d["block_tables"][g]):  # V1: the batch row is the table row
                bt.add_row(row, b)
            bt.commit_block_table(B)
            bt.compute_slot_mapping(B, torch.tensor(d["query_start_loc"], dtype=torch.int32),
                                    torch.tensor(d["positions"], dtype=torch.int64))
            assert bt.slot_mapping.gpu[:T].tolist() == d["slot_mapping"][g], f"step {d['step']}, group {g}"
            assert (bt.slot_mapping.gpu[T:] == -1).all()  # padded from the actual count
            steps += 1
    assert steps > 0
