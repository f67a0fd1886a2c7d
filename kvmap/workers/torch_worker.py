"""Device workers: request state lives on a torch device and each step sends only what changed.

Rules (Model Runner V2's design, docs: vllm-internals.md 2.2):
- The host keeps `WorkerState` (numpy) as the source of truth for what the scheduler said; its staged writes
  (workers/writes.py, recording) list every write into token rows and block tables. Each step the host packs, into
  one pinned int64 staging buffer, the batch (`idx_mapping`, `num_scheduled_tokens`), the `num_computed_tokens`
  and `num_blocks` rows, and the recorded writes (flat index, value); one non-blocking copy sends it; the device
  applies the writes with `index_copy_`. Two pinned buffers are used in turn, and a buffer is refilled only after
  the event recorded behind its last copy has completed, so the host never rewrites memory a copy may still read.
- Per-step mappings are computed on the device into preallocated device buffers; no `.item()`, no host sync
  inside a step (T, the step's token count, is known on the host from the trace).
- `TorchWorker` uses plain tensor ops (runs on CPU too, for checking); `TritonWorker` (triton_worker.py)
  replaces the mapping phases with Triton kernels. Both are checked bit for bit against the reference.
- On CPU, torch runs with one intra-op thread (see _torch.py).
"""

from __future__ import annotations

import numpy as np

from kvmap._torch import torch
from kvmap.errors import KvmapError
from kvmap.kv.cache import KVCheckResult, KVGeometry, KVMismatch, PagedKVCache, RankedKVCache
from kvmap.layout import PAD_SLOT_ID, GroupLayout
from kvmap.trace import TraceHeader
from kvmap.workers.contract import make_rank_caches
from kvmap.workers.host import NumpyWorker
from kvmap.workers.mappings import BatchMappings
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


def slots(table, rows, pos, lay: GroupLayout, out=None):
    """`layout.GroupLayout.slot` for tensors, the torch worker's one form of the rule (cp = 1, DCP and the
    read-back): [n] request-state rows and [n] positions -> [n] int64 slots through the row-indexed `table`
    [R, W]: the row entry at `pos // virtual_block_size`, then `* block_size` plus the local offset;
    PAD_SLOT_ID where another rank holds the token, and everywhere in a group without a slot mapping."""
    t = torch()
    if out is None:
        out = t.empty_like(pos)
    if not lay.has_slots:
        return out.fill_(PAD_SLOT_ID)
    vbs, bs = lay.virtual_block_size, lay.block_size
    t.mul(rows, table.shape[1], out=out)
    out += t.div(pos, vbs, rounding_mode="floor")
    ids = table.view(-1).index_select(0, out).to(t.int64)
    if lay.cp_size == 1:
        return t.add(ids * bs, t.remainder(pos, bs), out=out)
    I, cp = lay.interleave, lay.cp_size
    off = pos % vbs
    local = t.div(off, I, rounding_mode="floor") % cp == lay.cp_rank
    slot = ids * bs + t.div(off, I * cp, rounding_mode="floor") * I + off % I
    return out.copy_(t.where(local, slot, t.full_like(slot, PAD_SLOT_ID)))


def local_seq_lens(seq, lay: GroupLayout, out):
    """`layout.GroupLayout.dcp_local_seq_len` for tensors: (s // (cp * I)) * I + clamp(s % (cp * I) - rank * I,
    0, I)."""
    I, cp = lay.interleave, lay.cp_size
    rem = (seq % (cp * I) - lay.cp_rank * I).clamp(0, I)
    return out.copy_(torch().div(seq, cp * I, rounding_mode="floor") * I + rem)


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


