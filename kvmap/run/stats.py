"""Statistics of a `ReplayResult` over its measured steps: per-phase figures, which steps were measured (in
words), and the warnings a run carries.

Rules: every figure is over the measured steps (result.py's one definition); nothing here measures or draws.
Percentiles and medians are numpy's (linear interpolation), from one sort each. Outliers use the MAD-based
modified z-score (as hyperfine does) with threshold OUTLIER_Z; the noise warning fires when the median absolute
deviation of step time exceeds NOISE_MAD of the median.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmap.run.result import MAPPING_PHASES, ReplayResult

OUTLIER_Z = 14.0  # modified z-score threshold (hyperfine's)
NOISE_MAD = 0.25  # MAD / median above this -> noisy


@dataclass(frozen=True, slots=True)
class PhaseStats:
    name: str
    mean_us: float
    p50_us: float
    p90_us: float
    p99_us: float
    min_us: float
    max_us: float
    total_ms: float
    share: float  # of the step total


def percentiles(values: np.ndarray, qs) -> list[float]:
    """`np.percentile(values, qs)` (its default, linear interpolation, and its rounding), from one sort, without
    the numpy.ma import np.percentile makes on first use."""
    a = np.sort(values, kind="stable")
    n = len(a)
    out = []
    for q in qs:
        idx = q / 100 * (n - 1)
        lo = int(idx)
        hi = min(lo + 1, n - 1)
        t = idx - lo
        x, y = float(a[lo]), float(a[hi])
        out.append(y - (y - x) * (1 - t) if t >= 0.5 else x + (y - x) * t)  # numpy's _lerp
    return out


def median(values: np.ndarray) -> float:
    """`np.median` of a 1-D array (the mean of the middle two when even), without its numpy.ma import."""
    a = np.sort(values, kind="stable")
    n = len(a)
    return float(a[n // 2]) if n % 2 else (float(a[n // 2 - 1]) + float(a[n // 2])) / 2


def _stats(name: str, ns: np.ndarray, step_total_ns: float) -> PhaseStats:
    if not len(ns):
        return PhaseStats(name, *([0.0] * 8))
    us = ns / 1e3
    p50, p90, p99 = percentiles(us, (50, 90, 99))
    return PhaseStats(name, float(us.mean()), float(p50), float(p90), float(p99), float(us.min()),
                      float(us.max()), float(ns.sum() / 1e6), float(ns.sum() / step_total_ns) if step_total_ns else 0.0)


def phase_series(r: ReplayResult) -> list[tuple[str, np.ndarray]]:
    """(name, [measured steps] ns) per phase, then `mappings` (the four mapping phases) and `step` (all phases)."""
    m = r.measured()
    total = m.sum(axis=1) if len(m) else np.zeros(0, dtype=np.int64)
    rows = [(p, m[:, i]) for i, p in enumerate(r.phases)]
    mi = [r.phases.index(p) for p in MAPPING_PHASES if p in r.phases]
    rows.append(("mappings", m[:, mi].sum(axis=1) if len(m) else total))
    rows.append(("step", total))
    return rows


def phase_stats(r: ReplayResult) -> list[PhaseStats]:
    """Per phase, then `mappings` (the four mapping phases) and `step` (all phases)."""
    series = phase_series(r)
    all_ns = float(series[-1][1].sum())
    return [_stats(name, ns, all_ns) for name, ns in series]


def phase_percentiles(r: ReplayResult, qs) -> dict[str, list[float]]:
    """{name: [the q-th percentile of the measured steps, us, for q in qs]}, in phase_series's order."""
    return {name: (percentiles(ns / 1e3, qs) if len(ns) else [0.0] * len(qs)) for name, ns in phase_series(r)}


def window_text(r: ReplayResult) -> str:
    """`START:END` as asked (END empty when open)."""
    start, stop = r.step_window
    return f"{start}:{'' if stop is None else stop}"


def step_span(steps: np.ndarray) -> str:
    return f"{int(steps[0])}..{int(steps[-1])}" if len(steps) else "none"


def steps_text(r: ReplayResult) -> str:
    """Which steps were replayed, measured and warm-up, in words: the one definition, stated."""
    ms, ws = r.measured_steps(), r.warmup_steps()
    text = f"{r.steps_replayed} replayed; {len(ms)} measured ({step_span(ms)}"
    text += f", the window {window_text(r)})" if r.step_window[0] or r.step_window[1] is not None else ")"
    if r.prewarm_steps:
        return text + (f"; warm-up 0..{r.prewarm_steps - 1} replayed first by a throwaway worker, untimed (the "
                       "window starts at 0)")
    if not len(ws):
        return text + "; no warm-up"
    where = ("just before the window" if r.warmup_before_window() else
             "the window's first steps (a given worker cannot be warmed apart)")
    return text + f"; warm-up {step_span(ws)}: timed, not counted, {where}"


def warnings(r: ReplayResult) -> list[str]:
    out = []
    m = r.measured()
    start, stop = r.step_window
    if r.steps_in_trace is not None and stop is not None and r.steps_in_trace < stop:
        out.append(f"the window {window_text(r)} runs past the trace's end ({r.steps_in_trace} steps): measured "
                   f"{step_span(r.measured_steps())}")
    if len(m) < 10:
        out.append(f"only {len(m)} measured steps: statistics are rough; replay a longer trace or window")
    if len(m) >= 3:
        total = m.sum(axis=1).astype(np.float64)
        med = median(total)
        mad = median(np.abs(total - med))
        if med and mad / med > NOISE_MAD:
            out.append(f"noisy timings: the median absolute deviation is {mad / med:.0%} of the median step "
                       "time; close other work or compare medians of several runs")
        if mad:
            z = 0.6745 * (total - med) / mad
            outliers = np.flatnonzero(z > OUTLIER_Z)
            if len(outliers):
                worst = int(outliers[np.argmax(total[outliers])])
                step = int(r.measured_steps()[worst])
                out.append(f"{len(outliers)} outlier step(s), the worst step {step} at {total[worst] / 1e3:.0f} us "
                           f"vs a median of {med / 1e3:.0f} us (first-touch or a busy machine: raise --warmup "
                           "or replay again)")
    if r.standin_tokens:
        out.append(f"{r.standin_tokens} input ids are stand-ins: the trace does not record sampled_token_ids")
    return out
