"""The `vllm-mrv2` backend: Model Runner V2's own input preparation (vLLM's code, not kvmap's) run on a trace.

Rules:
- Every index is computed by vLLM: the runner's own methods on a runner built with `object.__new__`
  (`finish_requests`, `add_requests`, `update_requests`, `gather_batch_req_state` with its batch sort,
  `prepare_inputs` with `prepare_prefill_inputs`, `prepare_pos_seq_lens`, `combine_sampled_and_draft_tokens`,
  `expand_idx_mapping`, `postprocess_sampled` with `post_update`), its `RequestState` (free-row LIFO, staged
  writes) and `BlockTables` (`append_block_ids`, the gather and slot-mapping kernels), and
  `prepare_dcp_local_seq_lens`. Features the trace does not use stay off (`None`: pooling, LoRA, encoder,
  pipeline, PCP, adaptive verification, fast prefill, sampler state).
- kvmap's own `WorkerState` runs beside it only to check the trace (one located error for bad input) and to
  read back the KV cache (`--verify-kv`); it feeds vLLM nothing.
- What the model would have produced comes from the trace: sampled tokens go through `postprocess_sampled`
  after each step (`num_rejected` by vLLM's `get_num_sampled_and_rejected`), drafts into
  `req_states.draft_tokens` before it (what the speculator writes), the real drafts under async scheduling.
- Differences from a serving runner, none of which moves an index: no request padding without `--forward`
  (an eager batch descriptor); the gathered block tables are the manager's rows (no sliding-window nulling:
  the dump compares block ids, the forward-pass table is the forward-pass dump's); kernel-block rows (a kernel
  split) are kvmap's layout rule; token rows are `max_model_len + k + 1` wide (sampled tokens never run off a row).
- With `--forward`, the `sampler` part is vLLM's: `cu_num_logits`, `logits_indices` (from
  `combine_sampled_and_draft_tokens`), `expanded_idx_mapping` and `expanded_local_pos` (from
  `expand_idx_mapping`, or `idx_mapping` and zeros on MRV2's no-draft path) of the `InputBatch` its
  `prepare_inputs` returned, copied to the host with their dtypes. The graph choice is vLLM's: its
  `CudaGraphManager` (candidates from the forward config's mode and capture sizes, answering as after capture)
  through `dispatch_cg_and_sync_dp` (one DP rank) with the uniform token count its `gather_batch_req_state`
  found, made before `prepare_inputs` and applied to the step as `execute_model` does (the InputBatch, gathered
  tables and slot mappings padded; the dump slices the unpadded rows and tokens). The `attention` part is
  `DefaultModelState.prepare_attn` over those, the FlashInfer metadata vLLM's builder's (vllm_forward.py, which
  says what stays kvmap's); the padded tails and an empty step's parts (vLLM builds no InputBatch for it) are
  kvmap's numpy forms (kvmap/forward), as `backend_detail` says. Nothing runs the model.
- DCP: one `BlockTables`; each computed rank's slots by the same kernel with that `cp_rank`.
- Runs natively on a GPU (`--device cuda`), else on host tensors under the Triton interpreter
  (`vllm_compat.prepare_cpu`). Model Runner V2 gets the v2 protocol: a v1-protocol preemption keeps the
  request (its row, as V1's worker does) and its resume comes as a new request with every token as prefill
  tokens, which `add_requests` frees and adds again (the row comes straight back).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kvmap import vllm_compat
from kvmap._torch import torch as kvmap_torch
from kvmap.errors import KvmapError, TraceError
from kvmap.forward import cudagraph as C
from kvmap.forward import graph_parts as gp
from kvmap.forward.config import ForwardConfig
from kvmap.forward.sampler import MRV2Sampler
from kvmap.trace import Step, TraceHeader
from kvmap.workers.host import HostWorker
from kvmap.workers.mappings import BatchTables, Inputs, RankSlots
from kvmap.workers.ops import MappingOps
from kvmap.workers.vllm_forward import forward_label


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


class MRV2Ops(MappingOps):
    """The mapping phases, each one call into Model Runner V2 (results copied to host numpy for the dump)."""

    detail = "vLLM Model Runner V2"

    def __init__(self, state, buffers, device: str = "cpu") -> None:
        super().__init__(state, buffers, device)
        h = state.header
        self.torch_device = load_vllm("vllm-mrv2", h, device)
        import torch

        self.torch = torch
        self.runner = make_runner(h, buffers.max_num_tokens, state.max_num_blocks, self.torch_device)
        self.detail = f"vLLM {vllm_compat.require('vllm-mrv2')} Model Runner V2 on {self.torch_device}" + (
            " (Triton interpreter)" if self.torch_device.type == "cpu" else "")
        self.so = None  # this step's scheduler output, as the runner reads it
        self.batch_state = None  # the runner's BatchReqState (batch order)
        self.uniform_token_count = None  # gather_batch_req_state's: tokens per request of a uniform decode, or None
        self.input_batch = None  # the runner's InputBatch
        self.graphs: VllmGraphDispatch | None = None  # with --forward: vLLM's graph choice, applied to the step
        self.desc = None  # this step's BatchExecutionDescriptor (None: eager, unpadded)
        self.tables = None  # [G] x [num_reqs_padded, W] the runner's gathered block tables (device)
        self.slots = None  # [G, num_tokens_padded] int64 the first computed rank's slot mappings (device)
        self.dcp_local = None  # [num_reqs_padded] int32 the first computed rank's dcp_local_seq_lens (device)

    def update(self, step: Step) -> None:
        """The runner's own state update (execute_model's first lines), then the drafts the speculator wrote."""
        r = self.runner
        self.so = so = scheduler_output(step, self.state.header.model_runner_protocol, r.req_states)
        r.finish_requests(so)
        r.add_requests(so)
        r.update_requests(so)
        r.block_tables.apply_staged_writes()
        spec = so.scheduled_spec_decode_tokens
        if spec:
            real = step.async_spec.spec_draft_token_ids if step.async_spec is not None else {}
            drafts = r.req_states.draft_tokens
            for req_id, d in spec.items():
                d = real.get(req_id, d)
                drafts[r.req_states.req_id_to_index[req_id], : len(d)] = self.torch.tensor(d, dtype=drafts.dtype)

    def order(self, req_ids: list[str]) -> np.ndarray:
        """[num_reqs] batch_idx -> scheduler entry, by the runner's `sort_batch_req_ids`."""
        if not req_ids:
            self.batch_state, self.uniform_token_count = None, None
            return np.zeros(0, dtype=np.int32)
        self.batch_state, self.uniform_token_count = self.runner.gather_batch_req_state(self.so, dummy_run=False)
        entry = {r: i for i, r in enumerate(req_ids)}
        return np.fromiter(map(entry.__getitem__, self.batch_state.req_ids), np.int32, len(req_ids))

    def prepare_inputs(self, batch) -> Inputs:
        if self.batch_state is None:
            z32, z64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
            self.input_batch = None
            self.desc = self.graphs.choose() if self.graphs is not None else None
            return Inputs(z32, z32, z32, np.zeros(1, np.int32), z32, z64, z32)
        T = self.batch_state.num_tokens
        self.desc = self.graphs.choose() if self.graphs is not None else None
        desc = self.desc or SimpleNamespace(num_tokens=T, num_reqs=None)  # eager: no padding
        self.input_batch = ib = self.runner.prepare_inputs(self.so, self.batch_state, desc, 0)
        n = ib.num_reqs
        seq_lens = _host(ib.seq_lens[:n])
        nst = ib.num_scheduled_tokens.astype(np.int32)
        return Inputs(ib.idx_mapping_np.astype(np.int32), nst, seq_lens - nst, _host(ib.query_start_loc[: n + 1]),
                      seq_lens, _host(ib.positions[:T]), _host(ib.input_ids[:T]))

    def gather_block_tables(self, inputs: Inputs) -> BatchTables:
        n = len(inputs.idx_mapping)
        bt = self.runner.block_tables
        if self.input_batch is None:
            return BatchTables([np.zeros((0, t.gpu.shape[1]), np.int32) for t in bt.block_tables],
                               np.zeros((bt.num_kv_cache_groups, 0), np.int32))
        ib = self.input_batch
        self.tables = bt.gather_block_tables(ib.idx_mapping, num_reqs_padded=ib.num_reqs_after_padding,
                                             num_computed_tokens=self.runner.req_states.num_computed_tokens.gpu)
        return BatchTables([_host(t[:n]) for t in self.tables], bt.num_blocks.np[:, ib.idx_mapping_np].copy())

    def null_history(self, tables: BatchTables, inputs: Inputs, groups) -> BatchTables:
        return tables  # vLLM's own gather nulled the sliding-window history (num_computed_tokens given)

    def _slots(self, T: int, first: bool) -> np.ndarray:
        """[G, T] this rank's slots (the kernel pads to the step's padded count; with --forward the first rank's
        are kept for the attention metadata)."""
        ib = self.input_batch
        s = self.runner.block_tables.compute_slot_mappings(ib.idx_mapping, ib.query_start_loc, ib.positions,
                                                           num_tokens_padded=ib.num_tokens_after_padding)
        if first and self.graphs is not None:
            self.slots = s.clone()
        return _host(s[:, :T])

    def compute_slot_mappings(self, inputs: Inputs) -> np.ndarray:
        T = len(inputs.positions)
        if self.input_batch is None:
            return np.zeros((self.runner.block_tables.num_kv_cache_groups, 0), np.int64)
        return self._slots(T, True)

    def compute_rank_slot_mappings(self, inputs: Inputs, rank_layouts, seq_layouts) -> RankSlots:
        from vllm.v1.worker.gpu.cp_utils import prepare_dcp_local_seq_lens

        r, ranks = self.runner, [max(lay.cp_rank for lay in lays) for lays in rank_layouts]  # a sharded group's rank
        n, T, G = len(inputs.idx_mapping), len(inputs.positions), r.block_tables.num_kv_cache_groups
        slots = np.zeros((len(ranks), G, T), np.int64)
        local = np.zeros((len(ranks), n), np.int32)
        ib = self.input_batch
        for i, rank in enumerate(ranks):
            if ib is None:
                continue
            r.block_tables.cp_rank = rank
            slots[i] = self._slots(T, i == 0)
            lens = prepare_dcp_local_seq_lens(r.input_buffers.dcp_local_seq_lens, ib.seq_lens, n, r.dcp_size, rank,
                                              r.cp_interleave, num_reqs_padded=ib.num_reqs_after_padding)
            if i == 0 and self.graphs is not None:
                self.dcp_local = lens.clone()
            local[i] = _host(lens[:n])
        r.block_tables.cp_rank = 0
        return RankSlots(slots, local)

    def sampler(self) -> MRV2Sampler | None:
        """The sampler part as vLLM's `prepare_inputs` built it into its InputBatch (None: an empty step)."""
        ib = self.input_batch
        if ib is None:
            return None
        return MRV2Sampler(_host(ib.cu_num_logits), _host(ib.logits_indices), _host(ib.expanded_idx_mapping),
                           _host(ib.expanded_local_pos))

    def postprocess(self, step: Step) -> None:
        """After the model: the sampled tokens through the runner's `postprocess_sampled` (post_update)."""
        from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected

        ib, torch = self.input_batch, self.torch
        if ib is None:
            return
        sampled = step.sampled_token_ids or {}
        width = 1 + self.state.header.num_speculative_tokens
        toks = np.zeros((ib.num_reqs, width), np.int64)
        num = np.zeros(ib.num_reqs, np.int32)
        for b, req_id in enumerate(ib.req_ids):
            s = sampled.get(req_id, [])
            toks[b, : len(s)] = s
            num[b] = len(s)
        dev = self.torch_device
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            torch.from_numpy(num).to(dev), ib.seq_lens, ib.cu_num_logits, ib.idx_mapping,
            self.runner.req_states.prefill_len.gpu)
        self.runner.postprocess_sampled(ib.idx_mapping, torch.from_numpy(toks).to(dev), num_sampled, num_rejected,
                                        ib.query_start_loc)


