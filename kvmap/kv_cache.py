"""The paged KV cache: one array per KV cache group, written every step through `slot_mapping`.

Layout (FlashAttention's): `[2, num_gpu_blocks, block_size, num_kv_heads, head_size]`, K then V; a slot
`s` is `[:, s // block_size, s % block_size]`. All groups draw block ids from the one pool of
`num_gpu_blocks`, as in vLLM, but each group has its own tensor (a block id means one page per group).

Rules:
- The values written are a canary: a 32-bit hash of (token id, position, lane) truncated to the element
  width and stored bit for bit through an integer view of the tensor. So a read-back can tell exactly which
  token and position a slot holds, whatever the dtype (float NaN patterns included).
- Padding slots (`PAD_SLOT_ID = -1`) are skipped, never written (indexing with -1 would hit the last slot).
- Host memory is plain numpy (integer arrays of the element width: the host backends never import torch,
  ~2 s of start-up); `as_torch()` gives typed torch tensors over the same memory for anyone who asks, and
  device workers on the CPU write through torch views of it. On a GPU the cache is torch tensors.
- `verify` reads back every scheduled request's readable context (all positions for full attention, the
  window for sliding-window groups, the current chunk for chunked-local ones) through its block table and
  compares bits. Positions past `num_computed_tokens` after a speculative rollback are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvmap._torch import torch
from kvmap.batch import BatchMappings
from kvmap.errors import KvmapError
from kvmap.reference import readable_lo
from kvmap.trace import TraceHeader

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
    num_kv_heads: int = 1
    head_size: int = 8
    dtype: str = "bfloat16"

    @property
    def lanes(self) -> int:  # elements per token: K and V, every head
        return 2 * self.num_kv_heads * self.head_size

    @property
    def bytes_per_token(self) -> int:
        return self.lanes * np.dtype(KV_DTYPES[self.dtype][1]).itemsize

    def check(self) -> KVGeometry:
        if self.dtype not in KV_DTYPES:
            raise KvmapError(f"unknown KV dtype {self.dtype!r}; choose one of {', '.join(KV_DTYPES)}",
                             field="--kv-dtype")
        if self.num_kv_heads < 1 or self.head_size < 1:
            raise KvmapError("KV heads and head size must be >= 1", field="--kv-heads/--head-size")
        return self


_M = np.uint32


def canary(token_ids: np.ndarray, positions: np.ndarray, lanes: int) -> np.ndarray:
    """[n] token ids, [n] positions -> [n, lanes] uint32 hashes (lowbias32 of a mix of the three)."""
    x = token_ids.astype(_M) * _M(0x9E3779B1) ^ positions.astype(_M) * _M(0x85EBCA77)
    x = x[:, None] + np.arange(lanes, dtype=_M)[None, :] * _M(0xC2B2AE3D)
    x ^= x >> _M(16)
    x *= _M(0x7FEB352D)
    x ^= x >> _M(15)
    x *= _M(0x846CA68B)
    x ^= x >> _M(16)
    return x


def canary_torch(token_ids, positions, lanes: int):
    """`canary` in torch int64 arithmetic (any device): [n] token ids, [n] positions -> [n, lanes]."""
    t = torch()
    m = 0xFFFFFFFF
    x = ((token_ids.to(t.int64) * 0x9E3779B1) & m) ^ ((positions.to(t.int64) * 0x85EBCA77) & m)
    x = (x[:, None] + t.arange(lanes, dtype=t.int64, device=x.device)[None, :] * 0xC2B2AE3D) & m
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    x ^= x >> 16
    return x


@dataclass(slots=True)
class KVMismatch:
    step: int
    req_id: str
    group: int
    position: int
    slot: int
    expected_token: int  # token id the request has at this position
    found: str  # what the slot holds: "token T at position P", or "never written"/"unknown bits"


@dataclass(slots=True)
class KVCheckResult:
    checked: int = 0  # (position, group) pairs read back
    mismatches: int = 0
    examples: list[KVMismatch] = field(default_factory=list)


class PagedKVCache:
    def __init__(self, header: TraceHeader, geometry: KVGeometry, device: str = "cpu", use_kernels: bool = True,
                 max_examples: int = 20) -> None:
        """`device`: "cpu" holds the cache in numpy host memory (no torch); a GPU device in torch tensors.
        `use_kernels`: write and verify with the compiled CPU kernels when numba is installed (same bits as
        the numpy path, which is used otherwise and tested against them)."""
        geometry.check()
        self.header = header
        self.geometry = geometry
        self.device = device
        tdtype, self.np_bits, tbits = KV_DTYPES[geometry.dtype]
        H, D = geometry.num_kv_heads, geometry.head_size
        host = device == "cpu"
        # [num_groups] x [2, num_blocks, block_size, H, D]: integer-typed on the host (see as_torch), typed on a GPU
        self.caches = []
        self.bits = []  # [num_groups] x [2, num_blocks * block_size, H * D] integer views of the same memory
        for g in header.kv_cache_groups:
            shape = (2, header.num_gpu_blocks, g.block_size, H, D)
            if host:
                cache = np.zeros(shape, dtype=self.np_bits)
                self.caches.append(cache)
                self.bits.append(cache.reshape(2, header.num_gpu_blocks * g.block_size, H * D))
            else:
                t = torch()
                cache = t.zeros(shape, dtype=getattr(t, tdtype), device=device)
                self.caches.append(cache)
                self.bits.append(cache.view(getattr(t, tbits)).view(2, header.num_gpu_blocks * g.block_size, H * D))
        self._tbits = None if host else self.bits
        self.written = [np.zeros(header.num_gpu_blocks * g.block_size, dtype=bool) for g in header.kv_cache_groups]
        self.bytes = sum(c.nbytes if host else c.numel() * c.element_size() for c in self.caches)
        self.kernels = None
        if host and use_kernels:
            try:
                from kvmap import kernels_cpu
            except ImportError:
                pass
            else:
                self.kernels = kernels_cpu
                udt = np.dtype(f"u{np.dtype(self.np_bits).itemsize}")
                self.ubits = [b.view(udt) for b in self.bits]  # same memory, unsigned view
                self.mask = np.uint64((1 << (8 * udt.itemsize)) - 1)
                self._bad = np.zeros((max_examples, 3), dtype=np.int64)

    def as_torch(self) -> list:
        """[num_groups] x [2, num_blocks, block_size, H, D] torch tensors of the KV dtype, sharing this memory."""
        if self.device != "cpu":
            return self.caches
        t = torch()
        return [t.from_numpy(c).view(getattr(t, KV_DTYPES[self.geometry.dtype][0])) for c in self.caches]

    def torch_bits(self) -> list:
        """`bits` as torch tensors (views of the host memory on the CPU): for device workers' torch ops."""
        if self._tbits is None:
            self._tbits = [torch().from_numpy(b) for b in self.bits]
        return self._tbits

    def _values(self, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        v = canary(token_ids, positions, self.geometry.lanes).astype(f"u{np.dtype(self.np_bits).itemsize}")
        v = v.view(self.np_bits).reshape(len(token_ids), 2, self.geometry.lanes // 2)  # [n, K/V, H*D]
        return v.transpose(1, 0, 2)  # [2, n, H*D]

    def write_device(self, batch: dict) -> None:
        """Write from a device worker's tensors, on the device (torch ops; no host sync)."""
        ids, pos, slots = batch["input_ids"], batch["positions"], batch["slot_mapping"]
        values = self._values_torch(ids, pos)  # [2, T, H*D]
        for g, bits in enumerate(self.torch_bits()):
            bits[:, slots[g]] = values

    def _values_torch(self, token_ids, positions):
        lanes = self.geometry.lanes
        width = 8 * np.dtype(self.np_bits).itemsize
        x = canary_torch(token_ids, positions, lanes)  # [n, lanes] int64 in [0, 2**32)
        half = 1 << (width - 1)
        x = ((x + half) & ((1 << width) - 1)) - half  # the low `width` bits, as a signed value
        return x.to(self.torch_bits()[0].dtype).view(len(token_ids), 2, lanes // 2).permute(1, 0, 2)

    def write(self, m: BatchMappings) -> None:
        self.write_tokens(m.input_ids, m.positions, m.slot_mapping)

    def write_tokens(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray) -> None:
        """Write one step's tokens: input_ids, positions [T]; slot_mapping [G, T] (PAD_SLOT_ID skipped)."""
        if self.kernels is not None:
            for g, ub in enumerate(self.ubits):
                self.kernels.kv_write(input_ids, positions, slot_mapping[g], ub, self.mask, self.written[g])
            return
        values = self._values(input_ids, positions)
        for g, bits in enumerate(self.bits):
            slots = slot_mapping[g]
            if len(slots) and slots.min() < 0:
                keep = slots >= 0
                slots, vals = slots[keep], values[:, keep]
            else:
                vals = values
            bits[:, slots] = vals
            self.written[g][slots] = True

    def verify(self, worker, step: int, req_ids: list[str], into: KVCheckResult | None = None,
               max_examples: int = 20) -> KVCheckResult:
        """Read back this step's readable context in every group; add the outcome to `into`."""
        res = into if into is not None else KVCheckResult()
        if hasattr(worker, "verify_kv"):
            return worker.verify_kv(self, step, req_ids, res, max_examples)
        if hasattr(worker, "d_token_ids"):
            return self._verify_device(worker, step, req_ids, res, max_examples)
        if self.kernels is not None and hasattr(worker, "state"):
            return self._verify_kernels(worker, step, req_ids, res, max_examples)
        for g, bits in enumerate(self.bits):
            breq, pos, slots, tokens = worker.readable_context(g)
            if not len(pos):
                continue
            res.checked += len(pos)
            got = bits[:, slots]  # [2, n, H*D]
            want = self._values(tokens, pos)
            bad = np.flatnonzero((got != want).any(axis=(0, 2)))
            if not len(bad):
                continue
            res.mismatches += len(bad)
            for i in bad[: max(max_examples - len(res.examples), 0)]:
                res.examples.append(KVMismatch(step, req_ids[breq[i]], g, int(pos[i]), int(slots[i]),
                                               int(tokens[i]), self._describe(g, int(slots[i]), got[:, i])))
        return res

    def _verify_device(self, worker, step: int, req_ids: list[str], res: KVCheckResult,
                       max_examples: int) -> KVCheckResult:
        """Read back on the device; one host sync per group for the mismatch count (a check, not a step)."""
        t = torch()
        B = worker._B
        nc_h, end_h = worker.host_batch()
        d = worker.device_batch()
        idx = d["idx_mapping"]
        for g, grp in enumerate(self.header.kv_cache_groups):
            lo_h = readable_lo(grp, nc_h)
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
            bs = grp.block_size
            table = worker.d_block_tables[g]
            slots = table[rows, t.div(pos, bs, rounding_mode="floor")].to(t.int64) * bs + pos % bs
            toks = worker.d_token_ids[rows, pos]
            got = self.torch_bits()[g][:, slots]
            want = self._values_torch(toks, pos)
            bad = (got != want).any(dim=2).any(dim=0)
            res.checked += total
            nbad = int(bad.sum())
            res.mismatches += nbad
            if nbad:
                for i in t.nonzero(bad)[: max(max_examples - len(res.examples), 0), 0].tolist():
                    b = int(breq[i])
                    res.examples.append(KVMismatch(step, req_ids[b], g, int(pos[i]), int(slots[i]), int(toks[i]),
                                                   "bits of another token or position (or never written)"))
        return res

    def _verify_kernels(self, worker, step: int, req_ids: list[str], res: KVCheckResult,
                        max_examples: int) -> KVCheckResult:
        m = worker.mappings()
        st = worker.state
        nc = m.num_computed_tokens.astype(np.int64)
        for g, grp in enumerate(self.header.kv_cache_groups):
            lo = readable_lo(grp, nc)
            checked, bad = self.kernels.kv_verify(m.idx_mapping, lo, m.seq_lens, st.token_ids, st.block_tables[g],
                                                  grp.block_size, self.ubits[g], self.mask, self._bad)
            res.checked += checked
            res.mismatches += bad
            for b, p, s in self._bad[: min(bad, max(max_examples - len(res.examples), 0))].tolist():
                res.examples.append(KVMismatch(step, req_ids[b], g, p, s, int(st.token_ids[m.idx_mapping[b], p]),
                                               self._describe(g, s, None)))
        return res

    def _describe(self, g: int, slot: int, bits: np.ndarray | None) -> str:
        if not self.written[g][slot]:
            return "never written"
        return "bits of another token or position"

