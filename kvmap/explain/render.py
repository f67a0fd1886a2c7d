"""Rich rendering of `kvmap explain`'s data (explain.py): tables for the step, a tree for the token chain."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

STATE_MARK = {"written this step": "*", "read": "", "allocated ahead": "+", "null": "",
              "out of window (stale: never read or written again)": "~"}
STATE_STYLE = {"written this step": "bold green", "read": "", "allocated ahead": "dim",
               "null": "magenta", "out of window (stale: never read or written again)": "yellow"}


def render_explain(d: dict, console: Console) -> None:
    console.print(Text(f"step {d['step']} of {d['trace']} (line {d['line']}, {d['protocol']} protocol): "
                       f"{len(d['batch'])} requests, {d['num_tokens']} tokens", style="bold"))
    ch = d["changes"]
    for label, key in (("finished", "finished"), ("preempted", "preempted"), ("added", "added"),
                       ("resumed", "resumed")):
        if ch[key]:
            console.print(Text(f"  {label}: {', '.join(ch[key])}"))
    for r, what in ch["blocks"].items():
        for verb, lists in what.items():
            console.print(Text(f"  blocks {verb} for {r}: " + "; ".join(f"group {g}: {ids}" for g, ids in
                                                                          enumerate(lists))))
    t = Table(title="scheduler order -> batch order", title_justify="left")
    for col in ("scheduler", "req_id", "tokens", "origin", "", "batch_idx", "row (idx_mapping)", "computed",
                "flat tokens", "seq_len"):
        t.add_column(col, justify="right" if col not in ("req_id", "origin") else "left")
    by_id = {x["req_id"]: x for x in d["batch"]}
    for i, s in enumerate(d["scheduler_order"]):
        x = by_id[s["req_id"]]
        t.add_row(str(i), Text(s["req_id"]), str(s["num_scheduled_tokens"]), Text(s["origin"]), "->",
                  str(x["batch_idx"]), str(x["row"]), str(x["num_computed_tokens"]),
                  f"{x['tokens'][0]}..{x['tokens'][1] - 1}", str(x["seq_len"]))
    console.print(t)
    console.print(Text(f"idx_mapping     {d['idx_mapping']}   (batch_idx -> req_state_idx)"))
    console.print(Text(f"query_start_loc {d['query_start_loc']}"))
    console.print(Text(f"seq_lens        {d['seq_lens']}"))
    req = d.get("request")
    if req:
        console.print(Text(f"\nrequest {req['req_id']!r} ({req['origin']}): row {req['row']}, "
                           f"batch {req['batch_idx']}, "
                           f"flat tokens {req['tokens'][0]}..{req['tokens'][1] - 1}, positions "
                           f"{req['positions'][0]}..{req['positions'][1]}"
                           + (f" ({req['num_draft_tokens']} drafts)" if req["num_draft_tokens"] else ""),
                           style="bold"))
        for bt in req["block_tables"]:
            row = Text(f"  group {bt['group']} ({bt['kind']}, block {bt['block_size']}): ")
            for e in bt["entries"]:
                label = "null" if e["state"] == "null" else f"{e['block']}{STATE_MARK.get(e['state'], '')}"
                row.append(f"[{e['logical_block']}]{label} ", style=STATE_STYLE.get(e["state"], ""))
            console.print(row)
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
        tree = Tree(Text(f"token {tok['token']} of {req['req_id']!r}: input id {tok['input_id']}"
                         + (" (draft)" if tok["is_draft"] else ""), style="bold"))
        node = tree
        for link in tok["links"]:
            node = node.add(Text(link))
        for g in tok["groups"]:
            gn = node.add(Text(f"group {g['group']} ({g['kind']})", style="cyan"))
            for link in g["links"]:
                gn = gn.add(Text(link, style="bold green" if link.startswith("slot") else ""))
            for rk in g.get("ranks", []):
                rn = gn.add(Text(f"rank {rk['rank']}: " + (f"holds it, slot {rk['slot']}" if rk["holds"]
                                                           else f"does not hold it, slot {rk['slot']}"),
                                 style="bold green" if rk["holds"] else "dim"))
                for link in rk["links"]:
                    rn.add(Text(link))
        console.print(tree)
