"""How each phase's time scales with the batch: a fixed cost per step plus a cost per scheduled token (and, apart,
per scheduled request), fitted over the measured steps.

Rules: ordinary least squares on the measured steps (result.py's one definition), time_us = fixed_us + per_x_us *
x for x = scheduled tokens, then x = requests; a step whose time is over OUTLIER_FACTOR times the median of its
phase is left out of the fit (first-touch and a busy machine, the slow-step warning's steps, would tilt it), and
the count left out is said. `r2` is the fit's coefficient of determination on the steps kept. The fit is derived
from the per-step times, never stored: `--json`, the summary and the pictures all call `cost_dict`.
"""

from __future__ import annotations

import numpy as np

from kvmap.run.result import ReplayResult
from kvmap.run.stats import median, phase_series

OUTLIER_FACTOR = 10.0  # steps slower than this many medians of their phase are left out of the fit


def fit_line(x: np.ndarray, y: np.ndarray) -> dict:
    """{fixed, slope, r2, steps, left_out} of y = fixed + slope * x (least squares, the closed form over centred
    sums: no design matrix, so a long run's fit costs a few series-sized temporaries), outliers of y left out."""
    med = median(y) if len(y) else 0.0
    keep = y <= OUTLIER_FACTOR * med if med > 0 else np.ones(len(y), dtype=bool)
    xs, ys = x[keep].astype(np.float64), y[keep].astype(np.float64)
    left_out = int(len(y) - len(ys))
    if len(xs) < 2 or np.ptp(xs) == 0:
        fixed = float(ys.mean()) if len(ys) else 0.0
        return {"fixed": fixed, "slope": 0.0, "r2": None, "steps": int(len(xs)), "left_out": left_out}
    mx, my = xs.mean(), ys.mean()
    xs -= mx
    ys -= my
    sxx, sxy, syy = float(xs @ xs), float(xs @ ys), float(ys @ ys)
    slope = sxy / sxx
    r2 = sxy * sxy / (sxx * syy) if syy else None
    return {"fixed": float(my - slope * mx), "slope": slope, "r2": r2, "steps": int(len(xs)), "left_out": left_out}


def cost_dict(r: ReplayResult) -> dict:
    """Per phase (then mappings, step): the fit against scheduled tokens and against requests, in microseconds."""
    reqs, toks = r.measured_counts()
    out = {}
    for name, ns in phase_series(r):
        us = ns / 1e3
        t, q = fit_line(toks, us), fit_line(reqs, us)
        out[name] = {"fixed_us": t["fixed"], "per_token_us": t["slope"], "r2_tokens": t["r2"],
                     "fixed_us_by_reqs": q["fixed"], "per_request_us": q["slope"], "r2_reqs": q["r2"],
                     "steps": t["steps"], "left_out": t["left_out"]}
    return {"scope": "least squares over the measured steps, steps over 10x their phase's median left out: "
                     "time_us = fixed_us + per_token_us * scheduled tokens; apart, = fixed_us_by_reqs + "
                     "per_request_us * requests", "phases": out}
