"""Who holds each block in validate's shadow model: per full-attention group (`BlockOwners`) and across the
groups of the one block pool (`PoolHolders`), checked in time linear in the sharers.

Rules: a block id maps to its live holders (request -> logical block index), in the order they claimed it.
Prefix caching makes every consistent holder of a block agree on its position and tokens, so a new claim is
compared with the first few eligible holders only (`COMPARE`): many requests sharing one prefix block cost
O(1) per claim, not O(holders), and a conflicting holder is still found whenever an earlier holder disagrees.
"""

from __future__ import annotations

from collections.abc import Callable

COMPARE = 4  # eligible holders a claim is compared with


class BlockOwners:
    """Block id -> {req_id: logical index} for one full-attention group of `block_size` tokens."""

    __slots__ = ("bs", "null", "owners")

    def __init__(self, block_size: int, null: int) -> None:
        self.bs = block_size
        self.null = null
        self.owners: dict[int, dict[str, int]] = {}

    def release(self, req_id: str, ids: list[int]) -> None:
        owners = self.owners
        for b in ids:
            holders = owners.get(b)
            if holders is not None:
                holders.pop(req_id, None)
                if not holders:
                    del owners[b]

    def claim(self, req_id: str, tokens: list[int], row: list[int], start: int,
              peer: Callable[[str], list[int] | None]) -> list[tuple[int, int, str, str]]:
        """Register `row[start:]`; returns (logical index, block, other holder, what) for each conflict.
        `peer(other)` gives another holder's tokens, or None when it is not live and certain."""
        bs, owners, found = self.bs, self.owners, []
        for j in range(start, len(row)):
            b = row[j]
            if b == self.null:
                continue
            holders = owners.setdefault(b, {})
            k = holders.get(req_id)
            if k is not None and k != j:  # a block repeated in the request's own row
                found.append((j, b, req_id, f"logical blocks {k} and {j} of its own row"))
                continue
            compared = 0
            for other, oj in holders.items():
                if other == req_id:
                    continue
                theirs = peer(other)
                if theirs is None:
                    continue
                lo, hi = j * bs, (j + 1) * bs
                mine, theirs = tokens[lo:hi], theirs[oj * bs:(oj + 1) * bs]
                n = min(len(mine), len(theirs))
                if oj != j or mine[:n] != theirs[:n]:
                    what = (f"logical block {j} here, {oj} in {other!r}" if oj != j
                            else f"different tokens at positions {lo}..{hi - 1}")
                    found.append((j, b, other, what))
                    break
                compared += 1
                if compared >= COMPARE:
                    break
            holders[req_id] = j
        return found


class PoolHolders:
    """Block id -> {group: {req_id: logical index}} across every KV cache group that addresses KV by position.

    Rules (vLLM 0.33: one `BlockPool` serves every group, prefix-cache hashes carry their group id): a block id
    belongs to one group at a time, so a block claimed in group g while a live request holds it in another
    group is a conflict. A full-attention holder holds its blocks until it finishes or is preempted; a
    sliding-window or chunked-local holder only those its scheduler has not freed (inside the window or chunk:
    `held` decides, since the worker's row keeps stale ids the scheduler already gave back to the pool)."""

    __slots__ = ("null", "holders")

    def __init__(self, null: int) -> None:
        self.null = null
        self.holders: dict[int, dict[int, dict[str, int]]] = {}

    def release(self, g: int, req_id: str, ids: list[int]) -> None:
        holders = self.holders
        for b in ids:
            groups = holders.get(b)
            if groups is None or g not in groups:
                continue
            groups[g].pop(req_id, None)
            if not groups[g]:
                del groups[g]
                if not groups:
                    del holders[b]

    def claim(self, g: int, req_id: str, row: list[int], start: int,
              held: Callable[[int, str, int], bool]) -> list[tuple[int, int, int, str]]:
        """Register `row[start:]` in group g; returns (logical index, block, other group, holder) for each block
        another group holds. `held(og, other, oj)`: whether `other` still holds its logical block oj of group og."""
        found = []
        for j in range(start, len(row)):
            b = row[j]
            if b == self.null:
                continue
            groups = self.holders.setdefault(b, {})
            for og, reqs in groups.items():
                if og == g:
                    continue
                hit = next((other for n, (other, oj) in enumerate(reqs.items())
                            if n < COMPARE and held(og, other, oj)), None)
                if hit is not None:
                    found.append((j, b, og, hit))
                    break
            groups.setdefault(g, {})[req_id] = j
        return found


def context_start(grp, nc: int) -> int:
    """The first position a step starting at `nc` attends to: 0 for full attention, the window's or the chunk's
    start otherwise (vLLM frees a window's or chunk's blocks before it: `get_num_skipped_tokens`)."""
    if grp.kind == "sliding_window":
        return max(0, nc - grp.sliding_window + 1)
    if grp.kind == "chunked_local":
        return nc - nc % grp.attention_chunk_size
    return 0


def still_held(grp, span: int, reach: int | None, j: int) -> bool:
    """Whether a live holder certainly still holds logical block j of group `grp`: full attention holds every
    block; a window or chunk frees those before its context start, taken at `reach`, the latest
    `num_computed_tokens` the holder can reach this step (None: unknown, so never a false alarm)."""
    if grp.kind == "full_attention":
        return True
    return reach is not None and j >= context_start(grp, reach) // span
