"""Who holds each full-attention block in validate's shadow model, checked in time linear in the sharers.

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
