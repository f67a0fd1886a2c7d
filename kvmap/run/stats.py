"""Statistics of a `ReplayResult` over its measured steps: per-phase figures, which steps were measured (in
words), and the warnings a run carries.

Rules: every figure is over the measured steps (result.py's one definition); nothing here measures or draws.
Percentiles and medians are numpy's (linear interpolation), from one sort each (of the integer ns: the us
follow in the same order), means numpy's to the bit (`mean_us`). Memory stays near the result's own arrays:
the derived series are made one at a time, int32 where they fit, and the cost model judges long runs in parts.
A step is slow against a per-step cost model, not against the median step: time = a + b * scheduled tokens + c *
requests, fitted by least squares on relative error over the measured steps (refitted FIT_PASSES times without the
steps it flags); a step is flagged where its time over the model's, in log, has a MAD-based modified z-score
(hyperfine's) over OUTLIER_Z. The work phases (all but read_step) and read_step (reading the trace: I/O, and for
gzip the inflation of a 64 KiB chunk, paid by the step whose line crosses it) are modelled and reported apart. The
noise warning fires when the median absolute deviation of step time exceeds NOISE_MAD of the median.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvmap.ondisk import release
from kvmap.run.result import MAPPING_PHASES, ReplayResult

OUTLIER_Z = 14.0  # modified z-score threshold (hyperfine's)
NOISE_MAD = 0.25  # MAD / median above this -> noisy
FIT_SAMPLE = 8192  # steps the cost model is fitted on, at most (evenly spaced)
FIT_PASSES = 3  # cost-model fits, each without the steps the one before flagged
JUDGE_CHUNK = 1 << 14  # steps judged against the fitted model at a time
PAIRWISE_PART = 1 << 14  # steps summed by numpy at once in `mean_us`


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
    return _sorted_percentiles(np.sort(values, kind="stable"), qs)


def _sorted_percentiles(a: np.ndarray, qs, per: float | None = None) -> list[float]:
    """`percentiles` of values already sorted; `per`: of the values divided by it (ns sorted, us wanted: the
    division keeps the order, so the same floats as sorting the divided values)."""
    n = len(a)
    out = []
    for q in qs:
        idx = q / 100 * (n - 1)
        lo = int(idx)
        hi = min(lo + 1, n - 1)
        t = idx - lo
        x, y = float(a[lo]), float(a[hi])
        if per is not None:
            x, y = x / per, y / per
        out.append(y - (y - x) * (1 - t) if t >= 0.5 else x + (y - x) * t)  # numpy's _lerp
    return out


def median(values: np.ndarray) -> float:
    """`np.median` of a 1-D array (the mean of the middle two when even), without its numpy.ma import."""
    return _sorted_median(np.sort(values, kind="stable"))


def _sorted_median(a: np.ndarray) -> float:
    n = len(a)
    return float(a[n // 2]) if n % 2 else (float(a[n // 2 - 1]) + float(a[n // 2])) / 2


def mean_us(ns: np.ndarray) -> np.float64:
    """`(ns / 1e3).mean()` to the bit, without the [n] float64 copy: numpy sums float64 pairwise (halves rounded
    down to a multiple of 8, to blocks of 128), so each half is summed here the same way, and a part of at most
    PAIRWISE_PART steps by numpy itself."""
    return _pairwise_us(ns, 0, len(ns)) / len(ns)


def _pairwise_us(ns: np.ndarray, lo: int, n: int) -> np.float64:
    if n <= PAIRWISE_PART:
        return np.add.reduce(ns[lo : lo + n] / 1e3)
    half = n // 2
    half -= half % 8
    return _pairwise_us(ns, lo, half) + _pairwise_us(ns, lo + half, n - half)


def _stats(name: str, ns: np.ndarray, step_total_ns: float) -> PhaseStats:
    if not len(ns):
        return PhaseStats(name, *([0.0] * 8))
    a = np.sort(ns, kind="stable")  # [measured steps] ns: us are ns / 1e3, in the same order
    p50, p90, p99 = _sorted_percentiles(a, (50, 90, 99), 1e3)
    return PhaseStats(name, float(mean_us(ns)), float(p50), float(p90), float(p99), float(a[0]) / 1e3,
                      float(a[-1]) / 1e3, float(ns.sum() / 1e6), float(ns.sum() / step_total_ns) if step_total_ns
                      else 0.0)


def row_sums(m: np.ndarray, cols=None) -> np.ndarray:
    """[rows] the sum of `m`'s columns `cols` (all: None), column by column (no [n, k] copy; an array on disk is
    let go after each: ondisk.py), int32 where no sum can pass it (else int64)."""
    cols = range(m.shape[1]) if cols is None else cols
    wide = m.dtype != np.int32 or (len(m) and _top(m) * len(cols) > np.iinfo(np.int32).max)
    out = np.zeros(len(m), dtype=np.int64 if wide else np.int32)
    for i in cols:
        out += m[:, i]
        release(m)
    return out


def _top(m: np.ndarray) -> int:
    """The largest value of non-empty `m` [rows, columns], column by column."""
    top = int(m[:, 0].max())
    for i in range(1, m.shape[1]):
        top = max(top, int(m[:, i].max()))
        release(m)
    return top


def total_ns(m: np.ndarray) -> int:
    """The sum of every value of `m` [rows, columns], exact, column by column."""
    total = 0
    for i in range(m.shape[1]):
        total += int(m[:, i].sum(dtype=np.int64))
        release(m)
    return total


def phase_series(r: ReplayResult) -> Iterator[tuple[str, np.ndarray]]:
    """(name, [measured steps] ns) per phase, then `mappings` (the four mapping phases) and `step` (all phases),
    one at a time: a long run never holds two derived series at once (nor, on disk, its phase times: ondisk.py)."""
    m = r.measured()
    for i, p in enumerate(r.phases):
        yield p, m[:, i]
        release(m)
    yield "mappings", row_sums(m, [r.phases.index(p) for p in MAPPING_PHASES if p in r.phases])
    yield "step", row_sums(m)


def phase_stats(r: ReplayResult) -> list[PhaseStats]:
    """Per phase, then `mappings` (the four mapping phases) and `step` (all phases)."""
    all_ns = float(total_ns(r.measured()))  # the step series' sum: exact integers
    out = []
    for name, ns in phase_series(r):
        out.append(_stats(name, ns, all_ns))
        del ns  # before the next series is made
    return out


def phase_percentiles(r: ReplayResult, qs) -> dict[str, list[float]]:
    """{name: [the q-th percentile of the measured steps, us, for q in qs]}, in phase_series's order."""
    out = {}
    for name, ns in phase_series(r):
        out[name] = _sorted_percentiles(np.sort(ns, kind="stable"), qs, 1e3) if len(ns) else [0.0] * len(qs)
        del ns  # before the next series is made
    return out


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
        med, mad = _median_and_mad(m)
        if med and mad / med > NOISE_MAD:
            out.append(f"noisy timings: the median absolute deviation is {mad / med:.0%} of the median step "
                       "time; close other work or compare medians of several runs")
        out += _slow_step_warnings(r, m)
    if r.standin_tokens:
        out.append(f"{r.standin_tokens} input ids are stand-ins: the trace does not record sampled_token_ids")
    return out


