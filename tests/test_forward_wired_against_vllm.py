"""`replay --forward`'s dump (the numpy worker, kvmap/forward/graph_parts.py) equals vLLM 0.33's own code, step by
step, on every bundled trace, both runners and three CUDA-graph configurations (eager, FULL_AND_PIECEWISE and
FULL_DECODE_ONLY with vLLM's default sizes), every group under FlashInfer:
- `cudagraph_mode`, `num_tokens_padded`, `num_reqs_padded`: V1 `CudagraphDispatcher`, MRV2 `CudaGraphManager` +
  `dispatch_cg_and_sync_dp` (test_forward_metadata_against_vllm.py's stand-ins);
- `num_decodes`, `num_decode_tokens`, `num_prefills`, `num_prefill_tokens`, `paged_kv_indptr`,
  `paged_kv_indices`, `paged_kv_last_page_len`: `FlashInferMetadataBuilder.build` over the step's
  CommonAttentionMetadata (chunked_local groups: `make_local_attention_virtual_batches` first; the steps whose
  virtual batches overflow vLLM's buffers, vllm#49980, are left out).
The module's other tests hold kvmap's CommonAttentionMetadata to vLLM's. Runs where vLLM is installed.
"""

from __future__ import annotations

import importlib.util

import pytest

from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace

from .conftest import TRACES, bundled_traces

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
if importlib.util.find_spec("vllm") is not None:
    from .test_forward_metadata_against_vllm import (  # noqa: F401 (the fixtures vllm, vllm_attn, vllm_fi)
        LONG_STEPS, _rebind, mrv2_manager, steps_with_metadata, v1_dispatcher, vllm, vllm_attn, vllm_cm, vllm_config,
        vllm_dispatch, vllm_fi)

TRACE_NAMES = [p.name for p in bundled_traces()]
MODES = ["NONE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"]


def forward_dumps(name: str, runner: str, mode: str) -> dict[int, dict]:
    got: list[dict] = []
    stop = LONG_STEPS if name.endswith(".gz") else None
    replay(Trace(TRACES / name), ReplayConfig(backend="numpy", forward=True, batch_order=runner, nvtx=False, warmup=0,
                                              write_kv=False, stop=stop, attention_backend="FLASHINFER",
                                              cudagraph_mode=mode, cudagraph_capture_sizes="default"),
           on_mappings=got.append)
    return {d["step"]: d for d in got}


@pytest.mark.parametrize("runner", ["mrv2", "v1"])
@pytest.mark.parametrize("name", TRACE_NAMES)
def test_forward_dump_equals_vllms(name, runner, vllm, vllm_fi):  # noqa: F811
    A, fi = vllm_fi
    counted = 0
    stride = 8 if name.endswith(".gz") else 1  # the interpreted page-copy kernel is slow on long batches
    for mode in MODES:
        dumps = forward_dumps(name, runner, mode)
        disp = None
        builders: dict = {}
        for h, b, _desc, _tails, cms in steps_with_metadata(name, runner, mode, stride):
            k = h.num_speculative_tokens
            if disp is None:
                cfg = vllm_config(vllm, h, mode, runner)
                disp = v1_dispatcher(vllm, cfg) if runner == "v1" else mrv2_manager(vllm, cfg)
            d = dumps[b.step]
            where = f"{name} {runner} {mode} step {b.step}"
            assert (d["cudagraph_mode"], d["num_tokens_padded"], d["num_reqs_padded"]) == \
                vllm_dispatch(vllm, runner, disp, b, k), where
            for g, (grp, cm) in enumerate(zip(h.kv_cache_groups, cms)):
                if grp.kind == "mamba":
                    assert d["paged_kv_indptr"][g] is None, where
                    continue
                page = grp.kernel_block_size or grp.block_size
                vcm = vllm_cm(cm, A.torch, A.CM)
                if grp.kind == "chunked_local":
                    vcm, _ = A.bu.make_local_attention_virtual_batches(grp.attention_chunk_size, vcm, page)
                    if vcm.num_reqs > h.max_num_seqs:  # vllm#49980: vLLM's builder overflows its buffers
                        continue
                    assert d["local_query_start_loc"][g] == vcm.query_start_loc_cpu.tolist(), where
                    assert d["local_seqused_k"][g] == vcm.seq_lens.tolist(), where
                B = builders[g, page] = _rebind(builders.get((g, page)), A, fi, h, page, h.cp_size, {})
                md = B.build(0, vcm)
                n = vcm.num_reqs
                want = {"num_decodes": md.num_decodes, "num_decode_tokens": md.num_decode_tokens,
                        "num_prefills": md.num_prefills, "num_prefill_tokens": md.num_prefill_tokens,
                        "paged_kv_indptr": B.paged_kv_indptr.np[: n + 1].tolist(),
                        "paged_kv_last_page_len": B.paged_kv_last_page_len.np[:n].tolist()}
                want["paged_kv_indices"] = B.paged_kv_indices[: want["paged_kv_indptr"][-1]].tolist()
                for key, value in want.items():
                    assert d[key][g] == value, f"{where} group {g}: {key}"
                counted += 1
    assert counted > 0
