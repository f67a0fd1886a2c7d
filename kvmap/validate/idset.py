"""A set of request ids whose memory stays near 8 bytes an id, for the sets validate keeps over a whole trace
(requests seen, finished, freed): a long trace's peak memory stays near a short one's.

Rules:
- Ids added lately are kept as they are, in a Python set of at most `RECENT`; when it fills, they are moved
  into one sorted `array("q")` of their 64-bit `hash`es, merged in one pass (no Python object per kept id).
- An id is in the set when it is among the recent ids or its hash is among the kept ones: two ids are taken
  for one only if their hashes collide (about n^2 / 2^64: 1 in 10^10 for a million ids), and then only the
  kind of a problem validate names could change, never whether it finds one.
- `add` of an id already in the set keeps one copy, so `len` counts distinct ids.
- Plain Python (`bisect`, `heapq`): validate imports no numpy.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from heapq import merge
from itertools import groupby

RECENT = 4096  # ids kept as strings before they move into the hashes


class IdSet:
    def __init__(self) -> None:
        self.recent: set[str] = set()
        self.hashes = array("q")  # sorted, distinct: hash(id) of every id moved out of `recent`

    def _find(self, h: int) -> int:
        """Index of hash h in `hashes`, or -1."""
        i = bisect_left(self.hashes, h)
        return i if i < len(self.hashes) and self.hashes[i] == h else -1

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.recent or (len(self.hashes) > 0 and self._find(hash(req_id)) >= 0)

    def add(self, req_id: str) -> None:
        if req_id in self:
            return
        self.recent.add(req_id)
        if len(self.recent) >= RECENT:
            moved = sorted(map(hash, self.recent))
            self.hashes = array("q", (h for h, _ in groupby(merge(self.hashes, moved))))
            self.recent.clear()

    def discard(self, req_id: str) -> None:
        if req_id in self.recent:
            self.recent.discard(req_id)
        elif self.hashes:
            i = self._find(hash(req_id))
            if i >= 0:
                del self.hashes[i]

    def clear(self) -> None:
        self.recent.clear()
        self.hashes = array("q")

    def __len__(self) -> int:
        return len(self.recent) + len(self.hashes)
