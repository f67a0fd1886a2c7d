"""A replay's HTML report (`kvmap replay --html`, `kvmap report --html`): the summary, warnings and engine header
as tables, and five figures drawn in the browser by uPlot from the run data embedded in the page.

Rules: one source: every table cell and every figure's values come from `summary_dict` (the `--json` summary)
and the result's arrays (the `--json` result), through series.py; nothing is measured here. Table cells carry
their key and exact value (page.py `num`). The page is self-contained (page.py).
"""

from __future__ import annotations

import json

from kvmap.render.html.page import esc, num, page, table
from kvmap.render.html.series import MAX_POINTS, figure_data
from kvmap.render.report import percentile_name, summary_dict
from kvmap.run.result import ReplayResult
from kvmap.run.stats import steps_text

FIGURES = (
    ("time", "Time per step", "Each step's phases stacked (hover for a step's numbers). Grey: warm-up steps (not "
     "counted); red rings: steps slower than their scheduled tokens and requests explain (the slow-step warning)."),
    ("cost-tokens", "Step time against scheduled tokens", "Every measured step, with the least-squares line "
     "fixed cost + cost per token; pick a phase. The table below gives every phase's fit."),
    ("cost-reqs", "Step time against scheduled requests", "The same steps against the number of requests."),
    ("mix", "Batch composition", "Prefill, decode and draft tokens per step (left axis); requests and what happened "
     "to them: new, resumed, preempted, finished (right axis)."),
    ("kv-blocks", "KV cache blocks", "Per group: blocks in use, of them shared by several requests (prefix "
     "caching), and the pool's free blocks."),
    ("kv-eff", "KV memory efficiency", "Tokens held / memory reserved: paged (blocks in use x block_size; per DCP "
     "rank when several) beside contiguous allocation, every live request reserving max_model_len or its final "
     "length."),
)


def report_html(r: ReplayResult) -> str:
    """The report page for `r`."""
    s = summary_dict(r)
    data = figure_data(r, s)
    name = r.trace.replace("\\", "/").rsplit("/", 1)[-1]
    parts = [f'<h1 title="{esc(r.trace)}">kvmap replay: {esc(name)}</h1>',
             f'<p class="sub">{esc(r.backend)} backend, {esc(r.protocol)} protocol; '
             f"{esc(steps_text(r))}</p>",
             _summary_block(r, s), _warnings(s)]
    for fid, title, caption in FIGURES:
        if fid == "mix" and data["mix"] is None or fid.startswith("kv") and data["kv"] is None:
            continue
        picker = ('<label>phase <select></select></label>' if fid.startswith("cost") else
                  '<label><input type="checkbox" class="clip"> y axis up to 1.5 x the 99th percentile step '
                  "(slower steps ringed at the top)</label>" if fid == "time" else "")
        parts.append(f'<h2>{esc(title)}</h2><figure data-fig="{fid}">{picker}<div class="plot"></div>'
                     f"<figcaption>{esc(caption)}</figcaption></figure>")
        if fid == "time":
            parts.append(_slow_table(data))
        if fid == "cost-reqs":
            parts.append(_cost_table(s))
        if fid == "kv-eff" and s.get("kv_memory"):
            parts.append(_memory_table(s["kv_memory"]))
    parts += [_phase_table(r, s), _engine_block(r)]
    if data["downsampled"]:
        parts.insert(2, f'<p class="note">{len(r.steps):,} steps: the per-step figures show each run of steps\' '
                        f"minimum and maximum (past {MAX_POINTS:,} steps).</p>")
    return page(f"kvmap: {r.trace}", "".join(parts), scripts=["report.js"], data=data, with_plots=True)


def _summary_block(r: ReplayResult, s: dict) -> str:
    rows = [("requests", num("requests", s["requests"])), ("tokens", num("tokens_scheduled", s["tokens_scheduled"])),
            ("tokens per step", num("mean_tokens_per_step", s["mean_tokens_per_step"])),
            ("requests per step", num("mean_reqs_per_step", s["mean_reqs_per_step"])),
            ("steps/s", num("steps_per_s", s["steps_per_s"], f"{s['steps_per_s']:,.0f}")),
            ("tokens/s", num("tokens_per_s", s["tokens_per_s"], f"{s['tokens_per_s']:,.0f}")),
            ("time of the measured steps, s", num("time_s", s["time_s"], f"{s['time_s']:.4f}"))]
    head = "".join(f"<th>{esc(k)}</th>" for k, _ in rows)
    return (f'<table class="summary"><caption>summary (measured steps)</caption><thead><tr>{head}</tr></thead>'
            f"<tbody><tr>{''.join(v for _, v in rows)}</tr></tbody></table>")


