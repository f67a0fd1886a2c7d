"""The device mirror: the long-lived device tensors of a device backend, its preallocated device input buffers,
and the one staged host-to-device copy per step. Host vs device is this copy step, not a subclass.

Rules (Model Runner V2's design, vLLM's `vllm/v1/worker/gpu/`):
- The host keeps `WorkerState` (numpy) as the source of truth for what the scheduler said; its staged writes
  (workers/writes.py, recording) list every write into token rows and block tables. Each step `copy_to_device`
  packs, into one pinned int64 staging buffer, the batch (`idx_mapping`, `num_scheduled_tokens`), the
  `num_computed_tokens` and `num_blocks` rows, and the recorded writes (flat index, value); one non-blocking copy
  sends it; the device applies the writes with `index_copy_`. Two pinned buffers are used in turn, and a buffer
  is refilled only after the event recorded behind its last copy has completed, so the host never rewrites
  memory a copy may still read.
- Device input buffers are allocated once at maximum size; the device ops (torch_worker.py, triton_worker.py)
  fill slices of them and return those slices. No `.item()`, no host sync inside a step (T, the step's token
  count, is known on the host from the trace).
- On CPU, torch runs with one intra-op thread (see _torch.py).
"""

from __future__ import annotations

import numpy as np

from kvmap._torch import torch
from kvmap.errors import KvmapError
from kvmap.kv.cache import KVGeometry, PagedKVCache
from kvmap.layout import PAD_SLOT_ID
from kvmap.workers.buffers import InputBuffers
from kvmap.workers.contract import StepBatch
from kvmap.workers.mappings import BatchTables, Inputs, RankSlots
from kvmap.workers.state import WorkerState
from kvmap.workers.writes import TOKENS, ragged_columns


def resolve_device(name: str):
    t = torch()
    if name.startswith("cuda"):
        if not t.cuda.is_available():
            raise KvmapError(f"{name} is not available here (torch {t.__version__}, "
                             f"{'a CPU-only build' if t.version.cuda is None else 'no visible GPU'}); "
                             "use --device cpu, or run on a machine with an NVIDIA GPU and a CUDA build of torch",
                             field="--device")
    elif name != "cpu":
        raise KvmapError(f"unknown device {name!r}; use cpu or cuda[:N]", field="--device")
    return t.device(name)


def check_gpus_for_ranks(name: str, nproc: int) -> None:
    """`--nproc N --device cuda`: the device exists and N GPUs are visible, one a rank (said before any rank
    starts; each would otherwise fail on its own after seconds)."""
    resolve_device(name)
    gpus = torch().cuda.device_count()
    if nproc > gpus:
        raise KvmapError(f"{nproc} ranks on {name} need a GPU each; {gpus} visible", field="--nproc")


class Staging:
    """Host -> device transfer through two pinned buffers used in turn (plain memory on a CPU device)."""

    def __init__(self, device, capacity: int = 1 << 16) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.k = 0
        self.events: list = [None, None]
        self.bytes_sent = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        t = torch()
        self.capacity = capacity
        self.host = [t.empty(capacity, dtype=t.int64, pin_memory=self.pin) for _ in range(2)]
        self.host_np = [h.numpy() for h in self.host]
        self.dev = t.empty(capacity, dtype=t.int64, device=self.device)

    def send(self, parts: list[np.ndarray]) -> tuple:
        """Copy the concatenation of `parts` to the device; returns one device view per part."""
        n = sum(len(p) for p in parts)
        k = self.k
        self.k ^= 1
        if self.events[k] is not None:
            self.events[k].synchronize()  # the copy that last read this buffer (two steps ago) is done
        if n > self.capacity:  # rare: a step with more new data than ever before
            if self.device.type == "cuda":
                torch().cuda.current_stream(self.device).synchronize()
            self._alloc(max(n, 2 * self.capacity))
        host = self.host_np[k]
        views, o = [], 0
        for p in parts:
            host[o : o + len(p)] = p
            views.append((o, len(p)))
            o += len(p)
        self.dev[:n].copy_(self.host[k][:n], non_blocking=self.pin)
        if self.pin:
            ev = torch().cuda.Event()
            ev.record()
            self.events[k] = ev
        self.bytes_sent += 8 * n
        return tuple(self.dev[a : a + m] for a, m in views)


