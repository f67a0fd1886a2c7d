"""A step's mappings as arrays in batch order, and the plain-list dump record every backend must match.

Rules: `BatchMappings` holds views (copy to keep); `to_dict` is the one serializer of the `--dump-mappings`
record (trace-format.md), with its keys in one fixed order (`DUMP_KEYS`), so dumps of any two backends are
byte-identical when their content is equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import json

import numpy as np

DUMP_KEYS = ("step", "req_ids", "idx_mapping", "query_start_loc", "seq_lens", "positions", "input_ids",
             "block_tables", "slot_mapping")


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


def dump_line(record: dict) -> str:
    """One `--dump-mappings` line: compact JSON, keys in `DUMP_KEYS` order, newline-terminated."""
    return json.dumps({k: record[k] for k in DUMP_KEYS if k in record}, separators=(",", ":")) + "\n"


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

    @property
    def num_reqs(self) -> int:
        return len(self.idx_mapping)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    def to_dict(self, step: int) -> dict:
        """The `--dump-mappings` record (trace-format.md): plain lists, block rows without padding."""
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


def mappings_from_dict(d: dict, num_groups: int):
    """A plain-list mappings record -> `BatchMappings` (block rows right-padded with 0)."""
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
        slot_mapping=np.array(d["slot_mapping"], dtype=np.int64).reshape(num_groups, -1),
    )
