"""The `vllm-mrv2` backend: Model Runner V2's own input preparation (vLLM's code, not kvmap's) run on a trace.

Rules:
- Every index is computed by vLLM: the runner's own methods on a runner built with `object.__new__`
  (`finish_requests`, `add_requests`, `update_requests`, `gather_batch_req_state` with its batch sort,
  `prepare_inputs` with `prepare_prefill_inputs`, `prepare_pos_seq_lens`, `combine_sampled_and_draft_tokens`,
  `expand_idx_mapping`, `postprocess_sampled` with `post_update`), its `RequestState` (free-row LIFO, staged
  writes) and `BlockTables` (`append_block_ids`, the gather and slot-mapping kernels), and
  `prepare_dcp_local_seq_lens`. What the runner is given (vLLM loaded, the runner, each step's scheduler output
  under the v2 protocol) is vllm_mrv2_runner.py's.
- kvmap's own `WorkerState` runs beside it only to check the trace (one located error for bad input) and to
  read back the KV cache (`--verify-kv`); it feeds vLLM nothing.
- What the model would have produced comes from the trace: sampled tokens go through `postprocess_sampled`
  after each step (`num_rejected` by vLLM's `get_num_sampled_and_rejected`), drafts into
  `req_states.draft_tokens` before it (what the speculator writes), the real drafts under async scheduling.
- Differences from a serving runner, none of which moves an index: no request padding without `--forward`
  (an eager batch descriptor); the gathered block tables are vLLM's own gather's rows, with MRV2's
  sliding-window nulling (`sliding_window_reach` from vLLM's `SlidingWindowSpec`; off when DCP > 1);
  kernel-block rows (a kernel split) are kvmap's layout rule; token rows are wider (vllm_mrv2_runner.py).
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
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kvmap import vllm_compat
from kvmap.errors import KvmapError
from kvmap.forward import cudagraph as C
from kvmap.forward import graph_parts as gp
from kvmap.forward.config import ForwardConfig
from kvmap.forward.sampler import MRV2Sampler
from kvmap.trace import Step
from kvmap.workers.host import HostWorker
from kvmap.workers.mappings import BatchTables, Inputs, RankSlots
from kvmap.workers.ops import MappingOps
from kvmap.workers.vllm_forward import forward_label
from kvmap.workers.vllm_mrv2_runner import load_vllm, make_runner, scheduler_output


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
