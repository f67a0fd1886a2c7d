"""Workers: long-lived state plus the per-step phases the replay loop times, one class per implementation.

Rules: every worker exposes the same phases, in the order a GPU worker runs them:
`update_states` (finish, preempt, add, update cached requests), `prepare_batch` (batch order, `idx_mapping`),
`prepare_inputs` (`input_ids`, `positions`, `query_start_loc`, `seq_lens`), `gather_block_tables`,
`compute_slot_mappings`, and after the model `append_sampled`. `mappings_dict()` gives the plain-list record
that all workers must agree on bit for bit. `readable_context(g)` gives what the KV check reads back.
"""

from __future__ import annotations

import numpy as np

from kvmap.workers import buffers as B
from kvmap.errors import TraceError
from kvmap.workers.reference import ReferenceWorker, readable_lo
from kvmap.workers.state import WorkerState, ragged_columns
from kvmap.trace import Step, TraceHeader

BACKENDS = ("numba", "numpy", "reference", "torch", "triton")


def default_backend() -> str:
    """The compiled CPU path when numba imports, else vectorized numpy."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return "numpy"
    return "numba"


class NumpyWorker:
    """The vectorized CPU worker (the default): numpy on preallocated buffers, no per-token Python."""

    name = "numpy"

    def __init__(self, header: TraceHeader) -> None:
        self.header = header
        self.state = WorkerState(header)
        self.buffers = B.InputBuffers(self.state, max(header.max_num_batched_tokens,
                                                      header.max_num_scheduled_tokens or 0))
        self._step: Step | None = None
        self._sched: tuple[list[str], np.ndarray, np.ndarray, np.ndarray] | None = None
        self._order: np.ndarray | None = None
        self._B = 0
        self._T = 0
        self._mappings: B.BatchMappings | None = None

    @property
    def current_step(self) -> int:
        assert self._step is not None
        return self._step.step

    @property
    def num_standin_tokens(self) -> int:
        return self.state.num_standin_tokens

    def update_states(self, step: Step) -> None:
        self._step = step
        self._mappings = None
        T = step.scheduler_output.total_num_scheduled_tokens
        if T > self.buffers.max_num_tokens:
            raise TraceError(f"{T} tokens exceed the header's token budget {self.buffers.max_num_tokens}",
                             line=step.line, step=step.step, field="total_num_scheduled_tokens")
        self._sched = self.state.update(step)

    def prepare_batch(self) -> None:
        assert self._sched is not None
        _, _, counts, drafts = self._sched
        self._order = B.batch_order(counts, drafts, self.header.num_speculative_tokens)

    def prepare_inputs(self) -> None:
        assert self._sched is not None and self._order is not None
        _, rows, counts, _ = self._sched
        self._B, self._T = B.build_inputs(self.state, self.buffers, rows, counts, self._order)

    def gather_block_tables(self) -> None:
        B.gather_block_tables(self.state, self.buffers, self._B)

    def compute_slot_mappings(self) -> None:
        B.compute_slot_mappings(self.state, self.buffers, self._B, self._T)

    def append_sampled(self) -> None:
        assert self._step is not None and self._sched is not None
        self.state.append_sampled(self._step, self._sched[0], self._sched[1])

    def mappings(self) -> B.BatchMappings:
        """This step's mappings (views into the input buffers; valid until the next step)."""
        if self._mappings is None:
            assert self._sched is not None and self._order is not None
            self._mappings = B.view(self.buffers, B.BatchReqIds(self._sched[0], self._order), self._B, self._T)
        return self._mappings

    def token_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What the KV write needs, without building the whole mappings record: input_ids [T],
        positions [T], slot_mapping [G, T]."""
        buf, T = self.buffers, self._T
        return buf.input_ids[:T], buf.positions[:T], buf.slot_mapping[:, :T]

    def mappings_dict(self) -> dict:
        assert self._step is not None
        return self.mappings().to_dict(self._step.step)

    def readable_context(self, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(batch_idx, position, slot, token id) arrays over every position this step's requests may read."""
        g = self.header.kv_cache_groups[group]
        buf, st = self.buffers, self.state
        Bn = self._B
        idx = buf.idx_mapping[:Bn].astype(np.int64)
        nc = buf.num_computed_tokens[:Bn].astype(np.int64)
        hi = buf.seq_lens[:Bn].astype(np.int64)
        lo = readable_lo(g, nc)
        counts = hi - lo
        breq = np.repeat(np.arange(Bn), counts)
        pos = ragged_columns(lo, counts)
        rows = idx[breq]
        bs = g.block_size
        blocks = st.block_tables[group][rows, pos // bs].astype(np.int64)
        slots = blocks * bs + pos % bs
        tokens = st.token_ids[rows, pos]
        return breq, pos, slots, tokens


class NumbaWorker(NumpyWorker):
    """The compiled CPU worker: the same state and buffers as NumpyWorker, mapping phases as numba kernels."""

    name = "numba"

    def __init__(self, header: TraceHeader) -> None:
        super().__init__(header)
        from kvmap.workers import kernels_cpu

        self.k = kernels_cpu
        self.state.kernels = kernels_cpu

    def prepare_batch(self) -> None:
        assert self._sched is not None
        _, _, counts, drafts = self._sched
        buf = self.buffers
        n = self.k.batch_order(counts, drafts, self.header.num_speculative_tokens, buf.order, buf.sort_keys,
                               buf.sort_tmp)
        self._order = buf.order[:n]

    def prepare_inputs(self) -> None:
        assert self._sched is not None and self._order is not None
        _, rows, counts, _ = self._sched
        buf, st = self.buffers, self.state
        B = len(rows)
        T = self.k.prepare_inputs(rows, counts, self._order, st.num_computed_tokens, st.token_ids,
                                  buf.idx_mapping, buf.num_scheduled_tokens, buf.num_computed_tokens,
                                  buf.query_start_loc, buf.seq_lens, buf.positions, buf.input_ids)
        self._B, self._T = B, T

    def gather_block_tables(self) -> None:
        buf, st = self.buffers, self.state
        idx = buf.idx_mapping[: self._B]
        for g, table in enumerate(st.block_tables):
            self.k.gather_block_table(idx, st.num_blocks[g], table, buf.block_tables[g], buf.num_blocks[g])

    def compute_slot_mappings(self) -> None:
        buf, st = self.buffers, self.state
        B = self._B
        idx, n, nc = buf.idx_mapping[:B], buf.num_scheduled_tokens[:B], buf.num_computed_tokens[:B]
        for g, table in enumerate(st.block_tables):
            self.k.slot_mapping(idx, n, nc, table, st.block_sizes[g], buf.slot_mapping[g])


def run_step(worker, step: Step) -> None:
    """Every phase up to the mappings, untimed (explain, tests, scripts): the replay loop times them one by one."""
    worker.update_states(step)
    worker.prepare_batch()
    if hasattr(worker, "copy_to_device"):
        worker.copy_to_device()
    worker.prepare_inputs()
    worker.gather_block_tables()
    worker.compute_slot_mappings()


def make_worker(backend: str, header: TraceHeader, device: str = "cpu") -> NumpyWorker | ReferenceWorker:
    if device != "cpu" and backend not in ("torch", "triton"):
        raise TraceError(f"--device {device} needs --backend torch or triton (the {backend} worker runs on the "
                         "host)", field="--device")
    if backend == "torch":
        from kvmap.workers.torch_worker import TorchWorker

        return TorchWorker(header, device)
    if backend == "triton":
        import os

        from kvmap.workers.torch_worker import resolve_device

        dev = resolve_device(device)
        if dev.type == "cpu" and not os.environ.get("TRITON_INTERPRET"):
            raise TraceError("the triton backend on CPU tensors needs TRITON_INTERPRET=1 in the environment "
                             "(set before kvmap starts; about 2 ms a kernel program)", field="--backend")
        try:
            from kvmap.workers.triton_worker import TritonWorker
        except ImportError as e:
            raise TraceError(f"the triton backend needs triton ({e}); pip install triton", field="--backend") from None
        return TritonWorker(header, device)
    if backend == "numba":
        try:
            return NumbaWorker(header)
        except ImportError:
            raise TraceError("the numba backend needs numba (pip install numba); --backend numpy needs nothing",
                             field="--backend") from None
    if backend == "numpy":
        return NumpyWorker(header)
    if backend == "reference":
        return ReferenceWorker(header)
    raise TraceError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}", field="--backend")
