"""The worker contract: the phases a GPU worker runs per step, the public per-step batch, and the results.

Rules:
- A backend is a subclass of `Worker`. The replay loop, `explain`, `validate --deep`, the benchmark and user
  backends see only what is declared here: no `hasattr` dispatch, no private attributes from outside.
- Phases run in this order, each once per step: `update_states(step)` (finish, preempt, add, update cached
  requests; sets `self.batch`), `prepare_batch` (batch order), `copy_to_device` (only when `has_h2d`),
  `prepare_inputs` (`idx_mapping`, `query_start_loc`, `seq_lens`, `positions`, `input_ids`),
  `gather_block_tables`, `compute_slot_mappings`, `prepare_forward` (only when `use_forward` was called: the
  forward pass's other inputs, kvmap/forward), then `write_kv`/`verify_kv`, and after the model
  `append_sampled`. All but `update_states` take no arguments: the worker holds the current step.
- `mappings()` gives host arrays in batch order; `mappings_dict()` the plain-list dump record that every
  backend must produce bit for bit (and byte for byte once serialized).
- Long-lived state belongs to the worker; `StepBatch` is per step and valid until the next `update_states`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvmap.errors import KvmapError
from kvmap.forward.config import ForwardConfig
from kvmap.forward.inputs import ForwardInputs
from kvmap.kv.cache import KVCheckResult, KVGeometry, PagedKVCache, RankedKVCache
from kvmap.trace import Step, TraceHeader
from kvmap.workers.mappings import BatchMappings, BatchReqIds
from kvmap.workers.order import V1PersistentBatch, check_batch_order


@dataclass(slots=True)
class StepBatch:
    """One step's scheduled requests, in the scheduler's order, plus the batch order once it is known."""

    step: Step | None  # None for synthetic batches (benchmarks)
    req_ids: list[str] | None  # [num_reqs] scheduler entry -> req_id (None: synthetic, named by row)
    rows: np.ndarray  # [num_reqs] int32, scheduler entry -> req_state_idx
    num_scheduled_tokens: np.ndarray  # [num_reqs] int32, scheduler entry -> tokens this step (drafts included)
    num_draft_tokens: np.ndarray  # [num_reqs] int32, scheduler entry -> drafts among them
    order: np.ndarray | None = None  # [num_reqs] batch_idx -> scheduler entry (set by prepare_batch)
    num_tokens: int = 0  # T, known on the host from the trace

    @property
    def num_reqs(self) -> int:
        return len(self.rows)

    def batch_req_ids(self) -> BatchReqIds:
        """Request ids in batch order (looked up lazily)."""
        assert self.order is not None
        ids = self.req_ids
        return BatchReqIds(ids if ids is not None else [str(r) for r in self.rows.tolist()], self.order)


class Worker(ABC):
    """One implementation of vLLM's input preparation. A new backend is usually a `MappingOps` (workers/ops.py)
    composed into `HostWorker` (workers/host.py); subclass this directly only for a worker with its own state."""

    name: ClassVar[str] = "worker"
    has_h2d: ClassVar[bool] = False  # has a timed host-to-device phase (`copy_to_device`)
    native_batch_order: ClassVar[str] = "mrv2"  # the order it computes whatever is asked (vllm-v1: "v1")
    computes_forward: ClassVar[bool] = False  # implements `prepare_forward` (the forward inputs, kvmap/forward)
    native_forward_parts: tuple[str, ...] = ()  # forward parts its own code builds (vLLM's), set by use_forward
    backend_detail: str = ""  # how this worker runs, shown beside its name in a replay's summary

    def __init__(self, header: TraceHeader, device: str = "cpu") -> None:
        self.header = header
        self.device = device
        self.batch: StepBatch | None = None
        self.v1_batch: V1PersistentBatch | None = None  # None: Model Runner V2's batch order
        # DCP ranks this worker computes (docs/trace-format.md, per-rank slot rule): all of them by default (the
        # one-process emulation), one with `--rank R` or one process per rank
        self.ranks: tuple[int, ...] = tuple(range(header.decode_context_parallel_size))
        self.forward_config: ForwardConfig | None = None  # set by use_forward: the prepare_forward phase runs
        self.forward: ForwardInputs | None = None  # this step's forward inputs (after prepare_forward)

    def set_ranks(self, ranks) -> None:
        """Compute only these DCP ranks (ascending); call before the first step."""
        ranks = tuple(sorted(set(int(r) for r in ranks)))
        cp = self.header.decode_context_parallel_size
        if not ranks or ranks[0] < 0 or ranks[-1] >= cp:
            raise ValueError(f"DCP ranks must be in 0..{cp - 1}, got {list(ranks)}")
        self.ranks = ranks

    def use_batch_order(self, name: str, reorder_batch_threshold: int | None = None) -> None:
        """`mrv2` (the default) or `v1`: V1's persistent batch, with the 4-region reorder when the attention
        backend sets `reorder_batch_threshold` (workers/order.py)."""
        check_batch_order(name)
        self.v1_batch = V1PersistentBatch(reorder_batch_threshold) if name == "v1" else None

    def use_forward(self, config: ForwardConfig) -> None:
        """Compute the forward pass's other inputs each step (`prepare_forward`), with `config`'s rules."""
        if not self.computes_forward:
            raise KvmapError(f"the {self.name} backend does not compute the forward inputs", field="--forward")
        self.forward_config = config

    @property
    def is_mrv2(self) -> bool:
        """Model Runner V2's rules apply: its batch order and its gathered table's sliding-window nulling
        (layout.GroupLayout.null_history_blocks). The one runner flag: `--runner` sets it."""
        return self.v1_batch is None and self.native_batch_order == "mrv2"

    def v1_order(self, step: Step) -> list[str]:
        """This step's batch order (req ids) under V1's persistent batch."""
        assert self.v1_batch is not None
        so, nc = step.scheduler_output, None
        if self.v1_batch.threshold is not None:  # the reorder's regions read them
            nc = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
            nc.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
        return self.v1_batch.update(step, nc)

    @property
    def num_standin_tokens(self) -> int:
        """Input ids made up because the trace did not record them (0 unless a backend counts them)."""
        return 0

    @property
    def current_step(self) -> int:
        assert self.batch is not None and self.batch.step is not None
        return self.batch.step.step

    # ------------------------------------------------------------------------------------------ phases

    @abstractmethod
    def update_states(self, step: Step) -> None: ...

    @abstractmethod
    def prepare_batch(self) -> None: ...

    def copy_to_device(self) -> None:
        """Send what changed to the device (workers with `has_h2d`); nothing for host workers."""
        return None

    @abstractmethod
    def prepare_inputs(self) -> None: ...

    @abstractmethod
    def gather_block_tables(self) -> None: ...

    @abstractmethod
    def compute_slot_mappings(self) -> None: ...

    def prepare_forward(self) -> None:
        """This step's `ForwardInputs` (kvmap/forward) into `self.forward`, from the step's mappings; only after
        `use_forward`."""
        raise NotImplementedError  # only called after use_forward, which workers without it refuse

    @abstractmethod
    def append_sampled(self) -> None: ...

    def mapping_phases(self) -> None:
        """Every phase after `update_states` up to the slot mappings, untimed."""
        self.prepare_batch()
        if self.has_h2d:
            self.copy_to_device()
        self.prepare_inputs()
        self.gather_block_tables()
        self.compute_slot_mappings()
        if self.forward_config is not None:
            self.prepare_forward()

    def run_step(self, step: Step) -> None:
        """Every phase up to the mappings, untimed (explain, tests, scripts); the replay loop times them."""
        self.update_states(step)
        self.mapping_phases()

    @property
    def h2d_bytes(self) -> int:
        """Bytes sent host-to-device so far (workers with `has_h2d`)."""
        return 0

    def synchronize(self) -> None:
        """Wait for queued device work (benchmarks time device workers to completion); host work is done."""
        return None

    # ---------------------------------------------------------------------------------------- KV cache

    def make_kv_cache(self, geometry: KVGeometry) -> PagedKVCache:
        """The KV cache this worker writes: host memory, vectorized writes (one shard per computed DCP rank
        when cp > 1, each of this TP rank's share of the heads)."""
        return make_rank_caches(self, geometry, lambda g: PagedKVCache(self.header, g))

    @abstractmethod
    def write_kv(self, kv: PagedKVCache) -> None: ...

    @abstractmethod
    def verify_kv(self, kv: PagedKVCache, into: KVCheckResult) -> None:
        """Read back this step's readable context in every group; add the outcome to `into`."""

    # ----------------------------------------------------------------------------------------- results

    @abstractmethod
    def mappings(self) -> BatchMappings:
        """This step's mappings as host arrays in batch order (views valid until the next step)."""

    def mappings_dict(self) -> dict:
        """The `--dump-mappings` record (with the forward keys after the core ones when `use_forward` was
        called)."""
        d = self.mappings().to_dict(self.current_step)
        if self.forward is not None:
            d.update(self.forward.to_dict())
        return d


def make_rank_caches(worker: Worker, geometry: KVGeometry, make) -> PagedKVCache | RankedKVCache:
    """`make(geometry)` once per computed DCP rank (a `RankedKVCache` when cp > 1), with the TP share of the
    heads: num_kv_heads // tp per rank, replicated (at least one) when tp > heads."""
    geometry = geometry.tp_shard(worker.header.tensor_parallel_size)
    if worker.header.decode_context_parallel_size == 1:
        return make(geometry)
    return RankedKVCache(worker.ranks, [make(geometry) for _ in worker.ranks])