class TorchWorker(NumpyWorker):
    """State and mappings on a torch device, plain tensor operations."""

    name = "torch"
    has_h2d = True

    def __init__(self, header: TraceHeader, device: str = "cpu") -> None:
        super().__init__(header, device)
        t = torch()
        self.torch_device = dev = resolve_device(device)
        st = self.state
        st.writes.record = True  # every write to token rows / block tables is sent, once, each step
        R, G = st.max_num_reqs, len(st.block_sizes)
        T = self.buffers.max_num_tokens
        # long-lived state on the device
        self.d_token_ids = t.zeros(st.token_ids.shape, dtype=t.int32, device=dev)  # [R, W] row -> tokens
        self.d_block_tables = [t.zeros(b.shape, dtype=t.int32, device=dev) for b in st.block_tables]  # [G] x [R, Wg]
        self.d_num_computed = t.zeros(R, dtype=t.int32, device=dev)  # [R]
        self.d_num_blocks = t.zeros((G, R), dtype=t.int32, device=dev)  # [G, R]
        # per-step inputs, preallocated at maximum size
        self.o_idx_mapping = t.zeros(R, dtype=t.int64, device=dev)  # [R] batch_idx -> req_state_idx
        self.o_num_scheduled = t.zeros(R, dtype=t.int32, device=dev)  # [R]
        self.o_num_computed = t.zeros(R, dtype=t.int32, device=dev)  # [R]
        self.o_query_start_loc = t.zeros(R + 1, dtype=t.int32, device=dev)  # [R + 1]
        self.o_seq_lens = t.zeros(R, dtype=t.int32, device=dev)  # [R]
        self.o_positions = t.zeros(T, dtype=t.int64, device=dev)  # [T]
        self.o_input_ids = t.zeros(T, dtype=t.int32, device=dev)  # [T]
        self.o_block_tables = [t.zeros(b.shape, dtype=t.int32, device=dev) for b in st.block_tables]
        self.o_num_blocks = t.zeros((G, R), dtype=t.int32, device=dev)  # [G, R]
        self.o_slot_mapping = t.full((G, T), PAD_SLOT_ID, dtype=t.int64, device=dev)  # [G, T]
        # multi-rank, only when used: [cp, G, T] every computed DCP rank's slots, [cp, R] local lengths,
        # [G] x [R, W_g * k_g] kernel block rows
        cp = header.decode_context_parallel_size
        self.o_rank_slot_mapping = (t.full((cp, G, T), PAD_SLOT_ID, dtype=t.int64, device=dev) if cp > 1
                                    else None)
        self.o_dcp_local_seq_lens = t.zeros((cp, R), dtype=t.int32, device=dev) if cp > 1 else None
        self.o_kernel_block_tables = ([t.zeros(b.shape, dtype=t.int32, device=dev) for b in
                                       self.buffers.kernel_block_tables] if self.kernel_split else None)
        self.arange = t.arange(max(T, R + 1), dtype=t.int64, device=dev)
        self.t_token_req = t.zeros(T, dtype=t.int64, device=dev)  # [T] flat token -> batch_idx
        self.t_row = t.zeros(T, dtype=t.int64, device=dev)  # [T] flat token -> req_state_idx
        self.t_tmp = t.zeros(T, dtype=t.int64, device=dev)
        self.t_req = t.zeros(R, dtype=t.int64, device=dev)
        self.staging = Staging(dev)
        self._prev_T = 0

    def upload_state(self) -> None:
        """Send the whole host state at once (benchmarks that wrote the host arrays directly)."""
        t = torch()
        self.d_token_ids.copy_(t.from_numpy(self.state.token_ids))
        for d, h in zip(self.d_block_tables, self.state.block_tables):
            d.copy_(t.from_numpy(h))
        self.state.writes.drain()

    @property
    def h2d_bytes(self) -> int:
        return self.staging.bytes_sent

    def synchronize(self) -> None:
        if self.torch_device.type == "cuda":
            torch().cuda.synchronize()

    # ------------------------------------------------------------------ phases

    def copy_to_device(self) -> None:
        """One staged non-blocking copy: the batch, per-row counters, and the recorded writes."""
        b, st = self.batch, self.state
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

    def prepare_inputs(self) -> None:
        t = torch()
        B, T = self.batch.num_reqs, self.batch.num_tokens
        idx, n = self.o_idx_mapping[:B], self.o_num_scheduled[:B]
        nc = self.o_num_computed[:B]
        t.index_select(self.d_num_computed, 0, idx, out=nc)
        qsl = self.o_query_start_loc
        t.cumsum(n, 0, out=qsl[1 : B + 1])
        t.add(nc, n, out=self.o_seq_lens[:B])
        tr = self.t_token_req[:T]
        tr.copy_(t.repeat_interleave(self.arange[:B], n, output_size=T))
        base = self.t_req[:B]
        t.sub(nc, qsl[:B], out=base)
        pos = self.o_positions[:T]
        t.index_select(base, 0, tr, out=pos)
        pos += self.arange[:T]
        row = self.t_row[:T]
        t.index_select(idx, 0, tr, out=row)
        flat = self.t_tmp[:T]
        t.mul(row, self.state.token_width, out=flat)
        flat += pos
        t.index_select(self.d_token_ids.view(-1), 0, flat, out=self.o_input_ids[:T])

    def gather_block_tables(self) -> None:
        t = torch()
        B = self.batch.num_reqs
        idx = self.o_idx_mapping[:B]
        for g, table in enumerate(self.d_block_tables):
            t.index_select(table, 0, idx, out=self.o_block_tables[g][:B])
            t.index_select(self.d_num_blocks[g], 0, idx, out=self.o_num_blocks[g, :B])
        if self.kernel_split:
            self.device_kernel_block_tables()

    def device_kernel_block_tables(self) -> None:
        """The gathered rows expanded to kernel ids: manager id b -> b*k .. b*k+k-1 (layout.kernel_row)."""
        t = torch()
        B = self.batch.num_reqs
        for g, lay in enumerate(self.layouts):
            k = lay.kernel_blocks_per_block
            rows = self.o_block_tables[g][:B]
            ar = t.arange(k, dtype=t.int32, device=rows.device)
            self.o_kernel_block_tables[g][:B].copy_((rows[:, :, None] * k + ar).reshape(B, rows.shape[1] * k))

    def device_rank_slot_mappings(self) -> None:
        """Every computed DCP rank's slots (`slots`), and the local lengths."""
        B, T = self.batch.num_reqs, self.batch.num_tokens
        pos, row = self.o_positions[:T], self.t_row[:T]
        for g, table in enumerate(self.d_block_tables):
            for i, lays in enumerate(self.rank_layouts):
                slots(table, row, pos, lays[g], out=self.o_rank_slot_mapping[i, g, :T])
        for i, lay in enumerate(self.seq_layouts):
            local_seq_lens(self.o_seq_lens[:B], lay, out=self.o_dcp_local_seq_lens[i, :B])

    def compute_slot_mappings(self) -> None:
        T = self.batch.num_tokens
        if self.multirank:
            return self.device_rank_slot_mappings()
        pos, row = self.o_positions[:T], self.t_row[:T]
        for g, table in enumerate(self.d_block_tables):
            slots(table, row, pos, self.layouts[g], out=self.o_slot_mapping[g, :T])
        if self._prev_T > T:  # padding restarts at the actual count (vLLM #36580)
            self.o_slot_mapping[:, T : self._prev_T] = PAD_SLOT_ID
        self._prev_T = T

    # ------------------------------------------------------------------ KV cache

    def make_kv_cache(self, geometry: KVGeometry) -> PagedKVCache:
        return make_rank_caches(self, geometry, lambda g: PagedKVCache(self.header, g, device=str(self.torch_device),
                                                                       torch_storage=True))

    def write_kv(self, kv: PagedKVCache | RankedKVCache) -> None:
        T = self.batch.num_tokens
        if isinstance(kv, RankedKVCache):
            for i, shard in enumerate(kv.shards):
                shard.write_device(self.o_input_ids[:T], self.o_positions[:T], self.o_rank_slot_mapping[i, :, :T],
                                   skip_pad=True)
            return
        kv.write_device(self.o_input_ids[:T], self.o_positions[:T], self.o_slot_mapping[:, :T],
                        skip_pad=len(self.state.kv_groups) < self.header.num_groups)

    def verify_kv(self, kv: PagedKVCache | RankedKVCache, into: KVCheckResult) -> None:
        """Read back on the device; one host sync per group for the mismatch count (a check, not a step)."""
        if isinstance(kv, RankedKVCache) or len(self.state.kv_groups) < self.header.num_groups:
            return NumpyWorker.verify_kv(self, kv, into)  # per rank, from the host mirror of the state
        t = torch()
        B = self.batch.num_reqs
        nc_h, end_h = self.host_batch()
        idx = self.o_idx_mapping[:B]
        req_ids = self.batch.batch_req_ids()
        for g, lay in enumerate(self.layouts):
            lo_h = lay.readable_lo(nc_h)
            cnt_h = end_h - lo_h
            total = int(cnt_h.sum())
            if not total:
                continue
            lo = t.from_numpy(lo_h).to(idx.device)
            cnt = t.from_numpy(cnt_h).to(idx.device)
            breq = t.repeat_interleave(t.arange(B, device=idx.device), cnt, output_size=total)
            start = t.cumsum(cnt, 0) - cnt
            pos = t.arange(total, device=idx.device) - (start - lo)[breq]
            rows = idx[breq]
            slot = slots(self.d_block_tables[g], rows, pos, lay)
            toks = self.d_token_ids[rows, pos]
            bad = (kv.bits[g][:, slot] != kv.values_torch(toks, pos)).any(dim=2).any(dim=0)
            into.checked += total
            nbad = int(bad.sum())
            into.mismatches += nbad
            for i in (t.nonzero(bad)[: into.room(), 0].tolist() if nbad else ()):
                into.examples.append(KVMismatch(self.current_step, req_ids[int(breq[i])], g, int(pos[i]),
                                                int(slot[i]), int(toks[i]), kv.describe(g, int(slot[i]))))

    # ------------------------------------------------------------------ results

    def host_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(num_computed_tokens, seq_lens) of the batch, int64, from the host mirror: no device sync."""
        b = self.batch
        nc = self.state.num_computed_tokens[b.rows[b.order]].astype(np.int64)
        return nc, nc + b.num_scheduled_tokens[b.order]

    def mappings(self) -> BatchMappings:
        """A host copy of this step's device mappings (synchronizes: for dumps and checks only)."""
        if self._mappings is None:
            B, T = self.batch.num_reqs, self.batch.num_tokens
            self._mappings = BatchMappings(
                req_ids=list(self.batch.batch_req_ids()),
                idx_mapping=self.o_idx_mapping[:B].cpu().numpy().astype(np.int32),
                num_scheduled_tokens=self.o_num_scheduled[:B].cpu().numpy(),
                num_computed_tokens=self.o_num_computed[:B].cpu().numpy(),
                query_start_loc=self.o_query_start_loc[: B + 1].cpu().numpy(),
                seq_lens=self.o_seq_lens[:B].cpu().numpy(),
                positions=self.o_positions[:T].cpu().numpy(),
                input_ids=self.o_input_ids[:T].cpu().numpy(),
                block_tables=[b[:B].cpu().numpy() for b in self.o_block_tables],
                num_blocks=self.o_num_blocks[:, :B].cpu().numpy(),
                slot_mapping=self.o_slot_mapping[:, :T].cpu().numpy(),
            )
            m = self._mappings
            if self.multirank:
                m.cp_size, m.ranks = self.header.decode_context_parallel_size, self.ranks
                m.rank_slot_mapping = self.o_rank_slot_mapping[: len(self.ranks), :, :T].cpu().numpy()
                m.slot_mapping = m.rank_slot_mapping[0]
                m.dcp_local_seq_lens = self.o_dcp_local_seq_lens[: len(self.ranks), :B].cpu().numpy()
            if self.kernel_split:
                m.kernel_block_tables = [k[:B].cpu().numpy() for k in self.o_kernel_block_tables]
                m.kernel_blocks_per_block = self.buffers.kernel_blocks_per_block
        return self._mappings
