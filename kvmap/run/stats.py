"""Statistics of a `ReplayResult` over its measured steps: per-phase figures, which steps were measured (in
words), and the warnings a run carries.

Rules: every figure is over the measured steps (result.py's one definition); nothing here measures or draws.
Percentiles and medians are numpy's (linear interpolation), from one sort each. A step is slow against a
per-step cost model, not against the median step: time = a + b * scheduled tokens + c * requests, fitted by least
squares on relative error over the measured steps (refitted FIT_PASSES times without the steps it flags); a
step is flagged where its time over the model's, in log, has a MAD-based modified z-score (hyperfine's) over
OUTLIER_Z. The work phases (all but read_step) and read_step (reading the trace: I/O, and for gzip the inflation
of a 64 KiB chunk, paid by the step whose line crosses it) are modelled and reported apart. The noise warning
fires when the median absolute deviation of step time exceeds NOISE_MAD of the median.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmap.run.result import MAPPING_PHASES, ReplayResult

OUTLIER_Z = 14.0  # modified z-score threshold (hyperfine's)
NOISE_MAD = 0.25  # MAD / median above this -> noisy
FIT_SAMPLE = 8192  # steps the cost model is fitted on, at most (evenly spaced)
FIT_PASSES = 3  # cost-model fits, each without the steps the one before flagged


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
    mappings = np.zeros(len(m), dtype=np.int64)  # [measured steps], summed column by column (no [n, 4] copy)
    for i in mi:
        mappings += m[:, i]
    rows.append(("mappings", mappings))
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
        out += _slow_step_warnings(r, m)
    if r.standin_tokens:
        out.append(f"{r.standin_tokens} input ids are stand-ins: the trace does not record sampled_token_ids")
    return out


@dataclass(frozen=True, slots=True)
class SlowSteps:
    """Steps slower than the cost model explains: their indices into the measured steps, measured and modelled ns."""
    index: np.ndarray  # [k] into the measured steps
    ns: np.ndarray  # [k] measured
    model_ns: np.ndarray  # [k] the cost model's

    def worst(self) -> tuple[int, int]:
        """(its index among the slow steps, its index into the measured steps) of the step furthest over the model."""
        w = int(np.argmax(self.ns - self.model_ns))
        return w, int(self.index[w])


def slow_steps(ns: np.ndarray, num_tokens: np.ndarray, num_reqs: np.ndarray) -> SlowSteps:
    """The steps whose time `ns` [n] the cost model a + b * num_tokens + c * num_reqs does not explain (the module's
    rule); none where the times' spread is nil. The model is fitted on at most `FIT_SAMPLE` evenly spaced steps
    (every step below that), so memory stays flat on long traces; every step is judged."""
    y = np.maximum(ns.astype(np.float64), 1.0)
    t, q = num_tokens.astype(np.float64), num_reqs.astype(np.float64)
    fit = np.arange(0, len(y), max(1, -(-len(y) // FIT_SAMPLE)))  # [<= FIT_SAMPLE] the steps the model is fitted on
    keep = np.ones(len(fit), dtype=bool)
    flagged = np.zeros(len(y), dtype=bool)
    model = y
    for _ in range(FIT_PASSES):
        f = fit[keep]
        x = np.column_stack([np.ones(len(f)), t[f], q[f]]) / y[f, None]
        coef = np.linalg.lstsq(x, np.ones(len(f)), rcond=None)[0]
        model = np.maximum(coef[0] + coef[1] * t + coef[2] * q, 1.0)
        excess = np.log(y / model)
        med = median(excess[f])
        mad = median(np.abs(excess[f] - med))
        if not mad:
            break
        z = 0.6745 * (excess - med) / mad
        flagged = z > OUTLIER_Z
        keep = np.abs(z[fit]) <= OUTLIER_Z
    index = np.flatnonzero(flagged)
    return SlowSteps(index, ns[index], model[index])


def _slow_step_warnings(r: ReplayResult, m: np.ndarray) -> list[str]:
    """The slow work steps, then the slow reads, each with its worst step (the largest time over the model)."""
    out = []
    nr, nt = r.measured_counts()
    steps = r.measured_steps()
    read = r.phases.index("read_step") if "read_step" in r.phases else None
    work = m.sum(axis=1) - (m[:, read] if read is not None else 0)
    slow = slow_steps(work, nt, nr)
    if len(slow.index):
        w, i = slow.worst()
        out.append(f"{len(slow.index)} step(s) slower than their scheduled tokens and requests explain (a per-step "
                   f"cost model, read_step apart): the worst step {int(steps[i])} at {slow.ns[w] / 1e3:.0f} us vs "
                   f"{slow.model_ns[w] / 1e3:.0f} us for its {int(nt[i])} tokens and {int(nr[i])} requests (a busy "
                   "machine or first-touch: replay again; `kvmap explain --step` shows the step)")
    if read is not None:
        slow = slow_steps(m[:, read], nt, nr)
        if len(slow.index):
            w, i = slow.worst()
            out.append(f"{len(slow.index)} step(s) slower in read_step than their size explains: I/O, not the "
                       f"mappings (the worst step {int(steps[i])} at {slow.ns[w] / 1e3:.0f} us reading vs "
                       f"{slow.model_ns[w] / 1e3:.0f} us; a gzip trace inflates 64 KiB chunks, each paid by the step "
                       "that crosses it)")
    return out
