"""The one owner of the address arithmetic: where a token's KV lives, and which positions a step may read.

Rules:
- `GroupLayout.slot` is the spec, one token at a time in plain integers. The rule has one form per array
  language, each covering cp = 1, DCP and the KV read-back and each tested against the spec
  (tests/test_layout.py): numpy `GroupLayout.slots` (here), numba `kv/kernels.py slot_of`, torch
  `workers/torch_worker.py slots`, Triton `workers/triton_worker.py _slots`. The reference worker calls the
  spec directly. Nothing else in kvmap writes `block * block_size + offset` on its own, and every block span
  (`block_size * cp`) is read from `virtual_block_size`.
- Block sizes (docs/trace-format.md, "Which block size is which"): `block_size` is the tokens one rank stores per
  block id (vLLM's `KVCacheSpec.block_size`); with decode context parallelism a block id spans
  `block_size * cp_size` global positions (`virtual_block_size`); `kernel_block_size` divides `block_size`
  and is what the attention kernel sees.
- `readable_start` is the one window rule (vLLM's skipped-token rule): the first position a step starting at
  `num_computed_tokens` may read; `readable_lo` is the same rule for a batch.
- `null_history_blocks` is Model Runner V2's sliding-window rule for the *gathered* (forward-pass) block table
  (vllm/v1/worker/gpu/block_table.py `_gather_block_tables_kernel`): a sliding-window group's entries
  `[0, max(num_computed_tokens - R, 0) // block_size)` are the null block 0, `R = num_retained_tokens =
  sliding_window - 1 + extra_retained_tokens`; 0 (nothing nulled) for other kinds. `block_size` is the manager
  block size (vLLM nulls manager ids; a kernel split expands the nulled row). Off under decode context
  parallelism and under V1: `null_history_groups` gives the groups it applies to. The entries it nulls hold
  positions below `num_computed_tokens - R <= readable_start`, so no read goes through them. Its forms: numpy
  `null_history_lens` (here), numba `kernels_cpu.null_history`, torch `torch_worker.null_history`, Triton
  `triton_worker._null_history_kernel`; the reference calls the spec.
- Padding and tokens another rank holds are `PAD_SLOT_ID` (-1), never slot 0; so is every token of a group
  without a slot mapping (`uses_slot_mapping` false: Mamba state groups, whose rows hold state indices).
- The scalar spec needs no numpy (validate's multi-rank rules use it); the batch forms import it on first use.
- Kernel blocks: manager id `b` is kernel ids `b*k .. b*k+k-1` (`k = block_size // kernel_block_size`);
  `kernel_slot` over the expanded row gives the same value as `slot` (tests/test_layout.py). The virtual block
  is always taken from `block_size * cp_size`, never from the kernel block size (vllm#51031).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

PAD_SLOT_ID = -1  # slot_mapping entry for padding and for tokens that are not local to this rank


_np = None  # numpy, once a batch form has run


def _numpy():
    global _np
    import numpy

    _np = numpy
    return numpy


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
    uses_slot_mapping: bool = True  # False: a state group (slots all PAD_SLOT_ID, rows hold state indices)
    extra_retained_tokens: int = 0  # tokens kept below the window (vLLM's SlidingWindowSpec.extra_retained_tokens)
    # derived: log2 of the block span when a power of two, of the block size when that and cp = 1 (else -1)
    _span_shift: int = field(init=False, repr=False, compare=False)
    _slot_shift: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        vbs, bs = self.virtual_block_size, self.block_size
        object.__setattr__(self, "_span_shift", vbs.bit_length() - 1 if vbs & (vbs - 1) == 0 else -1)
        object.__setattr__(self, "_slot_shift", bs.bit_length() - 1 if bs & (bs - 1) == 0 and self.cp_size == 1
                           and self.has_slots else -1)

    @classmethod
    def of(cls, group, cp_size: int = 1, cp_rank: int = 0, interleave: int = 1) -> GroupLayout:
        """The layout of a trace header's `KVCacheGroup` on DCP rank `cp_rank` (a replicated group,
        `dcp_sharded` false, sees cp = 1 on every rank)."""
        sharded = getattr(group, "dcp_sharded", True)
        return cls(group.block_size, group.kind, group.sliding_window, group.attention_chunk_size,
                   kernel_block_size=getattr(group, "kernel_block_size", None),
                   cp_size=cp_size if sharded else 1, cp_rank=cp_rank if sharded else 0,
                   interleave=interleave if sharded else 1,
                   uses_slot_mapping=getattr(group, "uses_slot_mapping", group.kind != "mamba"),
                   extra_retained_tokens=getattr(group, "extra_retained_tokens", 0))

    @property
    def kernel_size(self) -> int:
        """Block size the attention kernel sees (K)."""
        return self.kernel_block_size or self.block_size

    @property
    def kernel_blocks_per_block(self) -> int:
        """k = block_size // kernel_block_size: kernel block ids per manager block id."""
        return self.block_size // self.kernel_size

    @property
    def has_slots(self) -> bool:
        return self.uses_slot_mapping and self.kind != "mamba"

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
        if not self.has_slots or not self.is_local(position):
            return PAD_SLOT_ID
        vb, _ = self.block_of(position)
        return block_row[vb] * self.block_size + self.local_offset(position)

    def local_position(self, position: int) -> int:
        """Position in this rank's own store of the request: vb * block_size + local_offset (a local token)."""
        return position // self.virtual_block_size * self.block_size + self.local_offset(position)

    def kernel_row(self, block_row: Sequence[int]) -> list[int]:
        """The expanded row handed to attention: manager id b -> kernel ids b*k .. b*k+k-1."""
        k = self.kernel_blocks_per_block
        return [b * k + j for b in block_row for j in range(k)]

    def kernel_slot(self, kernel_row: Sequence[int], position: int) -> int:
        """The slot through the kernel row: `krow[lp // K] * K + lp % K`, lp the local position (equals
        `slot`)."""
        if not self.has_slots or not self.is_local(position):
            return PAD_SLOT_ID
        K = self.kernel_size
        kb, ko = divmod(self.local_position(position), K)
        return kernel_row[kb] * K + ko

    def dcp_local_seq_len(self, seq_len: int) -> int:
        """Tokens of a `seq_len`-token request this rank holds (`dcp_local_seq_len`)."""
        return dcp_local_seq_len(seq_len, self.cp_size, self.cp_rank, self.interleave)

    def readable_start(self, num_computed_tokens: int) -> int:
        """First position a step starting at `num_computed_tokens` may read."""
        if self.kind == "sliding_window":
            assert self.sliding_window is not None
            return max(0, num_computed_tokens - self.sliding_window + 1)
        if self.kind == "chunked_local":
            assert self.attention_chunk_size is not None
            return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size
        return 0

    @property
    def num_retained_tokens(self) -> int:
        """R: tokens below a request's first scheduled position the forward-pass table keeps (vLLM's
        `SlidingWindowSpec.num_retained_tokens`, sliding_window - 1 + extra_retained_tokens); 0 for other kinds."""
        if self.kind != "sliding_window":
            return 0
        assert self.sliding_window is not None
        return self.sliding_window - 1 + self.extra_retained_tokens

    def null_history_blocks(self, num_computed_tokens: int) -> int:
        """Model Runner V2: how many leading entries of the gathered row are the null block 0,
        `max(num_computed_tokens - R, 0) // block_size` (0 when R is 0)."""
        R = self.num_retained_tokens
        return max(num_computed_tokens - R, 0) // self.block_size if R > 0 else 0

    # --------------------------------------------------------------------------------- batch forms

    def null_history_lens(self, num_computed_tokens: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Vectorized `null_history_blocks`: [n] num_computed_tokens -> out [n] int64 leading null entries."""
        np = _np or _numpy()
        R = self.num_retained_tokens
        if R <= 0:
            out[:] = 0
            return out
        np.subtract(num_computed_tokens, R, out=out)
        np.maximum(out, 0, out=out)
        out //= self.block_size
        return out

    def readable_lo(self, num_computed_tokens: np.ndarray) -> np.ndarray:
        """`readable_start` for a batch: [num_reqs] int64 -> [num_reqs] first readable position."""
        np = _np or _numpy()
        if self.kind == "sliding_window":
            return np.maximum(num_computed_tokens - self.sliding_window + 1, 0)
        if self.kind == "chunked_local":
            c = self.attention_chunk_size
            return num_computed_tokens // c * c
        return np.zeros_like(num_computed_tokens)

    def block_indices(self, positions: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Vectorized `block_of(p)[0]`: [n] positions -> [n] indices into the row, `pos // virtual_block_size`
        (a shift for a power-of-two span)."""
        np = _np or _numpy()
        if self._span_shift >= 0:
            return np.right_shift(positions, self._span_shift, out=out)
        return np.floor_divide(positions, self.virtual_block_size, out=out)

    def slots(self, block_ids: np.ndarray, positions: np.ndarray, out: np.ndarray | None = None,
              tmp: np.ndarray | None = None) -> np.ndarray:
        """Vectorized `slot`: `block_ids` [n] are the row entries at `positions // virtual_block_size`; `out`
        [n] int64, `tmp` [n] int64 scratch (cp = 1: no temporaries when both are given). cp = 1 with a
        power-of-two block size: `block_id << log2(bs) | pos & (bs - 1)`."""
        np = _np or _numpy()
        bs = self.block_size
        if self._slot_shift >= 0 and out is not None and tmp is not None:  # cp = 1, a power of two: shifts, masks
            np.bitwise_and(positions, bs - 1, out=tmp)
            np.left_shift(block_ids, self._slot_shift, out=out)
            out |= tmp
            return out
        if not self.has_slots:
            if out is None:
                return np.full(len(positions), PAD_SLOT_ID, dtype=np.int64)
            out[:] = PAD_SLOT_ID
            return out
        if self.cp_size == 1 and out is not None and tmp is not None:
            np.remainder(positions, bs, out=tmp)
            np.multiply(block_ids, bs, out=out)
            out += tmp
            return out
        out = np.multiply(block_ids, bs, out=out, dtype=np.int64, casting="unsafe")
        if self.cp_size == 1:
            out += positions % bs
            return out
        out += self.local_offsets(positions)
        out[~self.local_mask(positions)] = PAD_SLOT_ID
        return out

    def local_mask(self, positions: np.ndarray) -> np.ndarray:
        """Vectorized `is_local`: [n] positions -> [n] bool."""
        np = _np or _numpy()
        if self.cp_size == 1:
            return np.ones(len(positions), dtype=bool)
        return positions % self.virtual_block_size // self.interleave % self.cp_size == self.cp_rank

    def local_offsets(self, positions: np.ndarray) -> np.ndarray:
        """Vectorized `local_offset`: [n] positions -> [n] rows inside the physical block."""
        off = positions % self.virtual_block_size
        I = self.interleave
        return off // (I * self.cp_size) * I + off % I

    def dcp_local_seq_lens(self, seq_lens: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Vectorized `dcp_local_seq_len`: [n] seq_lens -> [n] int32 local lengths on this rank."""
        return dcp_local_seq_lens(seq_lens, self.cp_size, self.cp_rank, self.interleave, out)

    def kernel_rows(self, table: np.ndarray) -> np.ndarray:
        """Vectorized `kernel_row`: [n, W] manager ids -> [n, W * k] int32 kernel ids."""
        np = _np or _numpy()
        k = self.kernel_blocks_per_block
        return (table[:, :, None].astype(np.int32) * k + np.arange(k, dtype=np.int32)).reshape(
            len(table), table.shape[1] * k)


def dcp_local_seq_len(seq_len: int, cp_size: int, cp_rank: int, interleave: int) -> int:
    """The spec: tokens of a `seq_len`-token request DCP rank `cp_rank` holds (vLLM's `get_dcp_local_seq_lens`):
    (seq_len // (cp * I)) * I + clamp(seq_len % (cp * I) - rank * I, 0, I)."""
    I, cp = interleave, cp_size
    return seq_len // (cp * I) * I + min(max(seq_len % (cp * I) - cp_rank * I, 0), I)


def dcp_local_seq_lens(seq_lens: np.ndarray, cp_size: int, cp_rank: int, interleave: int,
                       out: np.ndarray | None = None) -> np.ndarray:
    """Vectorized `dcp_local_seq_len`: [n] seq_lens -> [n] int32 local lengths on rank `cp_rank`."""
    np = _np or _numpy()
    I, cp = interleave, cp_size
    s = seq_lens.astype(np.int64)
    v = s // (cp * I) * I + np.clip(s % (cp * I) - cp_rank * I, 0, I)
    if out is None:
        return v.astype(np.int32)
    out[:] = v
    return out


def group_layouts(header, cp_rank: int = 0) -> list[GroupLayout]:
    """Every KV cache group's layout on one DCP rank."""
    cp = getattr(header, "decode_context_parallel_size", 1)
    interleave = getattr(header, "cp_kv_cache_interleave_size", 1)
    return [GroupLayout.of(g, cp, cp_rank, interleave) for g in header.kv_cache_groups]


def null_history_groups(header) -> tuple[int, ...]:
    """The groups whose gathered rows Model Runner V2 nulls below the window (vLLM's
    `BlockTables.sliding_window_reach` > 0): every sliding-window group with R > 0, none under decode context
    parallelism (a block-table column is then no contiguous token range)."""
    if getattr(header, "decode_context_parallel_size", 1) > 1:
        return ()
    return tuple(g for g, lay in enumerate(group_layouts(header)) if lay.num_retained_tokens > 0)


def rank_layouts(header, ranks: Sequence[int]) -> list[list[GroupLayout]]:
    """[len(ranks)][num_groups] layouts: every group on each of the given DCP ranks."""
    return [group_layouts(header, r) for r in ranks]


def seq_layouts(header, ranks: Sequence[int]) -> list[GroupLayout]:
    """[len(ranks)] the sharded layout each DCP rank's `dcp_local_seq_lens` follows (header block size)."""
    return [GroupLayout(header.block_size, cp_size=header.decode_context_parallel_size, cp_rank=r,
                        interleave=header.cp_kv_cache_interleave_size) for r in ranks]
