"""The run's renderers: a `ReplayResult` as the replay's summary (Rich), as data (`summary_dict`, for
`--json`), CSV, a Chrome trace, and beside nsys's NVTX ranges (`kvmap profile`).

Rules: renderers only read results; nothing here measures. Every number is over the measured steps
(result.py's one definition, stated in the summary's `steps` line and in `--json`'s `scope`; the statistics
are run/stats.py's); rates divide by the sum of the measured steps' phase times, not wall time. Safe printing
lives in text.py (`safe`, `say`, `fit_table`) for every renderer: names and ids are never markup, control
characters are escaped, messages are not wrapped when piped, tables keep key columns whole at 80 columns.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from kvmap.jsontext import Stream
from kvmap.ondisk import release
from kvmap.render.text import fit_table, safe, say
from kvmap.run.costfit import cost_dict
from kvmap.run.kvstats import memory_dict
from kvmap.run.result import ReplayResult
from kvmap.run.provenance import csv_header, provenance_lines
from kvmap.run.runs import runs_stats
from kvmap.run.stats import (median, percentiles, phase_percentiles, phase_stats, step_span, steps_text, total_ns,
                              warnings)

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console
    from rich.table import Table


def _span_list(steps: np.ndarray) -> list[int] | None:
    return [int(steps[0]), int(steps[-1])] if len(steps) else None


def summary_dict(r: ReplayResult) -> dict:
    """The summary as data. Every count, mean and rate is over the measured steps (`scope`)."""
    reqs, toks = r.measured_counts()
    m = r.measured()
    n = int(len(m))
    total_s = float(total_ns(m)) / 1e9
    h2d = r.h2d_bytes_measured if r.h2d_bytes_measured is not None else r.h2d_bytes
    out = {
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
        "device": r.device,
        "h2d_bytes_per_step": h2d / max(n, 1),
        "device_phases_p50_us": ({p: median(r.device_phase_ns[r.warmup:, i]) / 1e3
                                  for i, p in enumerate(r.phases)} if r.device_phase_ns.size else None),
        "kv": {"bytes": r.kv_bytes, "geometry": r.kv_geometry, "verified": r.kv_verified,
               "checked": r.kv_checked, "mismatches": r.kv_mismatches},
        "phases": _phases_dict(r),
        "cost": cost_dict(r),
        **({"kv_memory": memory_dict(r)} if r.kv_memory else {}),
        **({"runs": runs_dict(r)} if r.runs_p50_us else {}),
        "warnings": warnings(r),
        **({"ranks": rank_dict(r)} if r.cp_size > 1 or r.kernel_block_sizes or r.world_size > 1 else {}),
    }
    release(r.phase_ns)  # on disk: whatever a statistic left in (ondisk.py)
    return out


def percentile_name(q: float) -> str:
    """`p50`, `p99.9`, `p99.99999`: a percentile's column and key, every digit kept (the shortest repr), so that
    two different percentiles never share a name."""
    return f"p{int(q)}" if float(q).is_integer() else f"p{float(q)!r}"


def _phases_dict(r: ReplayResult) -> dict:
    """Per phase (then mappings, step): mean, the run's percentiles (`--percentiles`), min, max, total, share."""
    qs = phase_percentiles(r, r.percentiles)
    return {s.name: {"mean_us": s.mean_us, **{f"{percentile_name(q)}_us": v for q, v in zip(r.percentiles, qs[s.name])},
                     "min_us": s.min_us, "max_us": s.max_us, "total_ms": s.total_ms, "share": s.share}
            for s in phase_stats(r)}


def runs_dict(r: ReplayResult) -> dict:
    """`--runs N`: every run's per-phase medians and, per phase, their mean +- sigma (run/runs.py)."""
    return {"count": len(r.runs_p50_us), "scope": "per run, the median of its measured steps; mean and sample "
            "standard deviation over the runs; the per-step figures elsewhere are the last run's",
            "p50_us": r.runs_p50_us,
            "phases": {name: {"mean_us": x.mean, "sigma_us": x.sigma, "min_us": x.min, "max_us": x.max}
                       for name, x in runs_stats(r).items()}}


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


