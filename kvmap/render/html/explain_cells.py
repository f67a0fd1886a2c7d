"""Which token each slot of a block holds, for the explain page's block grids (explain_svg.py).

Rules: from `kvmap explain --json`'s data only: the batch's block-table rows, seq_lens and query_start_loc
(`mappings`) and the group's layout on the rank (`layout`). A scheduled request holds positions 0 .. seq_len - 1;
those from num_computed_tokens on are this step's flat tokens, the rest were written by earlier steps. A position
lands in the block its row names and at the offset kvmap.layout's `GroupLayout` gives (the owner of that rule);
with DCP only the positions the rank stores. The null block holds nothing drawn, nor do a sliding-window or
chunked-local group's blocks wholly before the window the step starts from (`GroupLayout.readable_start`: vLLM's
scheduler has freed them; the worker's row keeps their stale ids). Blocks written this step come first, then the
highlighted request's, then the rest, at most MAX_BLOCKS.
"""

from __future__ import annotations

import numpy as np

from kvmap.layout import GroupLayout

MAX_BLOCKS = 48  # blocks drawn per grid
Cell = tuple[int, int, "int | None"]  # (batch_idx, position, flat token index or None: written earlier)


def layout_of(d: dict, g: int, rank: int) -> GroupLayout:
    grp, lay = d["groups"][g], d["layout"]
    cp = lay["group_cp"][g]
    return GroupLayout(grp["block_size"], kind=grp["kind"], sliding_window=grp.get("sliding_window"),
                       attention_chunk_size=grp.get("attention_chunk_size"), cp_size=cp,
                       cp_rank=rank if cp > 1 else 0, interleave=lay["interleave"] if cp > 1 else 1,
                       uses_slot_mapping=lay["has_slots"][g])


def grid_cells(d: dict, g: int, rank: int, max_blocks: int = MAX_BLOCKS) -> tuple[list[tuple[int, list]], int]:
    """([(block id, [block_size] cells: None or (batch_idx, position, flat token or None))], blocks left out)."""
    m, lay = d["mappings"], layout_of(d, g, rank)
    if not lay.has_slots:
        return [], 0
    null = d["layout"].get("null_block_id")
    qsl, seq_lens = m["query_start_loc"], m["seq_lens"]
    focus = d["request"]["req_id"] if d.get("request") else None
    blocks: dict[int, list] = {}
    written: list[int] = []  # blocks written this step, in flat-token order
    mine: list[int] = []  # the highlighted request's blocks
    for b, row in enumerate(m["block_tables"][g]):
        seq = seq_lens[b]
        first_new = seq - (qsl[b + 1] - qsl[b])  # num_computed_tokens
        first_block = lay.readable_start(first_new) // lay.virtual_block_size  # earlier ones: freed by vLLM
        pos = np.arange(seq, dtype=np.int64)
        pos = pos[lay.local_mask(pos)]
        offs = lay.local_offsets(pos)
        logical = lay.block_indices(pos)
        for p, off, j in zip(pos.tolist(), offs.tolist(), logical.tolist()):
            if j >= len(row) or j < first_block or row[j] == null:
                continue
            blk = row[j]
            cells = blocks.setdefault(blk, [None] * lay.block_size)
            new = p >= first_new
            flat = qsl[b] + p - first_new if new else None
            if cells[off] is None or new:
                cells[off] = (b, p, flat)
            if new and (not written or written[-1] != blk):
                written.append(blk)
            if m["req_ids"][b] == focus and (not mine or mine[-1] != blk):
                mine.append(blk)
    order = list(dict.fromkeys(written + mine + list(blocks)))
    return [(blk, blocks[blk]) for blk in order[:max_blocks]], max(0, len(order) - max_blocks)
