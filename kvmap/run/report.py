"""Renderers: turn a `ReplayResult` into a summary (Rich's, or for a pipe the same text without Rich:
plain.py), JSON, CSV, a Chrome trace (comparisons: compare.py).

Rules: renderers only read results; nothing here measures. Every number is over the measured steps
(result.py's one definition, stated in the summary's `steps` line and in `--json`'s `scope`); rates divide by
the sum of the measured steps' phase times, not wall time. Safe printing lives in text.py (`safe`, `say`,
`fit_table`, `rich_table`) for every renderer: names and ids are never markup, control characters are escaped,
messages are not wrapped when piped, tables keep key columns whole at 80 columns. The summary's content is
built once (lines as (text, style) parts, the phase table as a `TableSpec`) and drawn by one of the two.
Outliers use the MAD-based modified z-score (as hyperfine does) with threshold 14; the noise warning fires
when the median absolute deviation of step time exceeds 25% of the median.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvmap.run.plain import TableSpec, draw_table
from kvmap.run.result import MAPPING_PHASES, ReplayResult
from kvmap.run.text import fit_table, rich_table, safe, say

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console
    from rich.table import Table

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
    """`np.percentile(values, qs)` (its default, linear interpolation, and its rounding), from one sort.
    (np.percentile itself imports numpy.ma on first use: 20 ms of every replay.)"""
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


def phase_stats(r: ReplayResult) -> list[PhaseStats]:
    """Per phase, then `mappings` (the four mapping phases) and `step` (all phases)."""
    m = r.measured()
    total = m.sum(axis=1) if len(m) else np.zeros(0, dtype=np.int64)
    all_ns = float(total.sum())
    rows = [_stats(p, m[:, i], all_ns) for i, p in enumerate(r.phases)]
    mi = [r.phases.index(p) for p in MAPPING_PHASES if p in r.phases]
    rows.append(_stats("mappings", m[:, mi].sum(axis=1) if len(m) else total, all_ns))
    rows.append(_stats("step", total, all_ns))
    return rows


def window_text(r: ReplayResult) -> str:
    """`START:END` as asked (END empty when open)."""
    start, stop = r.step_window
    return f"{start}:{'' if stop is None else stop}"


def _span(steps: np.ndarray) -> str:
    return f"{int(steps[0])}..{int(steps[-1])}" if len(steps) else "none"


def steps_text(r: ReplayResult) -> str:
    """Which steps were replayed, measured and warm-up, in words: the one definition, stated."""
    ms, ws = r.measured_steps(), r.warmup_steps()
    text = f"{r.steps_replayed} replayed; {len(ms)} measured ({_span(ms)}"
    text += f", the window {window_text(r)})" if r.step_window[0] or r.step_window[1] is not None else ")"
    if r.prewarm_steps:
        return text + (f"; warm-up 0..{r.prewarm_steps - 1} replayed first by a throwaway worker, untimed (the "
                       "window starts at 0)")
    if not len(ws):
        return text + "; no warm-up"
    where = ("just before the window" if r.warmup_before_window() else
             "the window's first steps (a given worker cannot be warmed apart)")
    return text + f"; warm-up {_span(ws)}: timed, not counted, {where}"


def warnings(r: ReplayResult) -> list[str]:
    out = []
    m = r.measured()
    start, stop = r.step_window
    if r.steps_in_trace is not None and stop is not None and r.steps_in_trace < stop:
        out.append(f"the window {window_text(r)} runs past the trace's end ({r.steps_in_trace} steps): measured "
                   f"{_span(r.measured_steps())}")
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


def _span_list(steps: np.ndarray) -> list[int] | None:
    return [int(steps[0]), int(steps[-1])] if len(steps) else None


def summary_dict(r: ReplayResult) -> dict:
    """The summary as data. Every count, mean and rate is over the measured steps (`scope`)."""
    reqs, toks = r.measured_counts()
    m = r.measured()
    n = int(len(m))
    total_s = float(m.sum()) / 1e9
    h2d = r.h2d_bytes_measured if r.h2d_bytes_measured is not None else r.h2d_bytes
    return {
        "trace": r.trace,
        "backend": r.backend,
        "backend_detail": r.backend_detail,
        "scope": "requests, tokens, means, rates, phases and h2d are over the measured steps; steps_replayed and "
                 "kv.checked count every replayed step; rates divide by the sum of the measured steps' phase "
                 "times (time_s), not wall time",
        "window": list(r.step_window),
        "steps_replayed": r.steps_replayed,
        "steps_measured": n,
        "measured_steps": _span_list(r.measured_steps()),
        "warmup": r.warmup,
        "warmup_steps": _span_list(r.warmup_steps()),
        "warmup_before_window": r.warmup_before_window() and r.warmup > 0,
        "prewarm_steps": r.prewarm_steps,
        "requests": r.requests_measured if r.requests_measured is not None else r.requests_seen,
        "tokens_scheduled": int(toks.sum()),
        "mean_reqs_per_step": float(reqs.mean()) if len(reqs) else 0.0,
        "mean_tokens_per_step": float(toks.mean()) if len(toks) else 0.0,
        "time_s": total_s,
        "steps_per_s": n / total_s if total_s else 0.0,
        "tokens_per_s": float(toks.sum()) / total_s if total_s else 0.0,
        "wall_s": r.wall_s,
        "decoding": ({"scanned": r.lines_scanned, "decoded": sum(r.lines_declined.values()),
                      "declined": r.lines_declined} if r.lines_scanned is not None else None),
        "device": r.device,
        "h2d_bytes_per_step": h2d / max(n, 1),
        "device_phases_p50_us": ({p: median(r.device_phase_ns[r.warmup:, i]) / 1e3
                                  for i, p in enumerate(r.phases)} if r.device_phase_ns.size else None),
        "kv": {"bytes": r.kv_bytes, "geometry": r.kv_geometry, "verified": r.kv_verified,
               "checked": r.kv_checked, "mismatches": r.kv_mismatches},
        "phases": {s.name: {"mean_us": s.mean_us, "p50_us": s.p50_us, "p90_us": s.p90_us, "p99_us": s.p99_us,
                            "min_us": s.min_us, "max_us": s.max_us, "total_ms": s.total_ms, "share": s.share}
                   for s in phase_stats(r)},
        "warnings": warnings(r),
        **({"ranks": rank_dict(r)} if r.cp_size > 1 or r.kernel_block_sizes or r.world_size > 1 else {}),
    }





def rank_dict(r: ReplayResult) -> dict:
    """Per-rank figures of a multi-rank replay (decode context parallelism, kernel block splits)."""
    return {"decode_context_parallel_size": r.cp_size, "cp_kv_cache_interleave_size": r.interleave,
            "tensor_parallel_size": r.tp_size, "processes": r.world_size, "kernel_block_sizes": r.kernel_block_sizes,
            "per_rank": [{"rank": k, "local_tokens": _at(r.rank_tokens, i), "kv_bytes": _at(r.rank_kv_bytes, i),
                          "kv_checked": _at(r.rank_kv_checked, i), "kv_mismatches": _at(r.rank_kv_mismatches, i),
                          "max_local_seq_len": _at(r.rank_max_local_seq_len, i),
                          "broadcast_p50_us": (r.rank_broadcast_p50_ns[i] / 1e3 if i < len(r.rank_broadcast_p50_ns)
                                               else None)}
                         for i, k in enumerate(r.ranks)] if r.cp_size > 1 else []}


def _at(xs: list, i: int):
    return xs[i] if i < len(xs) else None


def render_ranks(r: ReplayResult, console: Console) -> None:
    from rich.text import Text

    d = rank_dict(r)
    line = (f"DCP {r.cp_size} (interleave {r.interleave}), TP {r.tp_size}, "
            + (f"{r.world_size} processes" if r.world_size > 1 else
               "every rank in this process" if len(r.ranks) == r.cp_size else
               f"rank {', '.join(map(str, r.ranks))} of {r.cp_size} in this process"))
    if r.kernel_block_sizes:
        line += ", kernel blocks " + "/".join(map(str, r.kernel_block_sizes))
    say(console, Text.assemble((f"{'ranks':<12}", "bold"), line))
    if not d["per_rank"]:
        return
    t = fit_table(console, "per DCP rank")
    cols = ["rank", "local tokens", "max local seq_len", "KV shard KiB", "KV read back", "mismatches"]
    dist = bool(r.rank_broadcast_p50_ns)
    for col in cols + (["broadcast p50 us"] if dist else []):
        t.add_column(col, justify="right", no_wrap=col == "rank")
    for x in d["per_rank"]:
        t.add_row(str(x["rank"]), f"{x['local_tokens']:,}" if x["local_tokens"] is not None else "",
                  str(x["max_local_seq_len"] or ""), f"{x['kv_bytes'] / 2**10:,.1f}" if x["kv_bytes"] else "",
                  f"{x['kv_checked']:,}" if x["kv_checked"] is not None else "",
                  str(x["kv_mismatches"]) if x["kv_mismatches"] is not None else "",
                  *([f"{x['broadcast_p50_us']:.0f}" if x["broadcast_p50_us"] is not None else ""] if dist else []))
    console.print(t)


def render_summary(r: ReplayResult, console) -> None:
    """The summary: its lines, the phase table, its notes. `console` is a Rich console, or the CLI's console
    that can say where Rich would draw plainly (`plain_width()`: a file or a pipe): there the summary is drawn
    without Rich (plain.py), the same bytes, unless it holds something only Rich draws (the per-rank and
    device tables, or a table that would wrap)."""
    s = summary_dict(r)
    lines = _summary_lines(r, s)
    spec = _phase_spec(r)
    notes = _summary_notes(r, s)
    width = console.plain_width() if hasattr(console, "plain_width") else None
    ranks = r.cp_size > 1 or r.kernel_block_sizes or r.world_size > 1
    table = draw_table(spec, width) if width is not None and not ranks and not r.device_phase_ns.size else None
    if table is not None:
        console.write_lines([*map(_unstyled, lines), *table, *map(_unstyled, notes)])
        return
    from rich.text import Text

    for parts in lines:
        say(console, Text.assemble(*parts))
    if ranks:
        render_ranks(r, console)
    console.print(rich_table(spec, console))
    if r.device_phase_ns.size:
        console.print(_device_table(r, console))
    for parts in notes:
        say(console, Text.assemble(*parts))


def _unstyled(parts: list[tuple[str, str | None]]) -> str:
    """A line's (text, style) parts as the text Rich writes without colour."""
    return "".join(text for text, _ in parts)