class VllmGraphDispatch:
    """The `cudagraph` part's buffers (graph_parts.PaddingBuffers' fields) with vLLM's own dispatch: a Model
    Runner V2 `CudaGraphManager` built with `object.__new__` for the forward config's mode and capture sizes
    (as after capture: nothing is captured), asked through `dispatch_cg_and_sync_dp` on one DP rank."""

    def __init__(self, cfg: ForwardConfig, ops: MRV2Ops) -> None:
        from kvmap.workers.vllm_forward import forward_vllm_config, mrv2_manager

        self.ops = ops
        self.sizes = gp.capture_sizes(cfg)  # the configured sizes (the header's or --cudagraph-capture-sizes)
        self.manager = mrv2_manager(forward_vllm_config(cfg))
        self.dispatcher = self  # graph_parts.cudagraph_host calls `buf.dispatcher.dispatch`

    def choose(self):
        """vLLM's choice for this step (`BatchExecutionDescriptor`), from the runner's own batch state: its
        uniform token count and, without a prefill, the step's longest query."""
        from vllm.v1.worker.gpu.dp_utils import dispatch_cg_and_sync_dp

        st = self.ops.batch_state  # None: an empty step
        R, T = (len(st.req_ids), st.num_tokens) if st is not None else (0, 0)
        max_q = None if st is not None and st.has_prefill else int(st.num_scheduled_tokens.max()) if R else 0
        desc, _ = dispatch_cg_and_sync_dp(self.manager, R, T, self.ops.uniform_token_count, dp_size=1, dp_rank=0,
                                          max_query_len=max_q)
        return desc

    def dispatch(self, R: int, T: int, max_q: int, eligible: bool) -> C.BatchDescriptor:
        """The step's choice (`choose`, applied by `MRV2Ops.prepare_inputs`) in kvmap's form (`eligible`, kvmap's
        reading, is unused: vLLM's own uniform token count carries it)."""
        desc = self.ops.desc
        utc = self.ops.uniform_token_count
        return C.BatchDescriptor(desc.cg_mode.name, T, R, max(T, desc.num_tokens), desc.num_reqs or R,
                                 utc is not None)


