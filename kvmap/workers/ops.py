"""The per-language array functions a `HostWorker` runs its mapping phases with: the interface and its host
defaults.

Rules:
- A backend is one `MappingOps` (numpy, numba, torch, Triton, or a user's file) composed into a `HostWorker`;
  the worker owns the request state (`WorkerState`), the input buffers and the phase order, the ops own the
  array work. An ops object holds no per-step results: each phase function returns what it computed (this
  step's slices, as Model Runner V2's `BlockTables.compute_slot_mappings` returns `slot_mapping[:, :T]`), and
  the worker keeps them for `mappings()`.
- Required: `prepare_inputs`, `gather_block_tables`, `compute_slot_mappings` (cp = 1). Everything else has a
  host default here: Model Runner V2's batch order in numpy (`buffers.batch_order`, its one numpy form), its
  sliding-window nulling of the gathered rows (`buffers.null_history`; device ops give their own), the
  kernel-row expansion, a host KV cache written and read back with vectorized numpy. Multi-rank slots (cp > 1)
  are the backend's to give; the default refuses with one clear message.
- Device ops (torch, Triton) hold a `DeviceMirror` (workers/device.py) as `mirror`: host vs device is its copy
  step, which the worker runs as the `h2d` phase, not a subclass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvmap.errors import KvmapError
from kvmap.kv.cache import KVCheckResult, KVGeometry, PagedKVCache, RankedKVCache
from kvmap.workers.buffers import InputBuffers, batch_order, null_history
from kvmap.workers.mappings import BatchTables, Inputs, RankSlots
from kvmap.workers.state import WorkerState

if TYPE_CHECKING:
    from kvmap.workers.contract import StepBatch
    from kvmap.workers.device import DeviceMirror
    from kvmap.workers.host import HostWorker


class MappingOps:
    """One language's mapping phases over a worker's state and buffers. Subclass it and give the three
    required phase functions; the rest default to host numpy."""

    detail = ""  # how this backend runs, shown beside its name in a replay's summary
    mirror: DeviceMirror | None = None  # device ops: the device state and its copy step

    def __init__(self, state: WorkerState, buffers: InputBuffers, device: str = "cpu") -> None:
        self.state = state  # the worker's request state (read-only here: the worker updates it)
        self.buffers = buffers  # the worker's host input buffers, preallocated at maximum size

    # ------------------------------------------------------------------------------------------ phases

    def batch_order(self, num_scheduled_tokens: np.ndarray, num_draft_tokens: np.ndarray,
                    num_speculative_tokens: int) -> np.ndarray:
        """[num_reqs] batch_idx -> scheduler entry: Model Runner V2's order."""
        return batch_order(num_scheduled_tokens, num_draft_tokens, num_speculative_tokens)

    def prepare_inputs(self, batch: StepBatch) -> Inputs:
        """`idx_mapping`, `query_start_loc`, `seq_lens`, `positions`, `input_ids` of the batch in
        `batch.order` (plus the per-request counts they come from)."""
        raise NotImplementedError

    def gather_block_tables(self, inputs: Inputs) -> BatchTables:
        """Each batch request's block-table row in every group, and its valid length."""
        raise NotImplementedError

    def compute_slot_mappings(self, inputs: Inputs) -> np.ndarray:
        """[num_groups, num_tokens] int64 slots (cp = 1), PAD_SLOT_ID in a group without a slot mapping."""
        raise NotImplementedError

    def compute_rank_slot_mappings(self, inputs: Inputs, rank_layouts, seq_layouts) -> RankSlots:
        """Every computed DCP rank's slots and local lengths (cp > 1; rank_layouts: [num_ranks][G])."""
        raise KvmapError(f"the {type(self).__name__} backend computes cp = 1 slot mappings only; this trace has "
                         "decode context parallelism", field="--backend")

    def null_history(self, tables: BatchTables, inputs: Inputs, groups: tuple[int, ...]) -> BatchTables:
        """Model Runner V2: each listed sliding-window group's gathered rows nulled below the window, in place
        (layout.GroupLayout.null_history_blocks). The host default is numpy; device ops give their own."""
        return null_history(self.buffers, tables, inputs.num_computed_tokens, groups)

    def kernel_block_tables(self, tables: BatchTables, layouts) -> list:
        """The gathered rows expanded to kernel block ids (a kernel split): [G] x [num_reqs, W_g * k_g]."""
        return [lay.kernel_rows(t) for t, lay in zip(tables.block_tables, layouts)]

    # ---------------------------------------------------------------------------------------- KV cache

    def new_kv_cache(self, geometry: KVGeometry) -> PagedKVCache:
        """One shard of the KV cache this backend writes (host memory, vectorized writes)."""
        return PagedKVCache(self.state.header, geometry)

    def write_kv(self, worker: HostWorker, kv: PagedKVCache | RankedKVCache) -> None:
        host_write_kv(worker, kv)

    def verify_kv(self, worker: HostWorker, kv: PagedKVCache | RankedKVCache, into: KVCheckResult) -> None:
        host_verify_kv(worker, kv, into)


def host_write_kv(worker: HostWorker, kv: PagedKVCache | RankedKVCache) -> None:
    """The step's tokens into a host cache through the returned slots (each DCP rank's shard through its own)."""
    i = worker.inputs
    if isinstance(kv, RankedKVCache):
        for n, shard in enumerate(kv.shards):
            shard.write(i.input_ids, i.positions, worker.rank_slots.rank_slot_mapping[n])
        return
    kv.write(i.input_ids, i.positions, worker.slots)


def host_verify_kv(worker: HostWorker, kv: PagedKVCache | RankedKVCache, into: KVCheckResult) -> None:
    """Read back this step's readable context in every KV group (`HostWorker.readable_context`)."""
    req_ids = worker.mappings().req_ids

    def check(i: int, shard: PagedKVCache) -> None:
        for g in worker.state.kv_groups:  # state groups hold no per-token KV
            shard.verify_context(g, worker.current_step, req_ids, *worker.readable_context(g, i), into=into)

    if isinstance(kv, RankedKVCache):
        kv.verify(into, check)
    else:
        check(0, kv)
