"""The worker every built-in backend but the reference is: request state, input buffers and the phase order,
composed with one language's array functions; and the vectorized `numpy` backend.

Rules:
- `HostWorker` owns the long-lived `WorkerState` (request, token and block-table rows, kept on the host as the
  scheduler's record) apart from the per-step `InputBuffers`, both preallocated at maximum size, and runs the
  phases in the contract's order. A backend is a `HostWorker` configured with an ops class (workers/ops.py):
  `NumpyWorker` here, `NumbaWorker`, `TorchWorker`, `TritonWorker`, or a user's file. Nothing deeper.
- Host vs device is a copy step: device ops bring a `DeviceMirror` (workers/device.py), whose staged copy is
  the `h2d` phase and whose `to_host` brings the results back for `mappings()`.
- Under Model Runner V2 (`is_mrv2`) the gathered rows of sliding-window groups are nulled below the window
  (`ops.null_history`, layout.py's rule) after the gather; slots are read from the un-nulled state rows.
- Each mapping phase keeps what its ops function returns (`inputs`, `tables`, `kernel_tables`, `slots` or
  `rank_slots`); `mappings()` assembles them, copied to the host when the ops live on a device.
- The numpy phases are whole-array operations (workers/buffers.py): no per-token Python.
- `readable_context` is the host KV read-back's input: every (batch request, position, slot, token) this step
  may read, by the layout's window rule.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvmap.errors import TraceError
from kvmap.forward.config import ForwardConfig
from kvmap.forward.compiled import NumbaForward
from kvmap.forward.core import CoreArrays, from_mappings
from kvmap.forward.inputs import ForwardBuilder, ForwardStep
from kvmap.forward.sampler import SamplerRows, corrections
from kvmap.kv.cache import KVCheckResult, KVGeometry, PagedKVCache, RankedKVCache
from kvmap.layout import null_history_groups, rank_layouts, seq_layouts
from kvmap.trace import Step, TraceHeader
from kvmap.workers import buffers as B
from kvmap.workers.contract import StepBatch, Worker, make_rank_caches
from kvmap.workers.mappings import BatchMappings, BatchTables, Inputs, RankSlots
from kvmap.workers.ops import MappingOps
from kvmap.workers.state import WorkerState
from kvmap.workers.writes import ragged_columns


class HostWorker(Worker):
    """State and buffers in host memory, the phase order, and an `ops_class` for the array work."""

    ops_class: ClassVar[type[MappingOps]]  # the backend's array functions, built once per worker
    computes_forward = True
    numba_forward: ClassVar[bool] = False  # the forward parts' numba forms (forward/compiled.py) where written

    def __init__(self, header: TraceHeader, device: str = "cpu") -> None:
        super().__init__(header, device)
        self.state = WorkerState(header)
        self.buffers = B.InputBuffers(self.state, max(header.max_num_batched_tokens,
                                                      header.max_num_scheduled_tokens or 0))
        self.multirank = header.decode_context_parallel_size > 1
        self.kernel_split = header.has_kernel_split
        self._set_layouts()
        self.ops = self.ops_class(self.state, self.buffers, device)
        self.mirror = self.ops.mirror  # device backends: the device state and the step's copy (None on the host)
        self.backend_detail = self.ops.detail
        # this step's results, as the phases return them (valid until the next step)
        self.inputs: Inputs | None = None
        self.tables: BatchTables | None = None
        self.kernel_tables: list | None = None  # [G] x [num_reqs, W_g * k_g] (a kernel split only)
        self.slots = None  # [G, num_tokens] int64 (cp = 1)
        self.rank_slots: RankSlots | None = None  # (cp > 1)
        self._mappings: BatchMappings | None = None
        self.forward_builder: ForwardBuilder | None = None  # the forward parts' host forms (use_forward)
        self._no_drafts = np.zeros(header.max_num_seqs, dtype=np.int32)

    def set_ranks(self, ranks) -> None:
        super().set_ranks(ranks)
        self._set_layouts()

    def _set_layouts(self) -> None:
        h = self.header
        self.rank_layouts = rank_layouts(h, self.ranks)  # [num_ranks][G]
        self.layouts = self.rank_layouts[0]  # the first computed rank's (the only one when cp = 1)
        self.null_groups = null_history_groups(h)  # groups whose gathered rows MRV2 nulls below the window
        # dcp_local_seq_lens: one sharded layout per computed rank
        self.seq_layouts = seq_layouts(h, self.ranks)

    @property
    def num_standin_tokens(self) -> int:
        return self.state.num_standin_tokens

    # ------------------------------------------------------------------------------------------ phases

    def update_states(self, step: Step) -> None:
        T = step.scheduler_output.total_num_scheduled_tokens
        if T > self.buffers.max_num_tokens:
            raise TraceError(f"{T} tokens exceed the header's token budget {self.buffers.max_num_tokens}",
                             line=step.line, step=step.step, field="total_num_scheduled_tokens")
        req_ids, rows, counts, drafts = self.state.update(step)
        self.set_batch(StepBatch(step, req_ids, rows, counts, drafts, num_tokens=T))

    def set_batch(self, batch: StepBatch) -> None:
        """Start a step from a batch directly (benchmarks: synthetic batches over state they wrote)."""
        self.batch = batch
        self._mappings = None
        self.forward = None

    def schedule(self, rows: list[int], counts: list[int], req_ids: list[str] | None = None) -> StepBatch:
        """A synthetic batch without drafts, in scheduler order (benchmarks)."""
        r = np.array(rows, dtype=np.int32)
        c = np.array(counts, dtype=np.int32)
        # T: host workers count it in prepare_inputs; device workers need it first (a trace carries it)
        T = int(c.sum()) if self.has_h2d else 0
        batch = StepBatch(None, req_ids, r, c, self._no_drafts[: len(r)], num_tokens=T)
        self.set_batch(batch)
        return batch

    def prepare_batch(self) -> None:
        """The batch order: V1's persistent batch when asked for, else Model Runner V2's (the ops' form)."""
        b = self.batch
        if self.v1_batch is None:
            b.order = self.ops.batch_order(b.num_scheduled_tokens, b.num_draft_tokens,
                                           self.header.num_speculative_tokens)
            return
        entry = {r: i for i, r in enumerate(b.req_ids)}
        order = self.v1_order(b.step)
        b.order = np.fromiter(map(entry.__getitem__, order), np.int32, len(order))

    def copy_to_device(self) -> None:
        if self.mirror is not None:  # host backends have nothing to send
            self.mirror.copy_to_device(self.batch)

    def prepare_inputs(self) -> None:
        b = self.batch
        self.inputs = i = self.ops.prepare_inputs(b)
        b.num_tokens = len(i.positions)

    def gather_block_tables(self) -> None:
        t = self.ops.gather_block_tables(self.inputs)
        if self.null_groups and self.is_mrv2:  # Model Runner V2 nulls sliding-window history (V1 does not)
            t = self.ops.null_history(t, self.inputs, self.null_groups)
        self.tables = t
        if self.kernel_split:
            self.kernel_tables = self.ops.kernel_block_tables(t, self.layouts)

    def compute_slot_mappings(self) -> None:
        if self.multirank:
            self.rank_slots = self.ops.compute_rank_slot_mappings(self.inputs, self.rank_layouts, self.seq_layouts)
        else:
            self.slots = self.ops.compute_slot_mappings(self.inputs)

    def use_forward(self, config: ForwardConfig) -> None:
        super().use_forward(config)
        self.forward_builder = ForwardBuilder(config, self.buffers.max_num_tokens)
        self.forward_pass = None  # the numba worker's one-pass builder (forward/compiled.py), on host arrays
        if self.numba_forward and self.mirror is None:
            self.forward_pass = NumbaForward(config, self.buffers.max_num_tokens)

    def prepare_forward(self) -> None:
        """The forward inputs by the numpy forms on the host mappings (device backends: host copies of theirs,
        as `mappings()` makes them; device forms are not written yet), or by the numba worker's one pass over
        the same arrays."""
        fp = self.forward_pass
        if fp is None:
            self.forward = self.forward_builder.host(self.forward_step())
            return
        st, b, i = self.state, self.batch, self.inputs
        drafts, spec = self._drafts()
        if self.multirank:  # DCP: the first computed rank's, as the step's BatchMappings give them
            c = from_mappings(self.mappings())
            core = (c.slot_mapping, c.positions, c.tables, c.rank)
        else:
            core = (self.slots, i.positions, self._own_tables(), 0)
        self.forward = fp.run((i.query_start_loc, i.num_computed_tokens, i.idx_mapping, i.seq_lens, drafts, spec,
                               st.prefill_len, st.num_prompt_tokens, corrections(b.step, b.batch_req_ids)) + core,
                              self.forward_step)

    def forward_step(self) -> ForwardStep:
        """This step's rows as the forward parts read them: the inputs (host arrays: this worker's own, or the
        mappings' host copies on a device) and the request-state rows the rules read."""
        st, b = self.state, self.batch
        i = self.inputs if self.mirror is None else self.mappings()
        drafts, spec = self._drafts()
        rows = SamplerRows(i.idx_mapping, i.query_start_loc, i.seq_lens, i.num_computed_tokens, drafts,
                           st.prefill_len, st.num_prompt_tokens, i.input_ids, spec,
                           corrections(b.step, b.batch_req_ids))
        core = None  # the numba parts' core arrays: this worker's own (a device's, DCP's, the others': mappings())
        if self.numba_forward and self.mirror is None and not self.multirank:
            core = CoreArrays(self.slots, i.positions, self._own_tables(), 0)
        return ForwardStep(rows, self.mappings, self.last_sampled_tokens, core=core)

    def _drafts(self) -> tuple[np.ndarray, bool]:
        """([R] int32 num_draft_tokens in batch order, has_drafts: the step schedules drafts, MRV2's test); a step
        without drafts gives the zeros in any order."""
        b = self.batch
        spec = b.step is None or bool(b.step.scheduler_output.scheduled_spec_decode_tokens)
        return (b.num_draft_tokens[b.order] if spec else b.num_draft_tokens), spec

    def _own_tables(self) -> list:
        """[G] x [R, W_g] int32 this worker's gathered tables as the attention builders get them (the kernel
        tables under a kernel split)."""
        return self.kernel_tables if self.kernel_split else self.tables.block_tables

    def last_sampled_tokens(self) -> np.ndarray:
        """[max_num_seqs] int32, req_state_idx -> the last known token of its row (MRV2's last_sampled_tokens)."""
        st = self.state
        return st.token_ids[np.arange(st.max_num_reqs), np.maximum(st.total_len - 1, 0)]

    def append_sampled(self) -> None:
        b = self.batch
        assert b is not None and b.step is not None
        self.state.append_sampled(b.step, b.req_ids, b.rows)

    # ------------------------------------------------------------------------------------------ device

    def upload_state(self) -> None:
        """Send the whole host state at once (device backends; benchmarks that wrote the host arrays)."""
        if self.mirror is not None:
            self.mirror.upload()

    @property
    def h2d_bytes(self) -> int:
        return 0 if self.mirror is None else self.mirror.staging.bytes_sent

    def synchronize(self) -> None:
        if self.mirror is not None:
            self.mirror.synchronize()

    # ---------------------------------------------------------------------------------------- KV cache

    def make_kv_cache(self, geometry: KVGeometry) -> PagedKVCache:
        return make_rank_caches(self, geometry, self.ops.new_kv_cache)

    def write_kv(self, kv: PagedKVCache | RankedKVCache) -> None:
        self.ops.write_kv(self, kv)

    def verify_kv(self, kv: PagedKVCache | RankedKVCache, into: KVCheckResult) -> None:
        self.ops.verify_kv(self, kv, into)

    def readable_context(self, group: int, rank_index: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                           np.ndarray]:
        """(batch_idx, position, slot, token id) arrays over every position this step's requests may read that
        the `rank_index`-th computed DCP rank holds (every position when cp = 1)."""
        lay = self.rank_layouts[rank_index][group]
        m, st = self.mappings(), self.state
        n = self.batch.num_reqs
        idx = m.idx_mapping[:n].astype(np.int64)
        nc = m.num_computed_tokens[:n].astype(np.int64)
        hi = m.seq_lens[:n].astype(np.int64)
        lo = lay.readable_lo(nc)
        counts = hi - lo
        breq = np.repeat(np.arange(n), counts)
        pos = ragged_columns(lo, counts)
        if lay.cp_size > 1:
            keep = lay.local_mask(pos)
            breq, pos = breq[keep], pos[keep]
        rows = idx[breq]
        blocks = st.block_tables[group][rows, pos // lay.virtual_block_size]
        return breq, pos, lay.slots(blocks, pos), st.token_ids[rows, pos]

    # ----------------------------------------------------------------------------------------- results

    def mappings(self) -> BatchMappings:
        """This step's kept results as one `BatchMappings` (host copies when the ops run on a device: for dumps
        and checks only, it synchronizes)."""
        if self._mappings is None:
            self._mappings = self._collect(_same if self.mirror is None else self.mirror.to_host)
        return self._mappings

    def _collect(self, host) -> BatchMappings:
        i, t = self.inputs, self.tables
        m = BatchMappings(
            req_ids=self.batch.batch_req_ids(),
            idx_mapping=host(i.idx_mapping).astype(np.int32, copy=False),
            num_scheduled_tokens=host(i.num_scheduled_tokens),
            num_computed_tokens=host(i.num_computed_tokens),
            query_start_loc=host(i.query_start_loc),
            seq_lens=host(i.seq_lens),
            positions=host(i.positions),
            input_ids=host(i.input_ids),
            block_tables=[host(x) for x in t.block_tables],
            num_blocks=host(t.num_blocks),
            slot_mapping=None if self.multirank else host(self.slots),
        )
        if self.multirank:
            m.cp_size, m.ranks = self.header.decode_context_parallel_size, self.ranks
            m.rank_slot_mapping = host(self.rank_slots.rank_slot_mapping)
            m.slot_mapping = m.rank_slot_mapping[0]
            m.dcp_local_seq_lens = host(self.rank_slots.dcp_local_seq_lens)
        if self.kernel_split:
            m.kernel_block_tables = [host(x) for x in self.kernel_tables]
            m.kernel_blocks_per_block = self.buffers.kernel_blocks_per_block
        return m


def _same(x):
    return x


class NumpyOps(MappingOps):
    """The vectorized CPU mapping phases: numpy on the preallocated buffers (workers/buffers.py)."""

    def prepare_inputs(self, batch: StepBatch) -> Inputs:
        return B.build_inputs(self.state, self.buffers, batch.rows, batch.num_scheduled_tokens, batch.order)

    def gather_block_tables(self, inputs: Inputs) -> BatchTables:
        return B.gather_block_tables(self.state, self.buffers, len(inputs.idx_mapping))

    def kernel_block_tables(self, tables: BatchTables, layouts) -> list:
        return B.kernel_block_tables(self.buffers, layouts, len(tables.num_blocks[0]))

    def compute_slot_mappings(self, inputs: Inputs) -> np.ndarray:
        return B.compute_slot_mappings(self.state, self.buffers, len(inputs.idx_mapping), len(inputs.positions))

    def compute_rank_slot_mappings(self, inputs: Inputs, rank_layouts, seq_layouts) -> RankSlots:
        n, T = len(inputs.idx_mapping), len(inputs.positions)
        return RankSlots(B.compute_rank_slot_mappings(self.state, self.buffers, rank_layouts, n, T),
                         B.dcp_local_seq_lens(self.buffers, seq_layouts, n))


class NumpyWorker(HostWorker):
    """The vectorized CPU worker: numpy on preallocated buffers, no per-token Python."""

    name = "numpy"
    ops_class = NumpyOps
