"""A step's mappings as arrays in batch order, and the plain-list dump record every backend must match.

Rules: `BatchMappings` holds views (copy to keep); `to_dict` is the one serializer of the `--dump-mappings`
record (docs/trace-format.md), with its keys in one fixed order (`DUMP_KEYS`), so dumps of any two backends are
byte-identical when their content is equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import json

import numpy as np

DUMP_KEYS = ("step", "req_ids", "idx_mapping", "query_start_loc", "seq_lens", "positions", "input_ids",
             "block_tables", "kernel_block_tables", "slot_mapping", "dcp_ranks", "dcp_local_seq_lens")
# multi-rank keys (docs/trace-format.md, mapping dump): only present when cp > 1 or a kernel split exists, so dumps of
# every other trace are unchanged; `dcp_ranks` only when a replay computes some of the ranks (--rank R)


class BatchReqIds(Sequence):
    """Request ids in batch order, looked up through the batch order only when read (most steps never read
    them: the KV write needs only the arrays)."""

    __slots__ = ("_ids", "_order")

    def __init__(self, scheduler_ids: list[str], order: np.ndarray) -> None:
        self._ids, self._order = scheduler_ids, order  # order: [num_reqs] batch_idx -> scheduler entry

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, b):
        if isinstance(b, slice):
            return [self._ids[i] for i in self._order[b].tolist()]
        return self._ids[int(self._order[b])]

    def __iter__(self):
        ids = self._ids
        return (ids[i] for i in self._order.tolist())

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(slots=True)
class Inputs:
    """What `prepare_inputs` returns: this step's slices of the input buffers, in batch order (host arrays or
    device tensors). Valid until the next step."""

    idx_mapping: Any  # [num_reqs] batch_idx -> req_state_idx
    num_scheduled_tokens: Any  # [num_reqs] int32, batch_idx -> tokens this step (drafts included)
    num_computed_tokens: Any  # [num_reqs] int32, batch_idx -> position of its first token
    query_start_loc: Any  # [num_reqs + 1] int32, batch_idx -> first flat token index
    seq_lens: Any  # [num_reqs] int32, num_computed_tokens + num_scheduled_tokens
    positions: Any  # [num_tokens] int64, flat token -> position in its request
    input_ids: Any  # [num_tokens] int32, flat token -> token id


@dataclass(slots=True)
class BatchTables:
    """What `gather_block_tables` returns: each batch request's block-table rows (host arrays or device
    tensors)."""

    block_tables: list  # [num_groups] x [num_reqs, width_g] int32, batch_idx -> block ids
    num_blocks: Any  # [num_groups, num_reqs] int32, valid entries of each row


@dataclass(slots=True)
class RankSlots:
    """What the multi-rank `compute_slot_mappings` returns (cp > 1): every computed DCP rank's slots."""

    rank_slot_mapping: Any  # [num_ranks, num_groups, num_tokens] int64, PAD_SLOT_ID where another rank holds it
    dcp_local_seq_lens: Any  # [num_ranks, num_reqs] int32, each rank's local sequence lengths


def dump_line(record: dict) -> str:
    """One `--dump-mappings` line: compact JSON, keys in `DUMP_KEYS` order, then the forward keys (`--forward`,
    kvmap/forward/inputs.py) in the record's order, newline-terminated."""
    out = {k: record[k] for k in DUMP_KEYS if k in record}
    if len(out) != len(record):
        out.update((k, v) for k, v in record.items() if k not in out)
    return json.dumps(out, separators=(",", ":")) + "\n"


