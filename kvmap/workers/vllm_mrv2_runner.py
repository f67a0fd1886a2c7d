"""What the `vllm-mrv2` backend gives Model Runner V2: vLLM loaded for it, the runner itself (no model, no CUDA
graph) and each step's scheduler output in the shape the runner reads.

Rules:
- The runner is built with `object.__new__` holding only the state input preparation reads: its `RequestState`,
  `InputBuffers` and `BlockTables` as `__init__` makes them (the sliding-window reach vLLM's own
  `SlidingWindowSpec.num_retained_tokens`). Features the trace does not use stay off (`None`: pooling, LoRA,
  encoder, pipeline, PCP, adaptive verification, fast prefill, sampler state; the model and LoRA states answer
  every hook with a no-op). Token rows are `max_model_len + k + 1` wide (sampled tokens never run off a row).
- Runs natively on a GPU (`--device cuda`), else on host tensors under the Triton interpreter
  (`vllm_compat.prepare_cpu`). Model Runner V2 gets the v2 protocol: a v1-protocol preemption keeps the
  request (its row, as V1's worker does) and its resume comes as a new request with every token as prefill
  tokens, which `add_requests` frees and adds again (the row comes straight back); a resume without its
  tokens in `all_token_ids` is a located error.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvmap import vllm_compat
from kvmap._torch import torch as kvmap_torch
from kvmap.errors import TraceError
from kvmap.trace import Step, TraceHeader


def load_vllm(backend: str, header: TraceHeader, device: str):
    """Check the installed vLLM and the trace's version; prepare the CPU path; return the torch device."""
    v = vllm_compat.require(backend)
    vllm_compat.check_trace_version(header, v)
    torch = kvmap_torch()  # one intra-op thread (vLLM's CPU kernels too: OpenMP)

    if device == "cpu":  # host tensors: the Triton interpreter (also on a GPU machine)
        vllm_compat.check_interpreter_mrv2(header)
        vllm_compat.prepare_cpu()
    elif device.startswith("cuda"):
        vllm_compat.prepare_gpu()
    return torch.device(device)


class _Off:
    """A runner part the trace does not use: every hook is a no-op."""

    num_new_sampled_tokens_per_step = 1

    def __getattr__(self, name):
        return _noop


def _noop(*args, **kwargs):
    return None


def make_runner(header: TraceHeader, max_num_tokens: int, max_num_blocks: list[int], device):
    """A Model Runner V2 with only the state input preparation reads (object.__new__, no model, no CUDA graph)."""
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.input_batch import InputBuffers
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.states import RequestState

    k = header.num_speculative_tokens
    R = header.max_num_seqs
    r = object.__new__(GPUModelRunner)
    groups = header.kv_cache_groups
    r.__dict__.update(
        device=device, max_num_reqs=R, max_num_tokens=max_num_tokens, max_model_len=header.max_model_len,
        decode_query_len=1 + k, use_pp=False, is_last_pp_rank=False, sampler=None, pooling_runner=None,
        pp_handler=None, encoder_cache=None, prompt_logprobs_worker=None, adaptive_verification=None,
        pcp_manager=None, fast_prefill=None, kv_block_zeroer=None, model_config=SimpleNamespace(rswa_window=None),
        model_state=_Off(), lora_state=_Off(),
        dcp_size=header.decode_context_parallel_size, dcp_rank=0, cp_interleave=header.cp_kv_cache_interleave_size,
        req_states=RequestState(R, header.max_model_len + k + 1, max_num_tokens, k, 1, device),
        input_buffers=InputBuffers(R, max_num_tokens, device),
        block_tables=BlockTables(
            block_sizes=[g.block_size for g in groups], max_num_reqs=R, max_num_batched_tokens=max_num_tokens,
            max_num_blocks_per_group=list(max_num_blocks), device=device,
            slot_mapping_enabled=[g.uses_slot_mapping for g in groups], dcp_sharded=[g.dcp_sharded for g in groups],
            cp_size=header.decode_context_parallel_size, cp_rank=0, cp_interleave=header.cp_kv_cache_interleave_size,
            sliding_window_reach=_sliding_window_reach(groups)),
    )
    return r


