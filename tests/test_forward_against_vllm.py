"""The forward pass's sampler indices (kvmap/forward/sampler.py) equal vLLM 0.33's own code, step by step, on every
bundled small trace, bit for bit (values and dtypes):

- Model Runner V2: vLLM's `prepare_prefill_inputs`, `combine_sampled_and_draft_tokens` and `expand_idx_mapping`
  Triton kernels (vllm/v1/worker/gpu/input_batch.py, run on CPU tensors under TRITON_INTERPRET=1) are fed kvmap's
  request-state rows (token rows, prefill_len, num_computed_tokens, the last sampled token, the drafts) and the
  batch's idx_mapping, query_start_loc, seq_lens; they must write kvmap's `logits_indices`,
  `expanded_idx_mapping`, `expanded_local_pos` and MRV2's input ids (-1 where neither kernel writes).
  `cu_num_logits` is numpy inside `prepare_inputs` (model_runner.py:1414-1441), transcribed below as vLLM writes
  it, since it cannot be called on its own.
- V1: `GPUModelRunner._calc_spec_decode_metadata` on a runner made with `object.__new__` (forward-pass.md 10.1)
  for traces with a speculative config; `num_decode_draft_tokens` and the no-spec `logits_indices` are inline in
  `_prepare_inputs` (gpu_model_runner.py:2188-2235), transcribed below.
Runs where vLLM is installed (CI's record environment); skipped elsewhere."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from kvmap.forward.config import resolve
from kvmap.forward.sampler import STALE_INPUT_ID, mrv2_input_ids_numpy
from kvmap.trace import Trace
from kvmap.workers.registry import make_worker

from .conftest import TRACES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
SMALL = sorted(p.name for p in TRACES.glob("*.jsonl"))


@pytest.fixture(scope="module")
def vllm_fns():
    import torch
    from vllm.v1.worker.gpu.input_batch import (combine_sampled_and_draft_tokens, expand_idx_mapping,
                                                prepare_prefill_inputs)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name, mod in list(sys.modules.items()):  # no accelerator: nothing is pinned
        if name.startswith("vllm") and mod is not None and mod.__dict__.get("PIN_MEMORY") is True:
            mod.PIN_MEMORY = False
    runner = object.__new__(GPUModelRunner)
    runner.arange_np = np.arange(1 << 16, dtype=np.int64)
    runner._arange_scratch = np.empty(1 << 16, dtype=np.int64)
    runner.device = torch.device("cpu")
    return SimpleNamespace(torch=torch, combine=combine_sampled_and_draft_tokens, expand=expand_idx_mapping,
                           prefill=prepare_prefill_inputs, runner=runner)


def _steps(name: str, runner: str):
    """(step, worker) after the forward phase of every step, kvmap's numpy worker."""
    t = Trace(TRACES / name)
    w = make_worker("numpy", t.header, batch_order=runner)
    w.use_forward(resolve(t.header, runner))
    for step in t.steps():
        w.run_step(step)
        if step.num_reqs:  # vLLM runs no forward pass for a step without requests
            yield step, w
        w.append_sampled()


def _mrv2_vllm(v, step, w):
    """vLLM's MRV2 kernels on this step: (cu_num_logits, logits_indices, expanded_idx_mapping, expanded_local_pos,
    input_ids)."""
    torch = v.torch
    fs = w.forward_step()
    r, st = fs.rows, w.state
    last_sampled = fs.last_sampled_tokens()
    R, T = len(r.idx_mapping), len(r.input_ids)
    k = max(w.header.num_speculative_tokens, 1)
    idx_mapping = torch.from_numpy(r.idx_mapping.astype(np.int64))
    qsl = torch.from_numpy(r.query_start_loc.copy())
    seq_lens = torch.from_numpy(r.seq_lens.copy())
    # model_runner.py:1414-1441, as written there
    if not step.scheduler_output.scheduled_spec_decode_tokens:
        cu_num_logits_np = np.arange(R + 1, dtype=np.int32)
        total = R
        expanded = (idx_mapping, torch.zeros(R, dtype=torch.int32))
    else:
        num_logits = r.num_draft_tokens + 1
        cu_num_logits_np = np.empty(R + 1, dtype=np.int32)
        cu_num_logits_np[0] = 0
        np.cumsum(num_logits, out=cu_num_logits_np[1:])
        total = int(cu_num_logits_np[-1])
        expanded = v.expand(idx_mapping, total, torch.from_numpy(cu_num_logits_np), 1 + k)
    # request-state rows, as MRV2's RequestState holds them
    input_ids = torch.full((T,), STALE_INPUT_ID, dtype=torch.int32)
    v.prefill(input_ids, torch.zeros(1, st.max_num_reqs, dtype=torch.int32), idx_mapping, qsl,
              torch.from_numpy(st.token_ids.copy()), torch.from_numpy(st.prefill_len.copy()),
              torch.from_numpy(st.num_computed_tokens.copy()))
    last = torch.zeros(st.max_num_reqs, 1, dtype=torch.int64)
    drafts = torch.zeros(st.max_num_reqs, k, dtype=torch.int64)
    for b in range(R):
        row, d, qe = int(r.idx_mapping[b]), int(r.num_draft_tokens[b]), int(r.query_start_loc[b + 1])
        last[row, 0] = int(last_sampled[row])
        drafts[row, :d] = torch.from_numpy(r.input_ids[qe - d: qe].astype(np.int64))  # kvmap stages them there
    logits = v.combine(input_ids, idx_mapping, last, qsl, seq_lens, torch.from_numpy(st.prefill_len.copy()), drafts,
                       torch.from_numpy(cu_num_logits_np), total, 1)
    ours = mrv2_input_ids_numpy(r, last_sampled, w.forward_builder.buffers[0])
    return cu_num_logits_np, logits.numpy(), expanded[0].numpy(), expanded[1].numpy(), input_ids.numpy(), ours


