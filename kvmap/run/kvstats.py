"""The KV cache's memory efficiency over the measured steps, from a `ReplayResult`'s occupancy series.

Rules: every figure is over the measured steps (result.py's one definition) that hold any KV (a step with no
block in use has no efficiency). Paged efficiency = tokens held / (blocks in use x block_size), per group, with
DCP summed over the computed ranks (each stores block_size tokens per block id); contiguous allocation holds the
live requests' KV lengths in `max_model_len` each (`contiguous_max_len`) or in each life's final length
(`contiguous_final`). The summary (mean, 5th percentile, minimum) is the replay's own, kept as it went
(occupancy.py, kvsummary.py), so that a run without its series still has it; the series here are the same
ratios per step, for the pictures. Nothing here measures or draws.
"""

from __future__ import annotations

import numpy as np

from kvmap.run.result import ReplayResult


def kv_series(r: ReplayResult, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
    """{column: [recorded steps lo..hi-1] integers} of the occupancy series (empty when the run has none)."""
    return {c: r.kv_series[lo:hi, i] for i, c in enumerate(r.kv_columns)} if r.kv_series.size else {}


def efficiency_series(r: ReplayResult, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
    """{name: [recorded steps lo..hi-1] float64 efficiency (NaN where nothing is held)}: `g{G}` per KV group (and
    `g{G}.r{R}` per DCP rank when several), `contiguous_max_len`, `contiguous_final`."""
    s = kv_series(r, lo, hi)
    if not s:
        return {}
    out: dict[str, np.ndarray] = {}
    for g, grp in enumerate(r.groups):
        held = [c for c in s if c.startswith(f"g{g}.held.")]
        if not held:
            continue
        in_use = s[f"g{g}.in_use"].astype(np.float64)
        bs = grp["block_size"]
        out[f"g{g}"] = _ratio(sum(s[c] for c in held), in_use * bs * len(held))
        if len(held) > 1:
            for c in held:
                out[f"g{g}.{c.rsplit('.', 1)[1]}"] = _ratio(s[c], in_use * bs)
    max_len = r.engine.get("max_model_len", 0)
    out["contiguous_max_len"] = _ratio(s["tokens"], s["live"].astype(np.float64) * max_len)
    out["contiguous_final"] = _ratio(s["tokens"], s["reserve_final"])
    return out


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    b = np.asarray(b, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)


def memory_dict(r: ReplayResult) -> dict | None:
    """The summary's `kv_memory`: per efficiency series {mean, p5, min, steps} over the measured steps that hold
    KV (kept by the replay as it went: occupancy.py), the most blocks in use and shared per group, the pool;
    None for a run without a KV tally."""
    if not r.kv_memory:
        return None
    return {"scope": "measured steps holding KV; paged = tokens held / (blocks in use x block_size); contiguous = "
                     "the live requests' KV lengths / max_model_len each (max_len) or / each request's final "
                     "length (final); p5 to 0.01%",
            "num_gpu_blocks": r.engine.get("num_gpu_blocks"), "max_model_len": r.engine.get("max_model_len"),
            "efficiency": r.kv_memory["efficiency"], "groups": r.kv_memory["groups"]}


def free_blocks(r: ReplayResult, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """[recorded steps lo..hi-1] blocks free in the pool: num_gpu_blocks - the null block - every group's blocks in
    use."""
    s = kv_series(r, lo, hi)
    used = sum(s[f"g{g}.in_use"] for g in range(len(r.groups)) if f"g{g}.in_use" in s)
    null = 1 if r.engine.get("null_block_id") is not None else 0
    return r.engine.get("num_gpu_blocks", 0) - null - used