def _host(t) -> np.ndarray:
    return t.cpu().numpy().copy()


class VllmMRV2Worker(HostWorker):
    """kvmap's worker shell (trace checks, phase order, KV read-back) around Model Runner V2's own code."""

    name = "vllm-mrv2"
    ops_class = MRV2Ops

    def use_batch_order(self, name: str, reorder_batch_threshold: int | None = None) -> None:
        if name != "mrv2":
            raise KvmapError("the vllm-mrv2 backend runs Model Runner V2's own batch order; --runner v1 is "
                             "the vllm-v1 backend's", field="--runner")

    def update_states(self, step: Step) -> None:
        super().update_states(step)  # kvmap's checks: one located error for bad input
        self.ops.update(step)

    def prepare_batch(self) -> None:
        self.batch.order = self.ops.order(self.batch.req_ids)

    def use_forward(self, config: ForwardConfig) -> None:
        from kvmap.workers.vllm_forward import VllmAttentionParts

        super().use_forward(config)
        self.graphs = self.ops.graphs = VllmGraphDispatch(config, self.ops)
        self.vllm_parts = VllmAttentionParts(config, self.header, self.ops.torch_device)
        native = ["sampler", "cudagraph", "attention"] + (["backends"] if self.vllm_parts.native_backends else [])
        self.native_forward_parts = tuple(native)
        self.backend_detail = self.ops.detail + forward_label(self.native_forward_parts, self.vllm_parts.note())

    def prepare_forward(self) -> None:
        """The sampler part from vLLM's InputBatch, the graph choice from vLLM's dispatch (applied to the
        step), the attention part from vLLM's `prepare_attn`, the FlashInfer metadata from vLLM's builder; the
        padded tails and the other backends' metadata by kvmap's numpy forms."""
        step = self.forward_step()
        s = self.ops.sampler()
        if s is not None:
            step.parts["sampler"] = s
        step.parts["cudagraph"] = gp.cudagraph_host(self.forward_config, step, self.graphs)
        if self.ops.input_batch is not None:
            step.parts["attention"] = self.vllm_parts.attention(step, self.attn_metadata())
            step.parts["backends"] = self.vllm_parts.backends(step)
        self.forward = self.forward_builder.host(step)

    def attn_metadata(self) -> dict:
        """Model Runner V2's `prepare_attn` over this step's InputBatch, gathered tables (under a kernel split
        kvmap's kernel rows: the backend runs the manager's block size) and the first computed rank's slots."""
        from kvmap.workers.vllm_forward import kernel_tables, mrv2_prepare_attn

        ops = self.ops
        ib = ops.input_batch
        tables = tuple(kernel_tables(self, ib.num_reqs_after_padding) if self.kernel_split else ops.tables)
        if ops.dcp_local is not None:
            ib.dcp_local_seq_lens = ops.dcp_local
        return mrv2_prepare_attn(ib, ops.desc.cg_mode, tables, ops.slots, self.vllm_parts.attn_groups)

    def append_sampled(self) -> None:
        super().append_sampled()
        self.ops.postprocess(self.batch.step)
