"""The one owner of the address arithmetic: where a token's KV lives, and which positions a step may read.

Rules:
- `GroupLayout.slot` is the spec, one token at a time in plain integers: every vectorized (numpy), compiled
  (numba) and Triton form of the slot rule is tested against it (tests/test_layout.py), and the reference
  worker calls it directly. Nothing else in kvmap writes `block * block_size + offset` on its own.
- Block sizes (trace-format.md, "Which block size is which"): `block_size` is the tokens one rank stores per
  block id (vLLM's `KVCacheSpec.block_size`); with decode context parallelism a block id spans
  `block_size * cp_size` global positions (`virtual_block_size`); `kernel_block_size` divides `block_size`
  and is what the attention kernel sees.
- `readable_start` is the one window rule (vLLM's skipped-token rule): the first position a step starting at
  `num_computed_tokens` may read; `readable_lo` is the same rule for a batch.
- Padding and tokens another rank holds are `PAD_SLOT_ID` (-1), never slot 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PAD_SLOT_ID = -1  # slot_mapping entry for padding and for tokens that are not local to this rank


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Address arithmetic of one KV cache group as one rank sees it."""

    block_size: int  # tokens one rank stores per block id (KVCacheSpec.block_size)
    kind: str = "full_attention"  # full_attention | sliding_window | chunked_local | mamba
    sliding_window: int | None = None  # tokens (sliding_window groups)
    attention_chunk_size: int | None = None  # tokens (chunked_local groups)
    kernel_block_size: int | None = None  # None: the kernel sees block_size
    cp_size: int = 1  # decode context parallel world size (1 for a replicated group)
    cp_rank: int = 0  # this rank, 0 .. cp_size - 1
    interleave: int = 1  # cp_kv_cache_interleave_size: consecutive tokens per rank

    @classmethod
    def of(cls, group, cp_size: int = 1, cp_rank: int = 0, interleave: int = 1) -> GroupLayout:
        """The layout of a trace header's `KVCacheGroup` on DCP rank `cp_rank`."""
        return cls(group.block_size, group.kind, group.sliding_window, group.attention_chunk_size,
                   cp_size=cp_size, cp_rank=cp_rank, interleave=interleave)

    @property
    def virtual_block_size(self) -> int:
        """Global positions one block id spans: block_size * cp_size."""
        return self.block_size * self.cp_size

    # ------------------------------------------------------------------------------------------ the spec

    def block_of(self, position: int) -> tuple[int, int]:
        """(logical block index into the row, offset inside that block) of a global position."""
        return divmod(position, self.virtual_block_size)

    def is_local(self, position: int) -> bool:
        """Whether this rank stores the token at `position` (always, without context parallelism)."""
        return (position % self.virtual_block_size // self.interleave) % self.cp_size == self.cp_rank

    def local_offset(self, position: int) -> int:
        """Row inside the physical block (0 .. block_size - 1) of a local token."""
        off = position % self.virtual_block_size
        I = self.interleave
        return off // (I * self.cp_size) * I + off % I

    def slot(self, block_row: Sequence[int], position: int) -> int:
        """`block_row[pos // block_size] * block_size + pos % block_size` (cp = 1), or the per-rank rule:
        PAD_SLOT_ID where another rank holds the token."""
        if self.kind == "mamba" or not self.is_local(position):
            return PAD_SLOT_ID
        vb, _ = self.block_of(position)
        return block_row[vb] * self.block_size + self.local_offset(position)

    def readable_start(self, num_computed_tokens: int) -> int:
        """First position a step starting at `num_computed_tokens` may read."""
        if self.kind == "sliding_window":
            assert self.sliding_window is not None
            return max(0, num_computed_tokens - self.sliding_window + 1)
        if self.kind == "chunked_local":
            assert self.attention_chunk_size is not None
            return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size
        return 0

    # --------------------------------------------------------------------------------- batch forms

    def readable_lo(self, num_computed_tokens: np.ndarray) -> np.ndarray:
        """`readable_start` for a batch: [num_reqs] int64 -> [num_reqs] first readable position."""
        if self.kind == "sliding_window":
            return np.maximum(num_computed_tokens - self.sliding_window + 1, 0)
        if self.kind == "chunked_local":
            c = self.attention_chunk_size
            return num_computed_tokens // c * c
        return np.zeros_like(num_computed_tokens)

    def slots(self, block_ids: np.ndarray, positions: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Vectorized `slot` for cp = 1: `block_ids` [n] are the row entries at `positions // block_size`."""
        assert self.cp_size == 1
        bs = self.block_size
        out = np.multiply(block_ids, bs, out=out, dtype=np.int64, casting="unsafe")
        out += positions % bs
        return out


def group_layouts(header, cp_rank: int = 0) -> list[GroupLayout]:
    """Every KV cache group's layout on one rank."""
    return [GroupLayout.of(g, cp_rank=cp_rank) for g in header.kv_cache_groups]