def _summary_lines(r: ReplayResult, s: dict) -> list[list[tuple[str, str | None]]]:
    """The summary's lines above its tables, each as (text, style) parts (text already `safe`)."""
    groups = ", ".join(f"{g['kind']} bs={g['block_size']}" + (f" window={g['sliding_window']}"
                                                               if g.get("sliding_window") else "") for g in r.groups)
    backend = safe(r.backend) + (f" ({r.backend_detail})" if r.backend_detail else "")
    head = [("trace", f"{safe(r.trace)}  ({r.protocol} protocol, {groups})"), ("backend", backend),
            ("steps", steps_text(r)), ("requests", f"{s['requests']} scheduled in the measured steps"),
            ("tokens", f"{s['tokens_scheduled']} scheduled in the measured steps, {s['mean_tokens_per_step']:.1f} "
                       f"per step, {s['mean_reqs_per_step']:.1f} requests per step"),
            ("throughput", f"{s['steps_per_s']:,.0f} steps/s, {s['tokens_per_s']:,.0f} tokens/s (measured steps "
                           f"over the sum of their phase times, {s['time_s'] * 1e3:.2f} ms; not wall time)")]
    if r.lines_scanned is not None:
        head.insert(2, ("decoding", decoding_text(r)))
    if r.kv_bytes:
        g = r.kv_geometry
        head.append(("KV cache", f"{r.kv_bytes / 2**20:.1f} MiB ({g.get('num_kv_heads')} heads x "
                                 f"{g.get('head_size')} x {g.get('dtype')} per token, K and V, per group)"))
    lines = [[(f"{key:<12}", "bold"), (value, None)] for key, value in head]
    if r.kv_verified:
        verdict = ("0 mismatches", "green") if not r.kv_mismatches else (f"{r.kv_mismatches} mismatches", "red")
        lines.append([(f"{'KV verify':<12}", "bold"), (f"{r.kv_checked:,} positions read back over all "
                                                       f"{r.steps_replayed} replayed steps, ", None), verdict])
    return lines


