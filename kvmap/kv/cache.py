"""The paged KV cache: one page table per KV cache group, written every step through `slot_mapping`.

Layout (FlashAttention's): `[2, num_gpu_blocks, block_size, num_kv_heads, head_size]`, K then V; a slot
`s` is `[:, s // block_size, s % block_size]`. All groups draw block ids from the one pool of
`num_gpu_blocks`, as in vLLM, but each group has its own memory (a block id means one page per group).

Rules:
- Storage only: the cache takes arrays (token ids, positions, slots, block rows), never a worker, and knows
  nothing of backends. Which write and read-back path runs is the caller's choice (`use_kernels`).
- The values written are the canary (kv/canary.py), stored bit for bit through an integer view, so a
  read-back can tell exactly which token and position a slot holds, whatever the dtype.
- Host memory is plain numpy (no torch import on the host path): `bits[g]` is `[2, num_slots, H*D]` of the
  dtype's integer width. On a torch device (`device != "cpu"` or `torch_storage=True`) the same views are
  torch tensors; `tensor(g)` gives the typed `[2, blocks, block_size, H, D]` tensor either way.
- Padding slots (`PAD_SLOT_ID = -1`) are skipped, never written (indexing with -1 would hit the last slot).
- Read-backs cover each scheduled request's readable context (layout.readable_lo) and record at most
  `max_examples` located mismatches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvmap.defaults import KV_DTYPE, KV_HEAD_SIZE, KV_HEADS
from kvmap.errors import KvmapError
from kvmap.kv.canary import canary, canary_torch
from kvmap.trace.header import check_fits, kv_memory

# dtype name -> (torch dtype attribute, integer view dtype in numpy, in torch)
KV_DTYPES = {
    "bfloat16": ("bfloat16", np.int16, "int16"),
    "float16": ("float16", np.int16, "int16"),
    "float32": ("float32", np.int32, "int32"),
    "float8_e4m3fn": ("float8_e4m3fn", np.int8, "int8"),
    "fp8": ("float8_e4m3fn", np.int8, "int8"),
}


@dataclass(frozen=True, slots=True)
class KVGeometry:
    num_kv_heads: int = KV_HEADS
    head_size: int = KV_HEAD_SIZE
    dtype: str = KV_DTYPE

    @property
    def lanes(self) -> int:  # elements per token: K and V, every head
        return 2 * self.num_kv_heads * self.head_size

    @property
    def bytes_per_token(self) -> int:
        return self.lanes * np.dtype(KV_DTYPES[self.dtype][1]).itemsize

    def tp_shard(self, tp: int) -> KVGeometry:
        """One TP rank's share: num_kv_heads // tp heads, replicated (one each) when tp > num_kv_heads."""
        if tp <= 1:
            return self
        return KVGeometry(max(1, self.num_kv_heads // tp), self.head_size, self.dtype)

    def check(self) -> KVGeometry:
        if self.dtype not in KV_DTYPES:
            raise KvmapError(f"unknown KV dtype {self.dtype!r}; choose one of {', '.join(KV_DTYPES)}",
                             field="--kv-dtype")
        if self.num_kv_heads < 1 or self.head_size < 1:
            raise KvmapError("KV heads and head size must be >= 1", field="--kv-heads/--head-size")
        return self


@dataclass(slots=True)
class KVMismatch:
    step: int
    req_id: str
    group: int
    position: int
    slot: int
    expected_token: int  # token id the request has at this position
    found: str  # what the slot holds: "bits of another token or position", or "never written"
    rank: int = 0  # DCP rank whose shard was read


@dataclass(slots=True)
class KVCheckResult:
    checked: int = 0  # (position, group) pairs read back
    mismatches: int = 0
    examples: list[KVMismatch] = field(default_factory=list)
    max_examples: int = 20
    rank_checked: dict[int, int] = field(default_factory=dict)  # DCP rank -> positions read back (cp > 1)
    rank_mismatches: dict[int, int] = field(default_factory=dict)

    def room(self) -> int:
        return max(self.max_examples - len(self.examples), 0)


class PagedKVCache:
    def __init__(self, header, geometry: KVGeometry, device: str = "cpu", use_kernels: bool = False,
                 torch_storage: bool = False) -> None:
        """`use_kernels`: write and read back with the compiled CPU kernels (kv/kernels.py; same bits as the
        vectorized path). `torch_storage`: hold host memory in torch tensors (device workers on CPU)."""
        geometry.check()
        self.header = header
        self.geometry = geometry
        self.device = device
        tdtype, self.np_bits, self._tbits = KV_DTYPES[geometry.dtype]
        self._tdtype = tdtype
        H, D = geometry.num_kv_heads, geometry.head_size
        self.block_sizes = [g.block_size for g in header.kv_cache_groups]
        # a group without a slot mapping (a state group) holds no per-token KV here: no slots, never read back
        shapes = [(2, header.num_gpu_blocks * bs if getattr(grp, "uses_slot_mapping", True) else 0, H * D)
                  for bs, grp in zip(self.block_sizes, header.kv_cache_groups)]
        self.on_torch = device != "cpu" or torch_storage
        if device == "cpu":  # a pool too big for this machine: one located error, not a MemoryError
            try:
                check_fits(header, kv_memory(header, geometry.bytes_per_token + 1))
            except KvmapError as e:  # the header's pool times the options' geometry: say both
                if geometry == KVGeometry():
                    raise
                raise KvmapError(f"{e.message}, with {H} KV heads x {D} x {geometry.dtype} per slot from --kv-heads, "
                                 "--head-size and --kv-dtype: lower them", field="--kv-heads/--head-size") from None
        if self.on_torch:
            from kvmap._torch import torch

            t = torch()
            self.bits = [t.zeros(s, dtype=getattr(t, self._tbits), device=device) for s in shapes]
        else:
            self.bits = [np.zeros(s, dtype=self.np_bits) for s in shapes]  # [G] x [2, num_slots, H*D]
        self.written = [np.zeros(s[1], dtype=bool) for s in shapes]  # [G] x [num_slots] host bookkeeping
        self.bytes = sum(int(np.prod(s)) * np.dtype(self.np_bits).itemsize for s in shapes)
        self.kernels = None
        if use_kernels and not self.on_torch:
            from kvmap.aot import load

            self.kernels = load("kvmap.kv.kernels")
            udt = np.dtype(f"u{np.dtype(self.np_bits).itemsize}")
            self._kv_write = self.kernels.variant("kv_write", udt)  # the export for this dtype, picked once
            self._kv_verify = self.kernels.variant("kv_verify_dcp", udt)
            self._ubits = [b.view(udt) for b in self.bits]  # same memory, unsigned view
            self._mask = np.uint64((1 << (8 * udt.itemsize)) - 1)
            self._bad = np.zeros((20, 3), dtype=np.int64)

    def tensor(self, g: int):
        """Group g's cache as a typed torch tensor `[2, num_gpu_blocks, block_size, H, D]` (same memory)."""
        from kvmap._torch import torch

        t = torch()
        b = self.bits[g] if self.on_torch else t.from_numpy(self.bits[g])
        H, D = self.geometry.num_kv_heads, self.geometry.head_size
        return b.view(getattr(t, self._tdtype)).view(2, self.header.num_gpu_blocks, self.block_sizes[g], H, D)

    # ------------------------------------------------------------------------------------------ values

    def values(self, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """[n] tokens, [n] positions -> [2, n, H*D] canary values in the cache's integer dtype."""
        v = canary(token_ids, positions, self.geometry.lanes).astype(f"u{np.dtype(self.np_bits).itemsize}")
        return v.view(self.np_bits).reshape(len(token_ids), 2, self.geometry.lanes // 2).transpose(1, 0, 2)

    def values_torch(self, token_ids, positions):
        """`values` on a torch device: [n] tokens, [n] positions -> [2, n, H*D] in the cache's integer dtype."""
        lanes = self.geometry.lanes
        width = 8 * np.dtype(self.np_bits).itemsize
        x = canary_torch(token_ids, positions, lanes)  # [n, lanes] int64 in [0, 2**32)
        half = 1 << (width - 1)
        x = ((x + half) & ((1 << width) - 1)) - half  # the low `width` bits, as a signed value
        return x.to(self.bits[0].dtype).view(len(token_ids), 2, lanes // 2).permute(1, 0, 2)

    # ------------------------------------------------------------------------------------------ writes

    def write(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray) -> None:
        """Write one step's tokens from host arrays: input_ids, positions [T]; slot_mapping [G, T]."""
        if self.kernels is not None:
            for g, ub in enumerate(self._ubits):
                self._kv_write(input_ids, positions, slot_mapping[g], ub, self._mask, self.written[g])
            return
        values = self.values(input_ids, positions)
        for g, bits in enumerate(self.bits):
            slots = slot_mapping[g]
            vals = values
            if len(slots) and slots.min() < 0:
                keep = slots >= 0
                slots, vals = slots[keep], values[:, keep]
            if self.on_torch:
                from kvmap._torch import torch

                bits[:, torch().from_numpy(np.ascontiguousarray(slots))] = torch().from_numpy(
                    np.ascontiguousarray(vals)).to(bits.device)
            else:
                bits[:, slots] = vals
            self.written[g][slots] = True

    def write_device(self, input_ids, positions, slot_mapping, skip_pad: bool = False) -> None:
        """Write from device tensors, on the device (torch ops; no host sync). Padding slots must not occur
        before the step's token count, which the caller slices to, unless `skip_pad` (DCP ranks, state groups:
        -1 for tokens this rank does not hold; the mask costs a sync)."""
        values = self.values_torch(input_ids, positions)  # [2, T, H*D]
        for g, bits in enumerate(self.bits):
            slots = slot_mapping[g]
            if skip_pad:
                keep = slots >= 0
                if bits.shape[1] == 0:
                    continue
                bits[:, slots[keep]] = values[:, keep]
            else:
                bits[:, slots] = values

    # ---------------------------------------------------------------------------------------- read-back

    def verify_context(self, g: int, step: int, req_ids, breq: np.ndarray, pos: np.ndarray, slots: np.ndarray,
                       tokens: np.ndarray, into: KVCheckResult) -> None:
        """Compare group g's slots with the canary of (token, position): [n] arrays of batch index, position,
        slot and token id over the readable context."""
        if not len(pos):
            return
        into.checked += len(pos)
        bits = self.bits[g]
        if self.on_torch:
            got = bits[:, np.ascontiguousarray(slots)].cpu().numpy()
        else:
            got = bits[:, slots]  # [2, n, H*D]
        bad = np.flatnonzero((got != self.values(tokens, pos)).any(axis=(0, 2)))
        into.mismatches += len(bad)
        for i in bad[: into.room()]:
            into.examples.append(KVMismatch(step, req_ids[breq[i]], g, int(pos[i]), int(slots[i]), int(tokens[i]),
                                            self.describe(g, int(slots[i]))))

    def verify_rows(self, g: int, step: int, req_ids, idx_mapping: np.ndarray, lo: np.ndarray,
                    seq_lens: np.ndarray, token_ids: np.ndarray, table: np.ndarray, into: KVCheckResult,
                    cp: tuple[int, int, int] | None = None) -> None:
        """The compiled read-back: positions lo[b] .. seq_lens[b] - 1 of batch request b through row
        idx_mapping[b] of the persistent `token_ids` and block `table` (needs `use_kernels`). `cp`:
        (cp_size, cp_rank, interleave) of the DCP rank this shard belongs to (only its local positions)."""
        assert self.kernels is not None
        checked, bad = self._kv_verify(idx_mapping, lo, seq_lens, token_ids, table, self.block_sizes[g],
                                       *(cp or (1, 0, 1)), self._ubits[g], self._mask, self._bad)
        into.checked += checked
        into.mismatches += bad
        for b, p, s in self._bad[: min(bad, into.room(), len(self._bad))].tolist():
            into.examples.append(KVMismatch(step, req_ids[b], g, p, s, int(token_ids[idx_mapping[b], p]),
                                            self.describe(g, s)))

    def describe(self, g: int, slot: int) -> str:
        if not self.written[g][slot]:
            return "never written"
        return "bits of another token or position"


class RankedKVCache:
    """Every computed DCP rank's KV shard in one process: shard i is rank ranks[i]'s cache, holding only
    the tokens local to that rank (its slots are that rank's `slot_mapping`)."""

    def __init__(self, ranks: tuple[int, ...], shards: list[PagedKVCache]) -> None:
        self.ranks = ranks
        self.shards = shards
        self.geometry = shards[0].geometry
        self.bytes = sum(s.bytes for s in shards)
        self.bytes_per_rank = shards[0].bytes
        self.kernels = None  # a shard may have kernels; the container is read back shard by shard (`verify`)

    def verify(self, into: KVCheckResult, check) -> None:
        """`check(i, shard)` reads back shard i; the outcome is also counted per rank, examples named by rank."""
        for i, (r, shard) in enumerate(zip(self.ranks, self.shards)):
            c, m, e = into.checked, into.mismatches, len(into.examples)
            check(i, shard)
            into.rank_checked[r] = into.rank_checked.get(r, 0) + into.checked - c
            into.rank_mismatches[r] = into.rank_mismatches.get(r, 0) + into.mismatches - m
            for ex in into.examples[e:]:
                ex.rank = r