def _warnings(s: dict) -> str:
    if not s["warnings"]:
        return '<p class="note">no warnings</p>'
    return '<ul class="warn">' + "".join(f"<li>{esc(w)}</li>" for w in s["warnings"]) + "</ul>"


def _phase_table(r: ReplayResult, s: dict) -> str:
    qs = [f"{percentile_name(q)}_us" for q in r.percentiles]
    keys = ["mean_us", *qs, "min_us", "max_us", "total_ms", "share"]
    rows = []
    for name, st in s["phases"].items():
        cells = "".join(num(f"phases/{name}/{k}", st[k], f"{st[k]:.0%}" if k == "share" else
                            f"{st[k]:,.2f}" if k == "total_ms" else None) for k in keys)
        cls = ' class="total"' if name in ("mappings", "step") else ""
        rows.append(f"<tr{cls}><th>{esc(name)}</th>{cells}</tr>")
    head = ["phase", "mean", *[percentile_name(q) for q in r.percentiles], "min", "max", "total ms", "share"]
    return "<h2>Phases</h2>" + table("time per measured step (us); mappings = the four mapping phases; step = all "
                                     "phases", head, rows)


def _cost_table(s: dict) -> str:
    rows = []
    for name, c in s["cost"]["phases"].items():
        cells = (num(f"cost/phases/{name}/fixed_us", c["fixed_us"], f"{c['fixed_us']:.2f}")
                 + num(f"cost/phases/{name}/per_token_us", c["per_token_us"], f"{c['per_token_us']:.4f}")
                 + num(f"cost/phases/{name}/r2_tokens", c["r2_tokens"], _r2(c["r2_tokens"]))
                 + num(f"cost/phases/{name}/per_request_us", c["per_request_us"], f"{c['per_request_us']:.3f}")
                 + num(f"cost/phases/{name}/r2_reqs", c["r2_reqs"], _r2(c["r2_reqs"]))
                 + num(f"cost/phases/{name}/left_out", c["left_out"]))
        rows.append(f"<tr><th>{esc(name)}</th>{cells}</tr>")
    return table("cost per step (least squares over the measured steps; steps over 10x the phase's median left "
                 "out)", ["phase", "fixed us", "us per token", "r2", "us per request", "r2", "left out"], rows)


def _r2(v) -> str | None:
    return None if v is None else f"{v:.2f}"


def _memory_table(mem: dict) -> str:
    rows = []
    for name, e in mem["efficiency"].items():
        cells = "".join(num(f"kv_memory/efficiency/{name}/{k}", e[k], None if e[k] is None else f"{e[k]:.1%}")
                        for k in ("mean", "p5", "min"))
        rows.append(f"<tr><th>{esc(name)}</th>{cells}{num(f'kv_memory/efficiency/{name}/steps', e['steps'])}</tr>")
    return table("memory efficiency over the measured steps holding KV (tokens held / memory reserved)",
                 ["allocation", "mean", "p5", "min", "steps"], rows)


def _slow_table(data: dict) -> str:
    slow = data["slow"]
    if not slow["steps"]:
        return '<p class="note">no step slower than its scheduled tokens and requests explain</p>'
    pairs = sorted(zip(slow["us"], slow["steps"]), reverse=True)[:10]
    rows = [f"<tr>{num('slow/steps', st)}{num('slow/us', us)}</tr>" for us, st in pairs]
    return table(f"slowest of the {len(slow['steps'])} slow steps (work phases, read_step apart)",
                 ["step", "us"], rows)


def _engine_block(r: ReplayResult) -> str:
    e = dict(r.engine)
    if not e:
        return ""
    text = json.dumps(e, indent=1, sort_keys=True)
    return f'<h2>Engine (the trace header)</h2><pre class="header">{esc(text)}</pre>'