def _summary_notes(r: ReplayResult, s: dict) -> list[list[tuple[str, str | None]]]:
    """The summary's lines below its tables: the staged copy, located KV mismatches, warnings."""
    notes: list[list[tuple[str, str | None]]] = []
    if r.h2d_bytes:
        notes.append([(f"host-to-device: {s['h2d_bytes_per_step']:,.0f} bytes per measured step in one staged "
                       "copy", None)])
    for e in r.kv_examples[:5]:
        notes.append([("KV mismatch", "red"), (safe(
            f" step {e['step']}, request {e['req_id']!r}, " + (f"rank {e.get('rank', 0)}, " if r.cp_size > 1 else "")
            + f"group {e['group']}, position {e['position']}, slot "
            f"{e['slot']}: expected token {e['expected_token']}, found {e['found']}"), None)])
    for w in s["warnings"]:
        notes.append([("warning:", "yellow"), (" " + safe(w), None)])
    return notes


def decoding_text(r: ReplayResult) -> str:
    """How the replayed lines were decoded: by the worker's line scanner, or (why not) the checked decoder."""
    declined = sum(r.lines_declined.values())
    n = r.lines_scanned
    text = f"{n} line{'' if n == 1 else 's'} scanned straight into the worker's arrays, {declined} decoded"
    if declined:
        text += " (" + "; ".join(f"{n}: {safe(why)}" for why, n in sorted(r.lines_declined.items(),
                                                                            key=lambda x: -x[1])) + ")"
    return text


