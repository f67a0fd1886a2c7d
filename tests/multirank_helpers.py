"""Build a DCP trace by hand from a single-rank one: with cp ranks a block id spans block_size * cp positions,
so each request's row keeps the first cdiv(n, cp) of its single-rank ids (traces without prefix sharing)."""

from __future__ import annotations

import json
from pathlib import Path


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_dcp_trace(src: Path, dst: Path, cp: int, interleave: int = 1, kernel_block_size: int | None = None,
                   tp: int | None = None) -> Path:
    lines = [json.loads(x) for x in src.read_text().splitlines()]
    h = lines[0]
    h["decode_context_parallel_size"] = cp
    h["cp_kv_cache_interleave_size"] = interleave
    if tp:
        h["tensor_parallel_size"] = tp
    if kernel_block_size:
        for g in h["kv_cache_groups"]:
            g["kernel_block_size"] = kernel_block_size
    full: dict[str, list[list[int]]] = {}  # req -> per group: every single-rank id so far
    sent: dict[str, list[int]] = {}  # req -> per group: ids sent in the DCP trace

    def take(req: str, g: int) -> list[int]:
        want = cdiv(len(full[req][g]), cp)
        new = full[req][g][sent[req][g] : want]
        sent[req][g] = max(sent[req][g], want)
        return new

    for line in lines[1:]:
        so = line["scheduler_output"]
        for nr in so["scheduled_new_reqs"]:
            r = nr["req_id"]
            full[r] = [list(b) for b in nr["block_ids"]]
            sent[r] = [0] * len(full[r])
            nr["block_ids"] = [take(r, g) for g in range(len(full[r]))]
        c = so["scheduled_cached_reqs"]
        resumed = set(c.get("resumed_req_ids") or [])
        for i, r in enumerate(c["req_ids"]):
            nb = c["new_block_ids"][i]
            if nb is None:
                continue
            if r in resumed:
                full[r] = [list(b) for b in nb]
                sent[r] = [0] * len(nb)
            else:
                for g, ids in enumerate(nb):
                    full[r][g].extend(ids)
            c["new_block_ids"][i] = [take(r, g) for g in range(len(nb))]
    dst.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return dst
