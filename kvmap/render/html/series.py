"""A run's per-step series as the report's figures draw them: plain lists, downsampled past MAX_POINTS steps.

Rules:
- Every number comes from the run data `--json` writes: the result's arrays and `summary_dict` (render/report.py);
  nothing is measured or recomputed here but the downsampling and the stacking order.
- Downsampling keeps the shape: past MAX_POINTS steps the steps are cut into BUCKETS equal runs, and every series
  keeps, per run, its minimum then its maximum (a min/max envelope), so a single slow step still shows at full
  height. `x` then holds each run's first step, twice. The runs are made PART steps at a time, each part's values
  dropped (and a series on disk let go) before the next: a long run never holds a whole float64 series.
- Times are microseconds (float), counts integers; NaN (no efficiency: nothing held) becomes null.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np

from kvmap.ondisk import release
from kvmap.run.kvstats import efficiency_series, free_blocks, kv_series
from kvmap.run.result import ReplayResult
from kvmap.run.stats import phase_series, row_sums, slow_steps

MAX_POINTS = 4000  # steps drawn one by one up to this many
BUCKETS = 1500  # runs of steps past it (two points each)
PART = 1 << 14  # steps whose values are made at once past MAX_POINTS (whole runs)


def envelope(x: np.ndarray, rows: Callable[[int, int], dict[str, np.ndarray]], max_points: int = MAX_POINTS,
             buckets: int = BUCKETS, held: tuple[np.ndarray, ...] = ()) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(x, {name: values}) with at most `max_points` points: `rows(0, len(x))` as given, or per run of steps its
    first step twice and each series' min then max. `rows(lo, hi)` gives {name: values of steps lo..hi-1}, asked
    for whole runs of about PART steps at a time; `held`: arrays on disk that `rows` reads, let go after each
    part (ondisk.py)."""
    n = len(x)
    if n <= max_points:
        return x, rows(0, n)
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    xs = np.repeat(x[edges[:-1]], 2)
    out: dict[str, np.ndarray] = {}
    b = 0
    while b < buckets:
        e = min(max(int(np.searchsorted(edges, edges[b] + PART)), b + 1), buckets)
        while e < buckets and edges[e - 1] == edges[e]:  # an empty run reads the next one's first step: keep it in
            e += 1
        lo = int(edges[b])
        for name, v in rows(lo, int(edges[e])).items():
            pair = out.setdefault(name, np.empty(2 * buckets))
            pair[2 * b : 2 * e : 2], pair[2 * b + 1 : 2 * e : 2] = _min_max(v, edges[b:e] - lo)
        for a in held:
            release(a)
        b = e
    return xs, out


def _min_max(v: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per run of `v` from each of `starts` to the next (the last to the end): its minimum and maximum as float64,
    NaN left out (NaN where a run has nothing else)."""
    v = np.asarray(v, dtype=np.float64)
    hi = np.maximum.reduceat(np.where(np.isnan(v), -np.inf, v), starts)
    lo = np.minimum.reduceat(np.where(np.isnan(v), np.inf, v), starts)
    hi[np.isinf(hi)], lo[np.isinf(lo)] = np.nan, np.nan
    return lo, hi


def _plain(v) -> list:
    """JSON-ready exact values: ints stay ints, floats stay floats, NaN -> None."""
    a = np.asarray(v)
    if a.dtype.kind in "iu":
        return a.tolist()
    return [None if math.isnan(f) else f for f in a.astype(np.float64).tolist()]


def figure_data(r: ReplayResult, summary: dict) -> dict:
    """Everything the report's figures draw, as plain data (see the module's rules)."""
    steps = r.steps
    x, times = envelope(steps, lambda lo, hi: {p: r.phase_ns[lo:hi, i] / 1e3 for i, p in enumerate(r.phases)},
                        held=(r.phase_ns,))
    m_steps = r.measured_steps()
    m = r.measured()
    read = r.phases.index("read_step") if "read_step" in r.phases else None
    work = row_sums(m, [i for i in range(len(r.phases)) if i != read])  # a column at a time (ondisk.py)
    nr, nt = r.measured_counts()
    slow = slow_steps(work, nt, nr)
    del work
    out = {
        "phases": list(r.phases),
        "warmup_steps": _plain(r.warmup_steps()),
        "measured": [int(m_steps[0]), int(m_steps[-1])] if len(m_steps) else None,
        "downsampled": len(x) != len(steps),
        "time": {"x": _plain(x), "us": {p: _plain(v) for p, v in times.items()}},
        "slow": {"steps": _plain(m_steps[slow.index]), "us": _plain(slow.ns / 1e3)},
        "scatter": _scatter(r),
        "cost": summary["cost"],
        "mix": _mix(r),
        "kv": _kv(r),
    }
    return out


def _scatter(r: ReplayResult) -> dict:
    """Measured steps: tokens, requests and time (us) of the step, the mappings and each phase; envelope-free:
    past MAX_POINTS an even sample of the steps (every k-th)."""
    nr, nt = r.measured_counts()
    m = r.measured()
    k = max(1, -(-len(nt) // MAX_POINTS))
    pick = slice(None, None, k)
    return {"sampled_every": k, "tokens": _plain(nt[pick]), "reqs": _plain(nr[pick]),
            "us": {name: _plain(ns[pick] / 1e3) for name, ns in _released(phase_series(r), r.phase_ns)},
            "steps": int(len(m))}


def _released(items: Iterator, a: np.ndarray) -> Iterator:
    """`items`, letting `a` go after each (a series on disk: ondisk.py)."""
    for item in items:
        yield item
        release(a)


def _mix(r: ReplayResult) -> dict | None:
    if not r.mix_series.size:
        return None

    def rows(lo: int, hi: int) -> dict[str, np.ndarray]:
        series = {c: r.mix_series[lo:hi, i] for i, c in enumerate(r.mix_columns)}
        series["requests"] = r.num_reqs[lo:hi]
        return series

    x, s = envelope(r.steps, rows, held=(r.mix_series,))
    return {"x": _plain(x), "series": {k: _plain(v) for k, v in s.items()}}


def _kv(r: ReplayResult) -> dict | None:
    if not r.kv_series.size:
        return None

    def rows(lo: int, hi: int) -> dict[str, np.ndarray]:
        series = kv_series(r, lo, hi)
        series["free"] = free_blocks(r, lo, hi)
        return {**series, **{f"eff.{k}": v for k, v in efficiency_series(r, lo, hi).items()}}

    x, out = envelope(r.steps, rows, held=(r.kv_series,))
    return {"x": _plain(x), "series": {k: _plain(v) for k, v in out.items()},
            "groups": [dict(g, group=i) for i, g in enumerate(r.groups)], "ranks": list(r.ranks) or [0],
            "num_gpu_blocks": r.engine.get("num_gpu_blocks"), "max_model_len": r.engine.get("max_model_len")}
