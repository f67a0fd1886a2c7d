"""The paged KV cache: one torch tensor per KV cache group, written every step through `slot_mapping`.

Layout (FlashAttention's): `[2, num_gpu_blocks, block_size, num_kv_heads, head_size]`, K then V; a slot
`s` is `[:, s // block_size, s % block_size]`. All groups draw block ids from the one pool of
`num_gpu_blocks`, as in vLLM, but each group has its own tensor (a block id means one page per group).

Rules:
- The values written are a canary: a 32-bit hash of (token id, position, lane) truncated to the element
  width and stored bit for bit through an integer view of the tensor. So a read-back can tell exactly which
  token and position a slot holds, whatever the dtype (float NaN patterns included).
- Padding slots (`PAD_SLOT_ID = -1`) are skipped, never written (indexing with -1 would hit the last slot).
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
        """`use_kernels`: write and verify with the compiled CPU kernels when numba is installed (same bits as
        the torch path, which is used otherwise and tested against them)."""
        t = torch()
        geometry.check()
        self.header = header
        self.geometry = geometry
        tdtype, self.np_bits, tbits = KV_DTYPES[geometry.dtype]
        self.caches = []  # [num_groups] x [2, num_blocks, block_size, H, D]
        self.bits = []  # [num_groups] x [2, num_blocks * block_size, H * D] integer views of the same memory
        H, D = geometry.num_kv_heads, geometry.head_size
        for g in header.kv_cache_groups:
            cache = t.zeros((2, header.num_gpu_blocks, g.block_size, H, D), dtype=getattr(t, tdtype),
                            device=device)
            self.caches.append(cache)
            self.bits.append(cache.view(getattr(t, tbits)).view(2, header.num_gpu_blocks * g.block_size, H * D))
        self.written = [np.zeros(header.num_gpu_blocks * g.block_size, dtype=bool) for g in header.kv_cache_groups]
        self.bytes = sum(c.numel() * c.element_size() for c in self.caches)
        self.kernels = None
        if device == "cpu" and use_kernels:
            try:
                from kvmap import kernels_cpu
            except ImportError:
                pass
            else:
                self.kernels = kernels_cpu
                udt = np.dtype(f"u{np.dtype(self.np_bits).itemsize}")
                self.ubits = [b.numpy().view(udt) for b in self.bits]  # same memory, unsigned view
                self.mask = np.uint64((1 << (8 * udt.itemsize)) - 1)
                self._bad = np.zeros((max_examples, 3), dtype=np.int64)

    def _values(self, token_ids: np.ndarray, positions: np.ndarray):
        v = canary(token_ids, positions, self.geometry.lanes).astype(f"u{np.dtype(self.np_bits).itemsize}")
        v = v.view(self.np_bits).reshape(len(token_ids), 2, self.geometry.lanes // 2)  # [n, K/V, H*D]
        return torch().from_numpy(v).permute(1, 0, 2)  # [2, n, H*D]

    def write(self, m: BatchMappings) -> None:
        if self.kernels is not None:
            for g, ub in enumerate(self.ubits):
                slots = m.slot_mapping[g]
                self.kernels.kv_write(m.input_ids, m.positions, slots, ub, self.mask)
                self.written[g][slots[slots >= 0]] = True
            return
        t = torch()
        values = self._values(m.input_ids, m.positions)
        for g, bits in enumerate(self.bits):
            slots = m.slot_mapping[g]
            if len(slots) and slots.min() < 0:
                keep = slots >= 0
                slots, vals = slots[keep], values[:, t.from_numpy(keep)]
            else:
                vals = values
            bits[:, t.from_numpy(slots)] = vals
            self.written[g][slots] = True

    def verify(self, worker, step: int, req_ids: list[str], into: KVCheckResult | None = None,
               max_examples: int = 20) -> KVCheckResult:
        """Read back this step's readable context in every group; add the outcome to `into`."""
        res = into if into is not None else KVCheckResult()
        if self.kernels is not None and hasattr(worker, "state"):
            return self._verify_kernels(worker, step, req_ids, res, max_examples)
        t = torch()
        for g, bits in enumerate(self.bits):
            breq, pos, slots, tokens = worker.readable_context(g)
            if not len(pos):
                continue
            res.checked += len(pos)
            got = bits[:, t.from_numpy(np.ascontiguousarray(slots))].numpy()  # [2, n, H*D]
            want = self._values(tokens, pos).numpy()
            bad = np.flatnonzero((got != want).any(axis=(0, 2)))
            if not len(bad):
                continue
            res.mismatches += len(bad)
            for i in bad[: max(max_examples - len(res.examples), 0)]:
                res.examples.append(KVMismatch(step, req_ids[breq[i]], g, int(pos[i]), int(slots[i]),
                                               int(tokens[i]), self._describe(g, int(slots[i]), got[:, i])))
        return res

    def _verify_kernels(self, worker, step: int, req_ids: list[str], res: KVCheckResult,
                        max_examples: int) -> KVCheckResult:
        m = worker.mappings()
        st = worker.state
        nc = m.num_computed_tokens.astype(np.int64)
        for g, grp in enumerate(self.header.kv_cache_groups):
            if grp.kind == "sliding_window":
                lo = np.maximum(nc - grp.sliding_window + 1, 0)
            elif grp.kind == "chunked_local":
                lo = nc // grp.attention_chunk_size * grp.attention_chunk_size
            else:
                lo = np.zeros_like(nc)
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