def render_summary(r: ReplayResult, console: Console, produced_by: bool = False) -> None:
    """The summary: what produced the run (`produced_by`: `kvmap report`), its lines, the per-rank tables
    (multi-rank runs), the phase table, the runs' table (`--runs N`), the device table (CUDA events), its notes."""
    from rich.text import Text

    s = summary_dict(r)
    if produced_by:
        for key, text in provenance_lines(r.provenance):
            say(console, Text.assemble((f"{key:<12}", "bold"), safe(text)))
    for parts in _summary_lines(r, s):
        say(console, Text.assemble(*parts))
    if r.cp_size > 1 or r.kernel_block_sizes or r.world_size > 1:
        render_ranks(r, console)
    console.print(_phase_table(r, console))
    if r.runs_p50_us:
        console.print(_runs_table(r, console))
    if r.device_phase_ns.size:
        console.print(_device_table(r, console))
    for parts in _summary_notes(r, s):
        say(console, Text.assemble(*parts))


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
    if r.kv_bytes:
        g = r.kv_geometry
        head.append(("KV cache", f"{r.kv_bytes / 2**20:.1f} MiB ({g.get('num_kv_heads')} heads x "
                                 f"{g.get('head_size')} x {g.get('dtype')} per token, K and V, per group)"))
    mem = memory_dict(r)
    if mem:
        head.append(("KV memory", memory_text(mem)))
    if r.runs_p50_us:
        head.insert(3, ("runs", f"{len(r.runs_p50_us)}, each with a fresh worker and KV cache in this process; "
                                "the table of runs is over their medians, every other figure is the last run's"))
    lines = [[(f"{key:<12}", "bold"), (value, None)] for key, value in head]
    if r.kv_verified:
        verdict = ("0 mismatches", "green") if not r.kv_mismatches else (f"{r.kv_mismatches} mismatches", "red")
        lines.append([(f"{'KV verify':<12}", "bold"), (f"{r.kv_checked:,} positions read back over all "
                                                       f"{r.steps_replayed} replayed steps, ", None), verdict])
    return lines


def memory_text(mem: dict) -> str:
    """The summary's `KV memory` line: paged efficiency per group beside contiguous allocation (mean, p5, min)."""
    def fig(x: dict) -> str:
        return "n/a" if x["mean"] is None else f"{x['mean']:.1%} (p5 {x['p5']:.1%}, min {x['min']:.1%})"

    eff = mem["efficiency"]
    paged = "; ".join(f"{k} {fig(v)}" for k, v in eff.items() if k.startswith("g") and "." not in k)
    return (f"paged {paged}; contiguous, max_model_len each {fig(eff['contiguous_max_len'])}, final length each "
            f"{fig(eff['contiguous_final'])} (tokens held / memory reserved, measured steps)")


def mismatch_text(e: dict, cp_size: int) -> str:
    """One KV mismatch located: step, request, rank (DCP), group, position, slot, expected and found."""
    return (f"step {e['step']}, request {e['req_id']!r}, " + (f"rank {e.get('rank', 0)}, " if cp_size > 1 else "")
            + f"group {e['group']}, position {e['position']}, slot {e['slot']}: expected token "
            f"{e['expected_token']}, found {e['found']}")


def kv_failure_line(r: ReplayResult) -> str:
    """The one line a quiet run (no summary) prints when the KV read-back failed: how many, and the first."""
    first = f"; first: {mismatch_text(r.kv_examples[0], r.cp_size)}" if r.kv_examples else ""
    return safe(f"the KV read-back found {r.kv_mismatches:,} mismatch(es) in {r.kv_checked:,} positions{first}")


def _summary_notes(r: ReplayResult, s: dict) -> list[list[tuple[str, str | None]]]:
    """The summary's lines below its tables: the staged copy, located KV mismatches, warnings."""
    notes: list[list[tuple[str, str | None]]] = []
    if r.h2d_bytes:
        notes.append([(f"host-to-device: {s['h2d_bytes_per_step']:,.0f} bytes per measured step in one staged "
                       "copy", None)])
    for e in r.kv_examples[:5]:
        notes.append([("KV mismatch", "red"), (safe(" " + mismatch_text(e, r.cp_size)), None)])
    for w in s["warnings"]:
        notes.append([("warning:", "yellow"), (" " + safe(w), None)])
    return notes


def _phase_table(r: ReplayResult, console: Console) -> Table:
    """The phase table. Phase names are never truncated (no_wrap): at 80 columns every column fits without
    borders. Cells are `Text`: plain strings would go through markup and emoji parsing."""
    from rich.text import Text

    table = fit_table(console, "time per measured step (us)", "mappings = the four mapping phases; step = all phases")
    qcols = [percentile_name(q) for q in r.percentiles]
    for col in ("phase", "mean", *qcols, "min", "max", "total ms", "share"):
        if col == "phase":
            table.add_column(Text(col), justify="left", no_wrap=True, min_width=len("prepare_inputs"),
                             overflow="ellipsis")
        else:
            table.add_column(Text(col), justify="right", overflow="fold")
    qs = phase_percentiles(r, r.percentiles)
    for st in phase_stats(r):
        cells = (st.name, f"{st.mean_us:.1f}", *(f"{v:.1f}" for v in qs[st.name]),
                 f"{st.min_us:.1f}", f"{st.max_us:.1f}", f"{st.total_ms:.2f}",
                 "" if st.name == "step" else f"{st.share:.0%}")
        table.add_row(*map(Text, cells), style="bold" if st.name in ("mappings", "step") else None,
                      end_section=st.name == r.phases[-1])
    return table


