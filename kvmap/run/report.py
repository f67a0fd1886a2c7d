"""Renderers: turn a `ReplayResult` into a Rich summary, JSON, CSV, a Chrome trace, or a comparison.

Rules: renderers only read results; nothing here measures. Statistics are computed over the measured steps
(warm-up excluded). Outliers use the MAD-based modified z-score (as hyperfine does) with threshold 14; the
noise warning fires when the median absolute deviation of step time exceeds 25% of the median.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.table import Table

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


def _stats(name: str, ns: np.ndarray, step_total_ns: float) -> PhaseStats:
    if not len(ns):
        return PhaseStats(name, *([0.0] * 8))
    us = ns / 1e3
    p50, p90, p99 = np.percentile(us, [50, 90, 99])
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


def warnings(r: ReplayResult) -> list[str]:
    out = []
    m = r.measured()
    if len(m) < 10:
        out.append(f"only {len(m)} measured steps: statistics are rough; replay a longer trace or window")
    if len(m) >= 3:
        total = m.sum(axis=1).astype(np.float64)
        med = float(np.median(total))
        mad = float(np.median(np.abs(total - med)))
        if med and mad / med > NOISE_MAD:
            out.append(f"noisy timings: the median absolute deviation is {mad / med:.0%} of the median step "
                       "time; close other work or compare medians of several runs")
        if mad:
            z = 0.6745 * (total - med) / mad
            outliers = np.flatnonzero(z > OUTLIER_Z)
            if len(outliers):
                worst = int(outliers[np.argmax(total[outliers])])
                step = int(r.steps[r.warmup + worst])
                out.append(f"{len(outliers)} outlier step(s), the worst step {step} at {total[worst] / 1e3:.0f} us "
                           f"vs a median of {med / 1e3:.0f} us (first-touch or a busy machine: raise --warmup "
                           "or replay again)")
    if r.standin_tokens:
        out.append(f"{r.standin_tokens} input ids are stand-ins: the trace does not record sampled_token_ids")
    return out


def summary_dict(r: ReplayResult) -> dict:
    reqs, toks = r.measured_counts()
    m = r.measured()
    total_s = float(m.sum()) / 1e9
    return {
        "trace": r.trace,
        "backend": r.backend,
        "steps_replayed": r.steps_replayed,
        "steps_measured": int(len(m)),
        "warmup": r.warmup,
        "requests": r.requests_seen,
        "tokens_scheduled": r.tokens_scheduled,
        "mean_reqs_per_step": float(reqs.mean()) if len(reqs) else 0.0,
        "mean_tokens_per_step": float(toks.mean()) if len(toks) else 0.0,
        "steps_per_s": len(m) / total_s if total_s else 0.0,
        "tokens_per_s": float(toks.sum()) / total_s if total_s else 0.0,
        "device": r.device,
        "h2d_bytes_per_step": r.h2d_bytes / max(r.steps_replayed, 1),
        "device_phases_p50_us": ({p: float(np.median(r.device_phase_ns[r.warmup:, i])) / 1e3
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
    d = rank_dict(r)
    line = (f"DCP {r.cp_size} (interleave {r.interleave}), TP {r.tp_size}, "
            + (f"{r.world_size} processes" if r.world_size > 1 else
               "every rank in this process" if len(r.ranks) == r.cp_size else
               f"rank {', '.join(map(str, r.ranks))} of {r.cp_size} in this process"))
    if r.kernel_block_sizes:
        line += ", kernel blocks " + "/".join(map(str, r.kernel_block_sizes))
    console.print(f"[bold]ranks[/]  {line}")
    if not d["per_rank"]:
        return
    t = Table(title="per DCP rank", title_justify="left")
    cols = ["rank", "local tokens", "max local seq_len", "KV shard KiB", "KV read back", "mismatches"]
    dist = bool(r.rank_broadcast_p50_ns)
    for col in cols + (["broadcast p50 us"] if dist else []):
        t.add_column(col, justify="right")
    for x in d["per_rank"]:
        t.add_row(str(x["rank"]), f"{x['local_tokens']:,}" if x["local_tokens"] is not None else "",
                  str(x["max_local_seq_len"] or ""), f"{x['kv_bytes'] / 2**10:,.1f}" if x["kv_bytes"] else "",
                  f"{x['kv_checked']:,}" if x["kv_checked"] is not None else "",
                  str(x["kv_mismatches"]) if x["kv_mismatches"] is not None else "",
                  *([f"{x['broadcast_p50_us']:.0f}" if x["broadcast_p50_us"] is not None else ""] if dist else []))
    console.print(t)


def render_summary(r: ReplayResult, console: Console) -> None:
    s = summary_dict(r)
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("trace", f"{r.trace}  ({r.protocol} protocol, "
                 + ", ".join(f"{g['kind']} bs={g['block_size']}"
                             + (f" window={g['sliding_window']}" if g.get("sliding_window") else "")
                             for g in r.groups) + ")")
    head.add_row("backend", r.backend)
    window = r.step_window
    head.add_row("steps", f"{s['steps_replayed']} replayed, {s['steps_measured']} measured"
                 + (f" (window {window[0]}:{window[1] if window[1] is not None else ''})"
                    if window[0] or window[1] is not None else "")
                 + f", first {r.warmup} excluded as warm-up")
    head.add_row("requests", str(s["requests"]))
    head.add_row("tokens", f"{s['tokens_scheduled']} scheduled, {s['mean_tokens_per_step']:.1f} per step, "
                 f"{s['mean_reqs_per_step']:.1f} requests per step")
    head.add_row("throughput", f"{s['steps_per_s']:,.0f} steps/s, {s['tokens_per_s']:,.0f} tokens/s")
    if r.kv_bytes:
        g = r.kv_geometry
        head.add_row("KV cache", f"{r.kv_bytes / 2**20:.1f} MiB ({g.get('num_kv_heads')} heads x "
                     f"{g.get('head_size')} x {g.get('dtype')} per token, K and V, per group)")
    if r.kv_verified:
        verdict = "[green]0 mismatches[/]" if not r.kv_mismatches else f"[red]{r.kv_mismatches} mismatches[/]"
        head.add_row("KV verify", f"{r.kv_checked:,} positions read back, {verdict}")
    console.print(head)
    if r.cp_size > 1 or r.kernel_block_sizes or r.world_size > 1:
        render_ranks(r, console)
    table = Table(title="time per step (us)", title_justify="left")
    for col in ("phase", "mean", "p50", "p90", "p99", "min", "max", "total ms", "share"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for st in phase_stats(r):
        style = "bold" if st.name in ("mappings", "step") else None
        table.add_row(st.name, f"{st.mean_us:.1f}", f"{st.p50_us:.1f}", f"{st.p90_us:.1f}", f"{st.p99_us:.1f}",
                      f"{st.min_us:.1f}", f"{st.max_us:.1f}", f"{st.total_ms:.2f}",
                      "" if st.name == "step" else f"{st.share:.0%}", style=style,
                      end_section=st.name == r.phases[-1])
    console.print(table)
    if r.device_phase_ns.size:
        dev = r.device_phase_ns[r.warmup :]
        dt = Table(title=f"device time per step on {r.device} (us, CUDA events; queueing included)",
                   title_justify="left")
        for col in ("phase", "mean", "p50", "p90", "p99", "max"):
            dt.add_column(col, justify="left" if col == "phase" else "right")
        for i, p in enumerate(r.phases):
            us = dev[:, i] / 1e3
            p50, p90, p99 = np.percentile(us, [50, 90, 99]) if len(us) else (0, 0, 0)
            dt.add_row(p, f"{us.mean() if len(us) else 0:.1f}", f"{p50:.1f}", f"{p90:.1f}", f"{p99:.1f}",
                       f"{us.max() if len(us) else 0:.1f}")
        console.print(dt)
    if r.h2d_bytes:
        per_step = r.h2d_bytes / max(r.steps_replayed, 1)
        console.print(f"host-to-device: {per_step:,.0f} bytes per step in one staged copy")
    for e in r.kv_examples[:5]:
        console.print(f"[red]KV mismatch[/] step {e['step']}, request {e['req_id']!r}, "
                      + (f"rank {e.get('rank', 0)}, " if r.cp_size > 1 else "") + f"group {e['group']}, "
                      f"position {e['position']}, slot {e['slot']}: expected token {e['expected_token']}, "
                      f"found {e['found']}")
    for w in s["warnings"]:
        console.print(f"[yellow]warning:[/] {w}")


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


def compare_dict(a: ReplayResult, b: ReplayResult) -> dict:
    sa = {s.name: s for s in phase_stats(a)}
    sb = {s.name: s for s in phase_stats(b)}
    rows = {}
    for name in [n for n in sa if n in sb]:
        x, y = sa[name], sb[name]
        rows[name] = {"a_p50_us": x.p50_us, "b_p50_us": y.p50_us,
                      "ratio_p50": (y.p50_us / x.p50_us) if x.p50_us else None,
                      "a_mean_us": x.mean_us, "b_mean_us": y.mean_us,
                      "ratio_mean": (y.mean_us / x.mean_us) if x.mean_us else None}
    return {"a": {"trace": a.trace, "backend": a.backend, "machine": a.machine},
            "b": {"trace": b.trace, "backend": b.backend, "machine": b.machine}, "phases": rows}


def render_compare(a: ReplayResult, b: ReplayResult, console: Console, names: tuple[str, str]) -> None:
    d = compare_dict(a, b)
    table = Table(title=f"B / A per phase (A = {names[0]}, B = {names[1]}; below 1.00 means B is faster)",
                  title_justify="left")
    for col in ("phase", "A p50 us", "B p50 us", "B/A p50", "A mean us", "B mean us", "B/A mean"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for name, row in d["phases"].items():
        def fmt(x):
            return "n/a" if x is None else f"{x:.2f}"
        table.add_row(name, f"{row['a_p50_us']:.1f}", f"{row['b_p50_us']:.1f}", fmt(row["ratio_p50"]),
                      f"{row['a_mean_us']:.1f}", f"{row['b_mean_us']:.1f}", fmt(row["ratio_mean"]),
                      style="bold" if name in ("mappings", "step") else None)
    console.print(table)
    if a.trace != b.trace:
        console.print(f"[yellow]note:[/] different traces ({a.trace} vs {b.trace}): ratios compare unlike work")


def render_profile(r: ReplayResult, ranges: list, console: Console, report_path) -> None:
    """nsys's NVTX ranges per phase beside kvmap's own timings of the same steps."""
    by = {x.name: x for x in ranges}
    own = {s.name: s for s in phase_stats(r)}
    table = Table(title=f"NVTX ranges in {report_path} vs kvmap's timings (us)", title_justify="left")
    for col in ("range", "nsys count", "nsys median", "nsys mean", "kvmap count", "kvmap median", "kvmap mean"):
        table.add_column(col, justify="left" if col == "range" else "right")
    n = len(r.measured())
    for name in ["execute_model", *r.phases]:
        x = by.get(name)
        k = own.get("step" if name == "execute_model" else name)
        table.add_row(name, str(x.instances) if x else "missing", f"{x.median_ns / 1e3:.1f}" if x else "",
                      f"{x.mean_ns / 1e3:.1f}" if x else "", str(n), f"{k.p50_us:.1f}" if k else "",
                      f"{k.mean_us:.1f}" if k else "")
    console.print(table)
    console.print(f"steps {int(r.steps[r.warmup]) if n else '-'}..{int(r.steps[-1]) if n else '-'} captured "
                  f"({r.warmup} warm-up steps replayed first, outside the capture); nsys ranges include the "
                  "NVTX calls themselves")