def _phase_spec(r: ReplayResult) -> TableSpec:
    """The phase table. Phase names are never truncated (no_wrap): at 80 columns every column fits without
    borders."""
    spec = TableSpec("time per measured step (us)", "mappings = the four mapping phases; step = all phases")
    for col in ("phase", "mean", "p50", "p90", "p99", "min", "max", "total ms", "share"):
        if col == "phase":
            spec.add_column(col, "left", no_wrap=True, min_width=len("prepare_inputs"))
        else:
            spec.add_column(col, "right")
    for st in phase_stats(r):
        spec.add_row(st.name, f"{st.mean_us:.1f}", f"{st.p50_us:.1f}", f"{st.p90_us:.1f}", f"{st.p99_us:.1f}",
                     f"{st.min_us:.1f}", f"{st.max_us:.1f}", f"{st.total_ms:.2f}",
                     "" if st.name == "step" else f"{st.share:.0%}",
                     style="bold" if st.name in ("mappings", "step") else None, end_section=st.name == r.phases[-1])
    return spec


def _device_table(r: ReplayResult, console: Console) -> Table:
    dev = r.device_phase_ns[r.warmup :]
    dt = fit_table(console, "device time per measured step (us)", f"CUDA events on {safe(r.device)}; queueing "
                   "included")
    for col in ("phase", "mean", "p50", "p90", "p99", "max"):
        dt.add_column(col, justify="left" if col == "phase" else "right", no_wrap=col == "phase")
    for i, p in enumerate(r.phases):
        us = dev[:, i] / 1e3
        p50, p90, p99 = percentiles(us, (50, 90, 99)) if len(us) else (0, 0, 0)
        dt.add_row(p, f"{us.mean() if len(us) else 0:.1f}", f"{p50:.1f}", f"{p90:.1f}", f"{p99:.1f}",
                   f"{us.max() if len(us) else 0:.1f}")
    return dt