def _sliding_window_reach(groups) -> list[int]:
    """Per group, vLLM's own `SlidingWindowSpec.num_retained_tokens` (0 for other kinds), as model_runner.py
    builds `sliding_window_reach`: the gather then nulls the history itself (BlockTables disables it when cp > 1)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    import torch

    reach = []
    for g in groups:
        if g.kind != "sliding_window":
            reach.append(0)
            continue
        spec = SlidingWindowSpec(block_size=g.block_size, num_kv_heads=1, head_size=1, dtype=torch.float16,
                                 sliding_window=g.sliding_window, extra_retained_tokens=g.extra_retained_tokens)
        reach.append(spec.num_retained_tokens)
    return reach


def scheduler_output(step: Step, protocol: str, req_states):
    """The trace's scheduler output in the shape the runner reads (vLLM's SchedulerOutput fields). A v1-protocol
    preemption is not passed on (V1's worker keeps the request for its resume, so Model Runner V2 keeps it too), and
    the resume reaches Model Runner V2 as a v2-protocol one: a new request with every token as prefill tokens
    (`all_token_ids`), its original `prompt_len` (`req_states`: the runner's) and the replacement row;
    `add_requests` frees the live id and adds it again, so the freed row comes straight back."""
    so = step.scheduler_output
    c = so.scheduled_cached_reqs
    new = [SimpleNamespace(
        req_id=nr.req_id, prompt_token_ids=nr.prompt_token_ids, prompt_len=len(nr.prompt_token_ids),
        prefill_token_ids=nr.prefill_token_ids if nr.prefill_token_ids is not None else nr.prompt_token_ids,
        num_computed_tokens=nr.num_computed_tokens, block_ids=tuple(nr.block_ids), sampling_params=None,
        pooling_params=None, mm_features=[], lora_request=None) for nr in so.scheduled_new_reqs]
    keep = [i for i, r in enumerate(c.req_ids) if r not in c.resumed_req_ids]
    for i, r in enumerate(c.req_ids):
        if r not in c.resumed_req_ids:
            continue
        if r not in c.all_token_ids:
            raise TraceError("resumed without its tokens in all_token_ids: Model Runner V2 re-adds a resumed "
                             "request with every token as prefill tokens", line=step.line, step=step.step,
                             req_id=r, field="scheduled_cached_reqs.all_token_ids", kind="schema")
        toks = list(c.all_token_ids[r])
        prompt_len = int(req_states.prompt_len.np[req_states.req_id_to_index[r]])
        new.append(SimpleNamespace(
            req_id=r, prompt_token_ids=toks[:prompt_len], prompt_len=prompt_len, prefill_token_ids=toks,
            num_computed_tokens=c.num_computed_tokens[i], block_ids=tuple(c.new_block_ids[i]), sampling_params=None,
            pooling_params=None, mm_features=[], lora_request=None))
    cached = SimpleNamespace(req_ids=[c.req_ids[i] for i in keep],
                             num_computed_tokens=[c.num_computed_tokens[i] for i in keep],
                             new_block_ids=[None if c.new_block_ids[i] is None else tuple(c.new_block_ids[i])
                                            for i in keep])
    return SimpleNamespace(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=so.num_scheduled_tokens,
        total_num_scheduled_tokens=so.total_num_scheduled_tokens,
        scheduled_spec_decode_tokens=so.scheduled_spec_decode_tokens, finished_req_ids=set(so.finished_req_ids),
        preempted_req_ids=set(so.preempted_req_ids) if protocol == "v2" else set(), new_block_ids_to_zero=None,
        kv_cache_block_copies=None, has_structured_output_requests=False, free_encoder_mm_hashes=[])
