"""Rich rendering of `kvmap explain`'s data (explain.py): tables for the step, a tree for the token chain.

Rules: request ids and file names are shown as plain text with control characters escaped (never as markup);
key columns (req_id, origin) never wrap or truncate: at 80 columns the table drops its borders and the number
columns give way; messages are not wrapped when piped.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table  # noqa: F401  (the type of _order_table)
from rich.text import Text
from rich.tree import Tree

from kvmap.explain.build import NULLED
from kvmap.render.text import fit_table, safe, say

STATE_MARK = {"written this step": "*", "read": "", "allocated ahead": "+", "null": "",
              "out of window (stale: never read or written again)": "~", NULLED: "~0"}
STATE_STYLE = {"written this step": "bold green", "read": "", "allocated ahead": "dim",
               "null": "magenta", "out of window (stale: never read or written again)": "yellow", NULLED: "yellow"}


ORDER_COLUMNS = ("sched", "req_id", "tokens", "origin", "->", "batch", "row", "computed", "flat", "seq_len")


def _order_table(d: dict, console: Console) -> Table:
    t = fit_table(console, "scheduler order -> batch order", "sched: scheduler order; batch: batch_idx; row: "
                  "idx_mapping[batch] (the request-state row); flat: the flat token range")
    for col in ORDER_COLUMNS:
        key = col in ("req_id", "origin", "->")
        t.add_column("" if col == "->" else col, justify="left" if key else "right", no_wrap=key,
                     overflow="fold", min_width=len(col))
    by_id = {x["req_id"]: x for x in d["batch"]}
    for i, s in enumerate(d["scheduler_order"]):
        x = by_id[s["req_id"]]
        t.add_row(str(i), Text(safe(s["req_id"])), str(s["num_scheduled_tokens"]), Text(s["origin"]), "->",
                  str(x["batch_idx"]), str(x["row"]), str(x["num_computed_tokens"]),
                  f"{x['tokens'][0]}..{x['tokens'][1] - 1}", str(x["seq_len"]))
    return t


def _forward(f: dict | None, console: Console) -> None:
    """The forward-pass section: the runner, the sampler indices and each request's arithmetic, one message a
    line starting `forward:` (never wrapped when piped, so grep finds each whole)."""
    if not f:
        return
    console.print()
    say(console, f"forward: {f['runner']} runner, cudagraph mode {f['cudagraph_mode']}; sampler indices", style="bold")
    for key, value in f["sampler"].items():
        if key not in ("rows", "stale_input_ids"):
            say(console, f"forward: {key} {value}")
    for line in f["sampler"]["rows"]:
        say(console, f"forward: {safe(line)}")
    if f["sampler"].get("stale_input_ids"):
        say(console, f"forward: flat tokens MRV2 would read stale input ids at: {f['sampler']['stale_input_ids']}",
            style="yellow")
    p = f.get("padding")
    if p:
        say(console, f"forward: padded shape: {p['cudagraph_mode']}, num_tokens_padded {p['num_tokens_padded']} "
                     f"(of {p['num_tokens']}), num_reqs_padded {p['num_reqs_padded']} (of {p['num_reqs']})",
            style="bold")
        for line in p["why"]:
            say(console, f"forward: {line}")
    for item in f.get("split", []):
        say(console, f"forward: split: {safe(item['line'])}")
    for fi in f.get("flashinfer", []):
        say(console, f"forward: FlashInfer group {fi['group']} (page size {fi['page_size']}): paged_kv_indptr "
                     f"{fi['paged_kv_indptr']}, paged_kv_last_page_len {fi['paged_kv_last_page_len']}", style="bold")
        for line in fi["rows"]:
            say(console, f"forward: {safe(line)}")
        for key in ("prefill_plan", "decode_plan"):
            if key in fi:
                say(console, f"forward: {key.replace('_', ' ')}: " + ", ".join(f"{k} {v}" for k, v in fi[key].items()))
    for line in f["skipped"]:
        say(console, f"forward: skipped: {line}", style="dim")


def render_explain(d: dict, console: Console) -> None:
    say(console, f"step {d['step']} of {d['trace']} (line {d['line']}, {d['protocol']} protocol): "
                 f"{len(d['batch'])} requests, {d['num_tokens']} tokens", style="bold")
    ch = d["changes"]
    for label, key in (("finished", "finished"), ("preempted", "preempted"), ("added", "added"),
                       ("resumed", "resumed")):
        if ch[key]:
            say(console, f"  {label}: {', '.join(ch[key])}")
    for r, c in ch.get("continued", {}).items():
        say(console, f"  continued session {safe(r)}: {c['held_tokens']} tokens held (the last sampled one is "
                     f"dropped) -> a prompt of {c['prompt_len']}, {c['num_computed_tokens']} of them cached; blocks "
                     + "; ".join(f"group {g}: {old} -> {new}" for g, (old, new) in enumerate(c["blocks"])))
    for r, what in ch["blocks"].items():
        for verb, lists in what.items():
            say(console, f"  blocks {verb} for {r}: " + "; ".join(f"group {g}: {ids}" for g, ids in enumerate(lists)))
    console.print(_order_table(d, console))
    say(console, f"idx_mapping     {d['idx_mapping']}   (batch_idx -> req_state_idx)")
    say(console, f"query_start_loc {d['query_start_loc']}")
    say(console, f"seq_lens        {d['seq_lens']}")
    _forward(d.get("forward"), console)
    req = d.get("request")
    if req:
        console.print()
        say(console, f"request {req['req_id']!r} ({req['origin']}): row {req['row']}, batch {req['batch_idx']}, "
                     f"flat tokens {req['tokens'][0]}..{req['tokens'][1] - 1}, positions "
                     f"{req['positions'][0]}..{req['positions'][1] - 1}"
                     + (f" ({req['num_draft_tokens']} drafts)" if req["num_draft_tokens"] else ""), style="bold")
        for bt in req["block_tables"]:
            row = Text(f"  group {bt['group']} ({bt['kind']}, block {bt['block_size']}): ")
            for e in bt["entries"]:
                label = "null" if e["state"] == "null" else f"{e['block']}{STATE_MARK.get(e['state'], '')}"
                row.append(f"[{e['logical_block']}]{label} ", style=STATE_STYLE.get(e["state"], ""))
            console.print(row)
            if "null_history" in bt:
                say(console, f"    {bt['null_history']}")
        states = sorted({e["state"] for bt in req["block_tables"] for e in bt["entries"]})
        legend = Text("  legend: ")
        for s in states:
            mark = STATE_MARK.get(s, "")
            legend.append(f"{mark} {s}" if mark else ("null = null block (id 0)" if s == "null" else "read"),
                          style=STATE_STYLE.get(s, ""))
            legend.append("   ")
        console.print(legend)
    tok = d.get("token")
    if tok:
        tree = Tree(Text(safe(f"token {tok['token']} of {req['req_id']!r}: input id {tok['input_id']}")
                         + (" (draft)" if tok["is_draft"] else ""), style="bold"))
        node = tree
        for link in tok["links"]:
            node = node.add(Text(safe(link)))
        for g in tok["groups"]:
            gn = node.add(Text(f"group {g['group']} ({g['kind']})", style="cyan"))
            for link in g["links"]:
                gn = gn.add(Text(safe(link), style="bold green" if link.startswith("slot") else ""))
            for rk in g.get("ranks", []):
                rn = gn.add(Text(f"rank {rk['rank']}: " + (f"holds it, slot {rk['slot']}" if rk["holds"]
                                                           else f"does not hold it, slot {rk['slot']}"),
                                 style="bold green" if rk["holds"] else "dim"))
                for link in rk["links"]:
                    rn.add(Text(safe(link)))
        console.print(tree)