def to_csv(r: ReplayResult) -> str:
    """One row per measured-or-warm-up step and phase."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["step", "warmup", "num_reqs", "num_tokens", "phase", "ns"])
    for i, (step, nr, nt, row) in enumerate(zip(r.steps.tolist(), r.num_reqs.tolist(), r.num_tokens.tolist(),
                                                 r.phase_ns.tolist())):
        for p, ns in zip(r.phases, row):
            w.writerow([step, int(i < r.warmup), nr, nt, p, ns])
    return buf.getvalue()


def to_chrome_trace(r: ReplayResult) -> dict:
    """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): a step track and one track per phase."""
    events: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": f"kvmap {r.backend}"}},
                          {"ph": "M", "pid": 1, "tid": 0, "name": "thread_name", "args": {"name": "step"}}]
    for t, p in enumerate(r.phases, start=1):
        events.append({"ph": "M", "pid": 1, "tid": t, "name": "thread_name", "args": {"name": p}})
        events.append({"ph": "M", "pid": 1, "tid": t, "name": "thread_sort_index", "args": {"sort_index": t}})
    for step, start, nr, nt, row in zip(r.steps.tolist(), r.step_start_ns.tolist(), r.num_reqs.tolist(),
                                        r.num_tokens.tolist(), r.phase_ns.tolist()):
        total = sum(row)
        events.append({"ph": "X", "pid": 1, "tid": 0, "name": "execute_model", "ts": start / 1e3,
                       "dur": total / 1e3, "args": {"step": step, "num_reqs": nr, "num_tokens": nt}})
        t0 = start
        for t, (p, ns) in enumerate(zip(r.phases, row), start=1):
            events.append({"ph": "X", "pid": 1, "tid": t, "name": p, "ts": t0 / 1e3, "dur": ns / 1e3,
                           "args": {"step": step}})
            t0 += ns
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"trace": r.trace, "backend": r.backend}}


def render_profile(r: ReplayResult, ranges: list, console: Console, report_path) -> None:
    """nsys's NVTX ranges per phase beside kvmap's own timings of the same steps."""
    from rich.text import Text

    by = {x.name: x for x in ranges}
    own = {s.name: s for s in phase_stats(r)}
    table = fit_table(console, Text(f"NVTX ranges in {safe(str(report_path))} vs kvmap's timings (us)"))
    for col in ("range", "nsys count", "nsys median", "nsys mean", "kvmap count", "kvmap median", "kvmap mean"):
        table.add_column(col, justify="left" if col == "range" else "right", no_wrap=col == "range")
    n = len(r.measured())
    for name in ["execute_model", *r.phases]:
        x = by.get(name)
        k = own.get("step" if name == "execute_model" else name)
        table.add_row(name, str(x.instances) if x else "missing", f"{x.median_ns / 1e3:.1f}" if x else "",
                      f"{x.mean_ns / 1e3:.1f}" if x else "", str(n), f"{k.p50_us:.1f}" if k else "",
                      f"{k.mean_us:.1f}" if k else "")
    console.print(table)
    first = int(r.measured_steps()[0]) if n else 0
    before = (f"steps 0..{first - 1} replayed first, outside the capture, {_span(r.warmup_steps())} of them as "
              "timed warm-up" if first else
              f"warm-up 0..{r.prewarm_steps - 1} replayed first by a throwaway worker, outside the capture"
              if r.prewarm_steps else "nothing replayed before them")
    say(console, f"steps {_span(r.measured_steps())} captured; {before}; nsys ranges include the NVTX calls "
                 "themselves")
