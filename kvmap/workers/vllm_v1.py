"""The `vllm-v1` backend: the V1 model runner's own input preparation (vLLM's code, not kvmap's) run on a trace.

Rules:
- vLLM computes every index: `GPUModelRunner._update_states` (its persistent `InputBatch`: add, remove,
  condense, the attention backend's reorder when `--reorder-threshold` is given; `MultiGroupBlockTable.append_row`
  / `add_row`) and `GPUModelRunner._prepare_inputs` (`commit_block_table`, positions, `query_start_loc`,
  `seq_lens`, input ids from `token_ids_cpu`, `compute_slot_mapping`, `_calc_spec_decode_metadata`), called
  on a runner built with `object.__new__` holding only the buffers those methods read (as `__init__` makes
  them). The batch order is V1's own, whatever `--runner` says: compare with the reference's
  `--runner v1`. V1 has no request-state rows: the dump's `idx_mapping` labels are kvmap's rows.
- What the runner is given (vLLM loaded, the runner, each step's scheduler output, a v2-protocol preemption as
  V1's scheduler sends it) is vllm_v1_runner.py's.
- The host bookkeeping after the model (sampled ids into `token_ids_cpu` and `output_token_ids`) is
  `_bookkeeping_sync`'s, restated here: it needs the sampler's tensors to be called.
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
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np

from kvmap.forward import cudagraph as C
from kvmap.forward import graph_parts as gp
from kvmap.forward.config import ForwardConfig
from kvmap.forward.sampler import V1Sampler
from kvmap.layout import PAD_SLOT_ID
from kvmap.trace import Step
from kvmap.workers.host import HostWorker
from kvmap.workers.mappings import BatchTables, Inputs, RankSlots
from kvmap.workers.ops import MappingOps
from kvmap.workers.order import check_batch_order
from kvmap.workers.vllm_forward import forward_label
from kvmap.workers.vllm_v1_runner import load_v1, make_runner, scheduler_output


class V1Ops(MappingOps):
    """The mapping phases, each a call into the V1 runner (results copied to host numpy for the dump)."""

    def __init__(self, state, buffers, device: str = "cpu") -> None:
        super().__init__(state, buffers, device)
        self.version, self.torch_device = load_v1(state.header, device)
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
