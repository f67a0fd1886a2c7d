"""`kvmap compare`'s data: per-phase ratios B / A of two saved runs, and whether the two runs did the same work
(drawn by render/compare.py).

Rules: a ratio means something only between runs of the same work: the same trace (by name), the same
measured steps with the same token counts, the same KV cache groups, KV geometry and size, the same phases.
`differences` lists every way two runs differ in their work; the CLI refuses them unless asked
(`--allow-different`), and then warns loudly. The backend, the device and the machine may differ: that is what
a comparison is for. Each run's own noise warnings (stats.py `warnings`) travel with the ratios.
- Saved with `--runs N`, a run gives each phase as the mean +- sigma of its runs' medians, and the ratio of the
  means its uncertainty (run/runs.py, hyperfine's relative speed); a run without repeats counts as one run, its
  spread unknown (sigma 0), and `verdict` says so.
"""

from __future__ import annotations

from pathlib import PurePath

import numpy as np

from kvmap.run.result import ReplayResult
from kvmap.run.runs import ratio, runs_stats
from kvmap.run.stats import phase_stats, warnings, window_text


def differences(a: ReplayResult, b: ReplayResult) -> list[str]:
    """Every way the two runs' work differs, in words (empty: the same work)."""
    out = []
    ta, tb = PurePath(a.trace).name, PurePath(b.trace).name
    if ta != tb:
        out.append(f"trace: {ta} vs {tb}")
    sa, sb = a.measured_steps(), b.measured_steps()
    if len(sa) != len(sb) or not np.array_equal(sa, sb):
        span = (lambda s: f"{int(s[0])}..{int(s[-1])}" if len(s) else "none")
        out.append(f"measured steps: {span(sa)} ({len(sa)}, window {window_text(a)}) vs {span(sb)} ({len(sb)}, "
                   f"window {window_text(b)})")
    elif not np.array_equal(a.measured_counts()[1], b.measured_counts()[1]):
        out.append("tokens per measured step differ: not the same trace content")
    if a.groups != b.groups:
        out.append(f"KV cache groups: {a.groups} vs {b.groups}")
    if a.kv_geometry != b.kv_geometry or a.kv_bytes != b.kv_bytes:
        out.append(f"KV cache: {a.kv_bytes / 2**20:.1f} MiB {a.kv_geometry or 'off'} vs {b.kv_bytes / 2**20:.1f} "
                   f"MiB {b.kv_geometry or 'off'}")
    if set(a.phases) != set(b.phases):
        out.append(f"phases: {', '.join(a.phases)} vs {', '.join(b.phases)}")
    return out


def compare_dict(a: ReplayResult, b: ReplayResult) -> dict:
    sa = {s.name: s for s in phase_stats(a)}
    sb = {s.name: s for s in phase_stats(b)}
    ra, rb = runs_stats(a), runs_stats(b)
    rows = {}
    for name in [n for n in sa if n in sb]:
        x, y = sa[name], sb[name]
        q = ratio(ra[name], rb[name]) if name in ra and name in rb else None
        rows[name] = {"a_p50_us": x.p50_us, "b_p50_us": y.p50_us,
                      "ratio_p50": (y.p50_us / x.p50_us) if x.p50_us else None,
                      "a_mean_us": x.mean_us, "b_mean_us": y.mean_us,
                      "ratio_mean": (y.mean_us / x.mean_us) if x.mean_us else None,
                      "a_runs_p50_us": [ra[name].mean, ra[name].sigma] if name in ra else None,
                      "b_runs_p50_us": [rb[name].mean, rb[name].sigma] if name in rb else None,
                      "ratio_runs": None if q is None else list(q)}

    def run(r: ReplayResult) -> dict:
        return {"trace": r.trace, "backend": r.backend, "device": r.device, "machine": r.machine,
                "window": list(r.step_window), "steps_measured": int(len(r.measured())),
                "kv_bytes": r.kv_bytes, "runs": max(len(r.runs_p50_us), 1), "produced_by": r.provenance,
                "warnings": warnings(r)}

    return {"a": run(a), "b": run(b), "same_work": not differences(a, b), "differences": differences(a, b),
            "phases": rows, "verdict": verdict(ra.get("step"), rb.get("step"))}


def verdict(a, b) -> str | None:
    """hyperfine's sentence for the median step time: "B is 1.23 +- 0.04 times faster than A (...)", or None."""
    if a is None or b is None or not a.mean or not b.mean:
        return None
    fast, slow, names = (b, a, ("B", "A")) if b.mean < a.mean else (a, b, ("A", "B"))
    q, sigma = ratio(fast, slow)
    if a.n > 1 and b.n > 1:
        return (f"{names[0]} is {q:.2f} +- {sigma:.2f} times faster than {names[1]} (median step time, mean +- "
                f"sigma over {a.n} and {b.n} runs)")
    single = ("A and B are a single run each" if a.n == b.n == 1 else
              f"{'A' if a.n == 1 else 'B'} is a single run")
    return (f"{names[0]} is {q:.2f} times faster than {names[1]} (median step time; {single}, so the ratio's "
            f"uncertainty is unknown: replay with --runs N)")