class DeviceMirror:
    """A device copy of the request state, the device input buffers, and the staged copy that keeps them
    current. R = max_num_seqs rows, T = max tokens in a step, G groups."""

    def __init__(self, state: WorkerState, buffers: InputBuffers, device: str) -> None:
        t = torch()
        self.state = state
        self.device = dev = resolve_device(device)
        st = self.state
        st.writes.record = True  # every write to token rows / block tables is sent, once, each step
        R, G = st.max_num_reqs, len(st.block_sizes)
        T = buffers.max_num_tokens
        # long-lived state on the device
        self.d_token_ids = t.zeros(st.token_ids.shape, dtype=t.int32, device=dev)  # [R, W] row -> tokens
        self.d_block_tables = [t.zeros(b.shape, dtype=t.int32, device=dev) for b in st.block_tables]  # [G] x [R, Wg]
        self.d_num_computed = t.zeros(R, dtype=t.int32, device=dev)  # [R] row -> num_computed_tokens
        self.d_num_blocks = t.zeros((G, R), dtype=t.int32, device=dev)  # [G, R] row -> valid blocks
        # per-step inputs, preallocated at maximum size
        self.o_idx_mapping = t.zeros(R, dtype=t.int64, device=dev)  # [R] batch_idx -> req_state_idx
        self.o_num_scheduled = t.zeros(R, dtype=t.int32, device=dev)  # [R] batch_idx -> tokens this step
        self.o_num_computed = t.zeros(R, dtype=t.int32, device=dev)  # [R] batch_idx -> num_computed_tokens
        self.o_query_start_loc = t.zeros(R + 1, dtype=t.int32, device=dev)  # [R + 1]
        self.o_seq_lens = t.zeros(R, dtype=t.int32, device=dev)  # [R]
        self.o_positions = t.zeros(T, dtype=t.int64, device=dev)  # [T] flat token -> position
        self.o_input_ids = t.zeros(T, dtype=t.int32, device=dev)  # [T] flat token -> token id
        self.o_block_tables = [t.zeros(b.shape, dtype=t.int32, device=dev) for b in st.block_tables]  # [G] x [R, Wg]
        self.o_num_blocks = t.zeros((G, R), dtype=t.int32, device=dev)  # [G, R]
        self.o_slot_mapping = t.full((G, T), PAD_SLOT_ID, dtype=t.int64, device=dev)  # [G, T]
        # multi-rank, only when used: [cp, G, T] every computed DCP rank's slots, [cp, R] local lengths,
        # [G] x [R, W_g * k_g] kernel block rows
        cp = st.header.decode_context_parallel_size
        self.o_rank_slot_mapping = (t.full((cp, G, T), PAD_SLOT_ID, dtype=t.int64, device=dev) if cp > 1
                                    else None)
        self.o_dcp_local_seq_lens = t.zeros((cp, R), dtype=t.int32, device=dev) if cp > 1 else None
        kt = buffers.kernel_block_tables
        self.o_kernel_block_tables = [t.zeros(b.shape, dtype=t.int32, device=dev) for b in kt] if kt else None
        # scratch
        self.arange = t.arange(max(T, R + 1), dtype=t.int64, device=dev)  # [T] 0, 1, 2, ...
        self.t_token_req = t.zeros(T, dtype=t.int64, device=dev)  # [T] flat token -> batch_idx
        self.t_row = t.zeros(T, dtype=t.int64, device=dev)  # [T] flat token -> req_state_idx
        self.t_tmp = t.zeros(T, dtype=t.int64, device=dev)  # [T]
        self.t_req = t.zeros(R, dtype=t.int64, device=dev)  # [R]
        self.staging = Staging(dev)

    def upload(self) -> None:
        """Send the whole host state at once (benchmarks that wrote the host arrays directly)."""
        t = torch()
        self.d_token_ids.copy_(t.from_numpy(self.state.token_ids))
        for d, h in zip(self.d_block_tables, self.state.block_tables):
            d.copy_(t.from_numpy(h))
        self.state.writes.drain()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch().cuda.synchronize()

    @staticmethod
    def to_host(x) -> np.ndarray:
        """A device result as a host array (synchronizes: for dumps and checks only)."""
        return x.cpu().numpy()

    def inputs(self, B: int, T: int) -> Inputs:
        """The device input slices of a step of B requests and T tokens."""
        return Inputs(self.o_idx_mapping[:B], self.o_num_scheduled[:B], self.o_num_computed[:B],
                      self.o_query_start_loc[: B + 1], self.o_seq_lens[:B], self.o_positions[:T], self.o_input_ids[:T])

    def tables(self, B: int) -> BatchTables:
        """The gathered device block-table slices of B requests."""
        return BatchTables([x[:B] for x in self.o_block_tables], self.o_num_blocks[:, :B])

    def rank_slots(self, num_ranks: int, B: int, T: int) -> RankSlots:
        """The first `num_ranks` computed DCP ranks' device slots and local lengths."""
        return RankSlots(self.o_rank_slot_mapping[:num_ranks, :, :T], self.o_dcp_local_seq_lens[:num_ranks, :B])

    def new_kv_cache(self, geometry: KVGeometry) -> PagedKVCache:
        """One shard of a KV cache in this device's memory."""
        return PagedKVCache(self.state.header, geometry, device=str(self.device), torch_storage=True)

    def copy_to_device(self, b: StepBatch) -> None:
        """One staged non-blocking copy: the batch, per-row counters, and the recorded writes."""
        st = self.state
        idx = b.rows[b.order].astype(np.int64)
        n = b.num_scheduled_tokens[b.order].astype(np.int64)
        parts = [idx, n, st.num_computed_tokens.astype(np.int64), st.num_blocks.reshape(-1).astype(np.int64)]
        writes: dict[int, list] = {}
        for table, r, s0, c, v in st.writes.drain():
            if not len(v):
                continue
            cols = ragged_columns(s0, c)
            width = st.writes.tables[table].shape[1]
            writes.setdefault(table, []).append((np.repeat(r.astype(np.int64), c) * width + cols, v.astype(np.int64)))
        keys = list(writes)
        for key in keys:
            parts.append(np.concatenate([x[0] for x in writes[key]]))
            parts.append(np.concatenate([x[1] for x in writes[key]]))
        views = self.staging.send(parts)
        d_idx, d_n, d_nc, d_nb = views[:4]
        B = b.num_reqs
        self.o_idx_mapping[:B].copy_(d_idx)
        self.o_num_scheduled[:B].copy_(d_n)
        self.d_num_computed.copy_(d_nc)
        self.d_num_blocks.copy_(d_nb.view(self.d_num_blocks.shape))
        for i, table in enumerate(keys):
            flat, vals = views[4 + 2 * i], views[5 + 2 * i]
            target = self.d_token_ids if table == TOKENS else self.d_block_tables[table]
            target.view(-1).index_copy_(0, flat, vals.to(torch().int32))
