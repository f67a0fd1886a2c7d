"""Repeated runs (`kvmap replay --runs N`): each run's per-phase medians, their mean +- sigma, and the ratio of
two runs' means with its uncertainty (`kvmap compare`), as hyperfine computes them.

Rules: a run's figure per phase is the median of its measured steps (stats.py `phase_series`, `median`), so one
slow step moves it little; over the runs, the mean and the sample standard deviation (n - 1; 0 for one run).
The ratio B / A of two means carries sigma = ratio * sqrt((sigma_A / mean_A)^2 + (sigma_B / mean_B)^2)
(hyperfine's relative speed). A result with no repeated runs counts as one run: its own medians, sigma 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmap.run.result import ReplayResult
from kvmap.run.stats import median, phase_series

__all__ = ["MeanSigma", "mean_sigma", "ratio", "run_medians", "runs_stats"]


@dataclass(frozen=True, slots=True)
class MeanSigma:
    mean: float
    sigma: float  # sample standard deviation; 0 for one value
    min: float
    max: float
    n: int


def mean_sigma(xs: list[float]) -> MeanSigma:
    n = len(xs)
    mean = sum(xs) / n
    sigma = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return MeanSigma(mean, sigma, min(xs), max(xs), n)


def run_medians(r: ReplayResult) -> dict[str, float]:
    """{phase, mappings, step: the median of the measured steps, us} of one run."""
    return {name: (median(ns) / 1e3 if len(ns) else 0.0) for name, ns in phase_series(r)}


def runs_stats(r: ReplayResult) -> dict[str, MeanSigma]:
    """{name: mean +- sigma of the runs' medians}; the result's own medians (n = 1) without repeated runs."""
    runs = r.runs_p50_us or [run_medians(r)]
    return {name: mean_sigma([run[name] for run in runs]) for name in runs[0] if all(name in x for x in runs)}


def ratio(a: MeanSigma, b: MeanSigma) -> tuple[float, float] | None:
    """(B / A, its sigma), or None when A's mean is 0."""
    if not a.mean:
        return None
    q = b.mean / a.mean
    rel = math.hypot(a.sigma / a.mean, b.sigma / b.mean if b.mean else 0.0)
    return q, q * rel
