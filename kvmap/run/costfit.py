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
CHUNK = 1 << 14  # steps a pass holds at once


def fit_line(x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> dict:
    """{fixed, slope, r2, steps, left_out} of y / scale = fixed + slope * x (least squares, the closed form over
    centred sums), outliers of y left out. Two passes of CHUNK steps each (the means, then the centred sums):
    a long run's fit holds no series-sized float64 copy."""
    med = median(y) if len(y) else 0.0
    limit = OUTLIER_FACTOR * med if med > 0 else np.inf
    n, sx, sy = 0, 0.0, 0.0
    for c in range(0, len(y), CHUNK):
        keep = y[c : c + CHUNK] <= limit
        n += int(np.count_nonzero(keep))
        sx += float(x[c : c + CHUNK][keep].sum(dtype=np.float64))
        sy += float(y[c : c + CHUNK][keep].sum(dtype=np.float64))
    left_out = int(len(y) - n)
    if n == 0:
        return {"fixed": 0.0, "slope": 0.0, "r2": None, "steps": 0, "left_out": left_out}
    mx, my = sx / n, sy / n
    sxx = sxy = syy = 0.0
    for c in range(0, len(y), CHUNK):
        keep = y[c : c + CHUNK] <= limit
        dx = x[c : c + CHUNK][keep].astype(np.float64) - mx
        dy = y[c : c + CHUNK][keep].astype(np.float64) - my
        sxx, sxy, syy = sxx + float(dx @ dx), sxy + float(dx @ dy), syy + float(dy @ dy)
    if n < 2 or sxx == 0:  # no spread in x: the mean
        return {"fixed": my / scale, "slope": 0.0, "r2": None, "steps": n, "left_out": left_out}
    slope = sxy / sxx
    r2 = sxy * sxy / (sxx * syy) if syy else None
    return {"fixed": (my - slope * mx) / scale, "slope": slope / scale, "r2": r2, "steps": n, "left_out": left_out}


def cost_dict(r: ReplayResult) -> dict:
    """Per phase (then mappings, step): the fit against scheduled tokens and against requests, in microseconds."""
    reqs, toks = r.measured_counts()
    out = {}
    for name, ns in phase_series(r):
        t, q = fit_line(toks, ns, 1e3), fit_line(reqs, ns, 1e3)
        out[name] = {"fixed_us": t["fixed"], "per_token_us": t["slope"], "r2_tokens": t["r2"],
                     "fixed_us_by_reqs": q["fixed"], "per_request_us": q["slope"], "r2_reqs": q["r2"],
                     "steps": t["steps"], "left_out": t["left_out"]}
    return {"scope": "least squares over the measured steps, steps over 10x their phase's median left out: "
                     "time_us = fixed_us + per_token_us * scheduled tokens; apart, = fixed_us_by_reqs + "
                     "per_request_us * requests", "phases": out}