def _median_and_mad(m: np.ndarray) -> tuple[float, float]:
    """The median step time of `m` [steps, phases] and the median absolute deviation from it, ns."""
    dev = row_sums(m)  # [steps] ns, then in place |2 * ns - 2 * median|: integers, no float copy
    med = median(dev)
    if dev.dtype == np.int32 and 2 * int(np.abs(dev).max()) > np.iinfo(np.int32).max:
        dev = dev.astype(np.int64)
    dev *= 2
    dev -= int(2 * med)  # a median is a whole or half ns: twice it is whole
    np.abs(dev, out=dev)
    dev.sort(kind="stable")
    return med, _sorted_median(dev) / 2  # exact: twice the deviations are integers far below 2^53


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
    (every step below that), and every step is judged `JUDGE_CHUNK` steps at a time, so memory stays flat on long
    traces. A pass whose spread is nil stops the fitting: the pass before it judges, and the model returned with
    each slow step is the last fitted."""
    fit = np.arange(0, len(ns), max(1, -(-len(ns) // FIT_SAMPLE)))  # [<= FIT_SAMPLE] the steps the model is fitted on
    y, t, q = _model_inputs(ns[fit], num_tokens[fit], num_reqs[fit])
    keep = np.ones(len(fit), dtype=bool)
    judge = None  # (coef, median, MAD) of the last pass with a spread
    for _ in range(FIT_PASSES):
        x = np.column_stack([np.ones(int(keep.sum())), t[keep], q[keep]]) / y[keep, None]
        coef = np.linalg.lstsq(x, np.ones(len(x)), rcond=None)[0]
        excess = np.log(y / _model(coef, t, q))
        med = median(excess[keep])
        mad = median(np.abs(excess[keep] - med))
        if not mad:
            break
        judge = (coef, med, mad)
        keep = np.abs(_z(excess, med, mad)) <= OUTLIER_Z
    index = np.zeros(0, dtype=np.int64)
    if judge is not None:
        c, med, mad = judge
        parts = []
        for a in range(0, len(ns), JUDGE_CHUNK):
            y_, t_, q_ = _model_inputs(ns[a : a + JUDGE_CHUNK], num_tokens[a : a + JUDGE_CHUNK],
                                       num_reqs[a : a + JUDGE_CHUNK])
            parts.append(np.flatnonzero(_z(np.log(y_ / _model(c, t_, q_)), med, mad) > OUTLIER_Z) + a)
        index = np.concatenate(parts)
    _, t, q = _model_inputs(ns[index], num_tokens[index], num_reqs[index])
    return SlowSteps(index, ns[index], _model(coef, t, q))


def _model_inputs(ns: np.ndarray, num_tokens: np.ndarray, num_reqs: np.ndarray):
    """(time, tokens, requests) as float64, time at least 1 ns."""
    return np.maximum(ns.astype(np.float64), 1.0), num_tokens.astype(np.float64), num_reqs.astype(np.float64)


def _model(coef: np.ndarray, t: np.ndarray, q: np.ndarray) -> np.ndarray:
    return np.maximum(coef[0] + coef[1] * t + coef[2] * q, 1.0)


def _z(excess: np.ndarray, med: float, mad: float) -> np.ndarray:
    """The modified z-score of log(time / model)."""
    return 0.6745 * (excess - med) / mad


def _slow_step_warnings(r: ReplayResult, m: np.ndarray) -> list[str]:
    """The slow work steps, then the slow reads, each with its worst step (the largest time over the model)."""
    out = []
    nr, nt = r.measured_counts()
    steps = r.measured_steps()
    read = r.phases.index("read_step") if "read_step" in r.phases else None
    work = row_sums(m, [i for i in range(len(r.phases)) if i != read])  # [measured steps]
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