@dataclass(slots=True)
class BatchMappings:
    """One step's worker inputs, in batch order. Arrays are views into preallocated buffers: copy to keep."""

    req_ids: Sequence[str]  # [num_reqs] batch_idx -> req_id
    idx_mapping: np.ndarray  # [num_reqs] int32, batch_idx -> req_state_idx
    num_scheduled_tokens: np.ndarray  # [num_reqs] int32, batch_idx -> tokens this step (drafts included)
    num_computed_tokens: np.ndarray  # [num_reqs] int32, batch_idx -> position of its first token
    query_start_loc: np.ndarray  # [num_reqs + 1] int32, batch_idx -> first flat token index
    seq_lens: np.ndarray  # [num_reqs] int32, num_computed_tokens + num_scheduled_tokens
    positions: np.ndarray  # [num_tokens] int64, flat token -> position in its request
    input_ids: np.ndarray  # [num_tokens] int32, flat token -> token id
    block_tables: list[np.ndarray]  # [num_groups] x [num_reqs, width_g] int32, batch_idx -> block ids
    num_blocks: np.ndarray  # [num_groups, num_reqs] int32, valid entries of each block-table row
    slot_mapping: np.ndarray  # [num_groups, num_tokens] int64, flat token -> KV slot (PAD_SLOT_ID pads)
    # multi-rank (cp > 1): every computed DCP rank's slots; `slot_mapping` is then rank ranks[0]'s
    cp_size: int = 1
    ranks: tuple[int, ...] = (0,)  # DCP ranks computed, ascending
    rank_slot_mapping: np.ndarray | None = None  # [len(ranks), num_groups, num_tokens] int64
    dcp_local_seq_lens: np.ndarray | None = None  # [len(ranks), num_reqs] int32
    # kernel block split: [num_groups] x [num_reqs, width_g * k_g] int32 expanded rows (k_g = 1: the manager row)
    kernel_block_tables: list[np.ndarray] | None = None
    kernel_blocks_per_block: tuple[int, ...] | None = None  # [num_groups] k_g

    @property
    def num_reqs(self) -> int:
        return len(self.idx_mapping)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    def to_dict(self, step: int) -> dict:
        """The `--dump-mappings` record (docs/trace-format.md): plain lists, block rows without padding."""
        d = self._to_dict(step)
        if self.kernel_block_tables is not None:
            d["kernel_block_tables"] = [[t[b, : nb[b] * k].tolist() for b in range(len(nb))] for t, nb, k in
                                        zip(self.kernel_block_tables, self.num_blocks, self.kernel_blocks_per_block)]
        if self.cp_size > 1:
            d["slot_mapping"] = self.rank_slot_mapping.tolist()
            d["dcp_local_seq_lens"] = self.dcp_local_seq_lens.tolist()
            if len(self.ranks) != self.cp_size:
                d["dcp_ranks"] = list(self.ranks)
        return d

    def rank_slots(self, i: int) -> np.ndarray:
        """[num_groups, num_tokens] slots of the i-th computed rank."""
        return self.slot_mapping if self.rank_slot_mapping is None else self.rank_slot_mapping[i]

    def _to_dict(self, step: int) -> dict:
        return {
            "step": step,
            "req_ids": list(self.req_ids),
            "idx_mapping": self.idx_mapping.tolist(),
            "query_start_loc": self.query_start_loc.tolist(),
            "seq_lens": self.seq_lens.tolist(),
            "positions": self.positions.tolist(),
            "input_ids": self.input_ids.tolist(),
            "block_tables": [[t[b, : nb[b]].tolist() for b in range(len(nb))]
                             for t, nb in zip(self.block_tables, self.num_blocks)],
            "slot_mapping": self.slot_mapping.tolist(),
        }


def mappings_from_dict(d: dict, num_groups: int, cp_size: int = 1, kernel_blocks_per_block=None):
    """A plain-list mappings record -> `BatchMappings` (block rows right-padded with 0)."""
    m = _mappings_from_dict(d, num_groups, cp_size)
    if cp_size > 1:
        m.ranks = tuple(d.get("dcp_ranks", range(cp_size)))
        m.rank_slot_mapping = np.array(d["slot_mapping"], dtype=np.int64).reshape(len(m.ranks), num_groups,
                                                                                  m.num_tokens)
        m.slot_mapping = m.rank_slot_mapping[0]
        m.dcp_local_seq_lens = np.array(d["dcp_local_seq_lens"], dtype=np.int32).reshape(len(m.ranks), -1)
    if "kernel_block_tables" in d:
        m.kernel_blocks_per_block = tuple(kernel_blocks_per_block)
        m.kernel_block_tables = [_pad(rows, m.num_reqs) for rows in d["kernel_block_tables"]]
    return m


def _pad(rows: list[list[int]], B: int) -> np.ndarray:
    w = max((len(r) for r in rows), default=0)
    t = np.zeros((B, w), dtype=np.int32)
    for b, r in enumerate(rows):
        t[b, : len(r)] = r
    return t


def _mappings_from_dict(d: dict, num_groups: int, cp_size: int):
    B = len(d["req_ids"])
    tables, nbs = [], []
    for rows in d["block_tables"]:
        w = max((len(r) for r in rows), default=0)
        t = np.zeros((B, w), dtype=np.int32)
        for b, r in enumerate(rows):
            t[b, : len(r)] = r
        tables.append(t)
        nbs.append([len(r) for r in rows])
    qsl = np.array(d["query_start_loc"], dtype=np.int32)
    seq = np.array(d["seq_lens"], dtype=np.int32)
    n = np.diff(qsl).astype(np.int32)
    return BatchMappings(
        req_ids=d["req_ids"],
        idx_mapping=np.array(d["idx_mapping"], dtype=np.int32),
        num_scheduled_tokens=n,
        num_computed_tokens=seq - n,
        query_start_loc=qsl,
        seq_lens=seq,
        positions=np.array(d["positions"], dtype=np.int64),
        input_ids=np.array(d["input_ids"], dtype=np.int32),
        block_tables=tables,
        num_blocks=np.array(nbs, dtype=np.int32).reshape(num_groups, B),
        slot_mapping=(np.array(d["slot_mapping"], dtype=np.int64).reshape(num_groups, -1) if cp_size == 1
                      else np.zeros((num_groups, len(d["positions"])), dtype=np.int64)),
        cp_size=cp_size,
    )