def _runs_table(r: ReplayResult, console: Console) -> Table:
    """`--runs N`: per phase, the mean +- sigma of the runs' medians (hyperfine's form), their min and max."""
    from rich.text import Text

    n = len(r.runs_p50_us)
    table = fit_table(console, f"median per measured step over {n} runs", "sigma: sample standard deviation")
    for col in ("phase", "mean +- sigma", "min", "max", "sigma/mean"):
        table.add_column(Text(col), justify="left" if col == "phase" else "right", no_wrap=True)
    for name, x in runs_stats(r).items():
        k = 1 if x.mean >= 10 else 2  # decimals: a sigma of a few ns still shows
        table.add_row(*map(Text, (name, f"{x.mean:.{k}f} us +- {x.sigma:.{k}f}", f"{x.min:.{k}f} us",
                                  f"{x.max:.{k}f} us", f"{x.sigma / x.mean:.1%}" if x.mean else "")),
                      style="bold" if name in ("mappings", "step") else None, end_section=name == r.phases[-1])
    return table


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
    """What produced the run as `# key: value` comment lines (provenance.py `csv_header`), then one row per
    measured-or-warm-up step and phase."""
    buf = io.StringIO(csv_header(r.provenance))
    buf.seek(0, io.SEEK_END)
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["step", "warmup", "num_reqs", "num_tokens", "phase", "ns"])
    for i, (step, nr, nt, row) in enumerate(zip(r.steps.tolist(), r.num_reqs.tolist(), r.num_tokens.tolist(),
                                                 r.phase_ns.tolist())):
        for p, ns in zip(r.phases, row):
            w.writerow([step, int(i < r.warmup), nr, nt, p, ns])
    return buf.getvalue()


CHROME_STEPS = 256  # steps whose trace events are made (and turned into text) at once


def to_chrome_trace(r: ReplayResult, stream: bool = False) -> dict:
    """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): a step track and one track per phase.
    `stream`: the events as a `Stream` made `CHROME_STEPS` steps at a time as `files.write_json` writes them (the
    same bytes; a list of every event holds a dict per step and phase)."""
    parts = _chrome_events(r)
    return {"traceEvents": Stream(parts) if stream else [e for part in parts for e in part],
            "displayTimeUnit": "ns", "otherData": {"trace": r.trace, "backend": r.backend}}


def _chrome_events(r: ReplayResult) -> Iterator[list[dict]]:
    """The trace's events: the tracks' names, then `CHROME_STEPS` steps' events at a time."""
    events: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": f"kvmap {r.backend}"}},
                          {"ph": "M", "pid": 1, "tid": 0, "name": "thread_name", "args": {"name": "step"}}]
    for t, p in enumerate(r.phases, start=1):
        events.append({"ph": "M", "pid": 1, "tid": t, "name": "thread_name", "args": {"name": p}})
        events.append({"ph": "M", "pid": 1, "tid": t, "name": "thread_sort_index", "args": {"sort_index": t}})
    yield events
    for i in range(0, len(r.steps), CHROME_STEPS):
        events = []
        part = slice(i, i + CHROME_STEPS)
        for step, start, nr, nt, row in zip(r.steps[part].tolist(), r.step_start_ns[part].tolist(),
                                            r.num_reqs[part].tolist(), r.num_tokens[part].tolist(),
                                            r.phase_ns[part].tolist()):
            total = sum(row)
            events.append({"ph": "X", "pid": 1, "tid": 0, "name": "execute_model", "ts": start / 1e3,
                           "dur": total / 1e3, "args": {"step": step, "num_reqs": nr, "num_tokens": nt}})
            t0 = start
            for t, (p, ns) in enumerate(zip(r.phases, row), start=1):
                events.append({"ph": "X", "pid": 1, "tid": t, "name": p, "ts": t0 / 1e3, "dur": ns / 1e3,
                               "args": {"step": step}})
                t0 += ns
        release(r.step_start_ns)  # on disk: the part's pages go (ondisk.py)
        release(r.phase_ns)
        yield events


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
    before = (f"steps 0..{first - 1} replayed first, outside the capture, {step_span(r.warmup_steps())} of them "
              "as timed warm-up" if first else
              f"warm-up 0..{r.prewarm_steps - 1} replayed first by a throwaway worker, outside the capture"
              if r.prewarm_steps else "nothing replayed before them")
    say(console, f"steps {step_span(r.measured_steps())} captured; {before}; nsys ranges include the NVTX calls "
                 "themselves")