def _same(name, got, want) -> None:
    assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
    assert np.array_equal(got, want), (name, got.tolist(), want.tolist())


@pytest.mark.parametrize("name", SMALL)
def test_mrv2_sampler_equals_vllm_kernels(name, vllm_fns):
    n = 0
    for step, w in _steps(name, "mrv2"):
        m = w.forward.sampler
        cu, logits, exp_idx, exp_pos, ids, ours = _mrv2_vllm(vllm_fns, step, w)
        where = f"{name} step {step.step}"
        _same(f"{where} cu_num_logits", m.cu_num_logits, cu)
        _same(f"{where} logits_indices", m.logits_indices, logits)
        _same(f"{where} expanded_idx_mapping", m.expanded_idx_mapping, exp_idx)
        _same(f"{where} expanded_local_pos", m.expanded_local_pos, exp_pos)
        _same(f"{where} input_ids", ours, ids)
        n += 1
    assert n > 0


def _v1_vllm(v, step, w):
    """V1's sampler indices on this step: (logits_indices, SpecDecodeMetadata or None, num_decode_draft_tokens)."""
    torch = v.torch
    r = w.forward_step().rows
    R = len(r.idx_mapping)
    num_scheduled_tokens = np.diff(r.query_start_loc)
    if w.header.num_speculative_tokens == 0:  # gpu_model_runner.py:2189-2197
        return torch.from_numpy(r.query_start_loc)[1:] - 1, None, None
    # gpu_model_runner.py:2201-2226, with the batch's rows in place of input_batch.req_id_to_index
    row_of = {req_id: b for b, req_id in enumerate(w.mappings().req_ids)}
    num_draft_tokens = np.zeros(R, dtype=np.int32)
    num_decode_draft_tokens = np.full(R, -1, dtype=np.int32)
    for req_id, draft_token_ids in step.scheduler_output.scheduled_spec_decode_tokens.items():
        req_idx = row_of[req_id]
        draft_len = len(draft_token_ids)
        num_draft_tokens[req_idx] = draft_len
        if num_scheduled_tokens[req_idx] == draft_len + 1:
            num_decode_draft_tokens[req_idx] = draft_len
    zero_draft_decode_mask = (r.num_computed_tokens[:R] >= r.num_prompt_tokens[:R]) & (num_scheduled_tokens[:R] == 1)
    num_decode_draft_tokens[(num_decode_draft_tokens < 0) & zero_draft_decode_mask] = 0
    v.runner.input_ids = SimpleNamespace(gpu=torch.from_numpy(r.input_ids.copy()))
    sdm = v.runner._calc_spec_decode_metadata(num_draft_tokens, np.cumsum(num_scheduled_tokens, dtype=np.int64))
    return sdm.logits_indices, sdm, num_decode_draft_tokens


@pytest.mark.parametrize("name", SMALL)
def test_v1_sampler_equals_vllm(name, vllm_fns):
    n = 0
    for step, w in _steps(name, "v1"):
        got = w.forward.sampler
        logits, sdm, decode = _v1_vllm(vllm_fns, step, w)
        where = f"{name} step {step.step}"
        _same(f"{where} logits_indices", got.logits_indices, logits.numpy())
        if sdm is not None:
            assert got.num_draft_tokens.tolist() == sdm.num_draft_tokens, where
            for key in ("cu_num_draft_tokens", "cu_num_sampled_tokens", "target_logits_indices",
                        "bonus_logits_indices", "draft_token_ids"):
                _same(f"{where} {key}", getattr(got, key), getattr(sdm, key).numpy())
            _same(f"{where} num_decode_draft_tokens", got.num_decode_draft_tokens, decode)
        n += 1
    assert n > 0
