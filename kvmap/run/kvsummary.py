"""A running summary of a per-step ratio (memory efficiency): mean, 5th percentile and minimum in bounded memory.

Rules: the mean and the minimum are exact (the mean sums the values one by one in their order, however they
were grouped into arrays); the 5th percentile is numpy's (linear between the two order statistics around 5% of
n - 1), each order statistic read from a histogram of BINS equal bins of 0..1 (values above 1 go to the last
bin) as its bin's lower edge, so it is exact to 1 / BINS (0.01%). NaN (nothing held) is skipped. A replay of
any length keeps 80 KB per summary, never a value per step.
"""

from __future__ import annotations

import math

import numpy as np

BINS = 10_000  # p5 to 1 / BINS


class Running:
    """Values added as arrays, in order (`add_many`); `summary()` once at the end."""

    __slots__ = ("n", "total", "low", "hist")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0
        self.low = math.inf
        self.hist = np.zeros(BINS + 1, dtype=np.int64)  # [BINS + 1] counts; bin b holds [b, b + 1) / BINS

    def add_many(self, v: np.ndarray) -> None:
        """The values of `v` after those added before, in order (NaN skipped)."""
        v = v[~np.isnan(v)]
        if not len(v):
            return
        self.n += len(v)
        self.total = float(np.add.accumulate(np.concatenate(([self.total], v)))[-1])  # one by one, in order
        self.low = min(self.low, float(v.min()))
        self.hist += np.bincount(np.clip((v * BINS).astype(np.int64), 0, BINS), minlength=BINS + 1)

    def summary(self) -> dict:
        """{mean, p5, min, steps} (None for each figure when no value was added)."""
        if not self.n:
            return {"mean": None, "p5": None, "min": None, "steps": 0}
        counts = np.cumsum(self.hist)

        def nth(k: int) -> float:  # the k-th smallest value (1-based), to 1 / BINS; the smallest is exact
            return self.low if k <= 1 else max(int(np.searchsorted(counts, k)) / BINS, self.low)

        at = 0.05 * (self.n - 1)  # numpy's default: linear between the order statistics around it
        lo = int(at)
        a, b = nth(lo + 1), nth(min(lo + 2, self.n))
        return {"mean": self.total / self.n, "p5": a + (b - a) * (at - lo), "min": self.low, "steps": self.n}
