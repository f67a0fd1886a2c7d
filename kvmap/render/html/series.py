"""A run's per-step series as the report's figures draw them: plain lists, downsampled past MAX_POINTS steps.

Rules:
- Every number comes from the run data `--json` writes: the result's arrays and `summary_dict` (render/report.py);
  nothing is measured or recomputed here but the downsampling and the stacking order.
- Downsampling keeps the shape: past MAX_POINTS steps the steps are cut into BUCKETS equal runs, and every series
  keeps, per run, its minimum then its maximum (a min/max envelope), so a single slow step still shows at full
  height. `x` then holds each run's first step, twice.
- Times are microseconds (float), counts integers; NaN (no efficiency: nothing held) becomes null.
"""

from __future__ import annotations

import math

import numpy as np

from kvmap.run.kvstats import efficiency_series, free_blocks, kv_series
from kvmap.run.result import ReplayResult
from kvmap.run.stats import phase_series, slow_steps

MAX_POINTS = 4000  # steps drawn one by one up to this many
BUCKETS = 1500  # runs of steps past it (two points each)


def envelope(x: np.ndarray, series: dict[str, np.ndarray], max_points: int = MAX_POINTS,
             buckets: int = BUCKETS) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(x, {name: values}) with at most `max_points` points: as given, or per run of steps its first step twice
    and each series' min then max."""
    n = len(x)
    if n <= max_points:
        return x, series
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    starts = edges[:-1]
    xs = np.repeat(x[starts], 2)
    out = {}
    for name, v in series.items():
        v = np.asarray(v, dtype=np.float64)
        filled = np.where(np.isnan(v), -np.inf, v)
        hi = np.maximum.reduceat(filled, starts)
        lo = np.minimum.reduceat(np.where(np.isnan(v), np.inf, v), starts)
        hi[np.isinf(hi)], lo[np.isinf(lo)] = np.nan, np.nan
        pair = np.empty(2 * len(starts))
        pair[0::2], pair[1::2] = lo, hi
        out[name] = pair
    return xs, out


def _plain(v) -> list:
    """JSON-ready exact values: ints stay ints, floats stay floats, NaN -> None."""
    a = np.asarray(v)
    if a.dtype.kind in "iu":
        return a.tolist()
    return [None if math.isnan(f) else f for f in a.astype(np.float64).tolist()]


def figure_data(r: ReplayResult, summary: dict) -> dict:
    """Everything the report's figures draw, as plain data (see the module's rules)."""
    steps = r.steps
    phase_us = {p: r.phase_ns[:, i] / 1e3 for i, p in enumerate(r.phases)}
    x, times = envelope(steps, phase_us)
    m_steps = r.measured_steps()
    m = r.measured()
    read = r.phases.index("read_step") if "read_step" in r.phases else None
    work = m.sum(axis=1) - (m[:, read] if read is not None else 0)
    nr, nt = r.measured_counts()
    slow = slow_steps(work, nt, nr)
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
            "us": {name: _plain(ns[pick] / 1e3) for name, ns in phase_series(r)}, "steps": int(len(m))}


def _mix(r: ReplayResult) -> dict | None:
    if not r.mix_series.size:
        return None
    series = {c: r.mix_series[:, i] for i, c in enumerate(r.mix_columns)}
    series["requests"] = r.num_reqs
    x, s = envelope(r.steps, series)
    return {"x": _plain(x), "series": {k: _plain(v) for k, v in s.items()}}


def _kv(r: ReplayResult) -> dict | None:
    s = kv_series(r)
    if not s:
        return None
    series = {k: v for k, v in s.items()}
    series["free"] = free_blocks(r)
    eff = {f"eff.{k}": v for k, v in efficiency_series(r).items()}
    x, out = envelope(r.steps, {**series, **eff})
    return {"x": _plain(x), "series": {k: _plain(v) for k, v in out.items()},
            "groups": [dict(g, group=i) for i, g in enumerate(r.groups)], "ranks": list(r.ranks) or [0],
            "num_gpu_blocks": r.engine.get("num_gpu_blocks"), "max_model_len": r.engine.get("max_model_len")}
