"""The explainer's four figures for one step, as SVG, from `kvmap explain --json`'s data (explain/build.py):
request-state rows with their block-table rows; the batch order with `idx_mapping`; the flattened tokens with
`query_start_loc` boundaries and positions; the physical blocks with each token's slot (one grid per KV group
and, with DCP, per rank).

Rules:
- Every value drawn is read from the explain data (its `batch`, `mappings` and `layout`); where a block holds
  tokens of earlier steps, their cells are placed by kvmap.layout's rule (`GroupLayout.local_offset`), the
  owner of the address arithmetic, never by arithmetic of its own.
- Each figure's <svg> carries `data-fig` and `data-values` (the JSON values it shows), each drawn element a
  <title> with its numbers; a highlighted request (--req) or token (--token) is outlined in red on every figure.
- Long steps stay readable: at most MAX_TOKENS flat tokens and MAX_BLOCKS blocks per grid are drawn, the rest
  counted in a note (MAX_BLOCKS: explain_cells.py).
"""

from __future__ import annotations

import json

from kvmap.render.html.explain_cells import grid_cells
from kvmap.render.html.page import esc

MAX_TOKENS = 512  # flat tokens drawn
COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
          "#bab0ac")
HL = "#d62728"
FONT = 'font-family="system-ui, sans-serif"'


def color(b: int) -> str:
    return COLORS[b % len(COLORS)]


def _svg(fig: str, w: int, h: int, body: list[str], values: dict) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" data-fig="{fig}" data-values="{esc(json.dumps(values))}" '
            f'width="{w}" height="{h}" viewBox="0 0 {w} {h}" {FONT} font-size="12">' + "".join(body) + "</svg>")


def _box(x, y, w, h, fill, text="", title="", hl=False, text_color="#fff", size=12) -> str:
    stroke = f'stroke="{HL}" stroke-width="3"' if hl else 'stroke="#fff" stroke-width="1"'
    t = f"<title>{esc(title)}</title>" if title else ""
    label = (f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + size * 0.35:.1f}" text-anchor="middle" fill="{text_color}" '
             f'font-size="{size}">{esc(text)}</text>') if text != "" else ""
    rect = f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}" {stroke}>{t}</rect>'
    return f"<g>{rect}{label}</g>"


def _text(x, y, s, anchor="start", weight="normal", fill="#222", size=12) -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-weight="{weight}" fill="{fill}" '
            f'font-size="{size}">{esc(s)}</text>')


def _focus(d: dict) -> tuple[str | None, int | None]:
    """(highlighted request id, highlighted flat token index) from the explain data."""
    req = d.get("request")
    tok = d.get("token")
    return (req["req_id"] if req else None), (tok["flat_token_index"] if tok else None)


def state_rows(d: dict) -> str:
    """Request-state rows (sorted by row) with num_computed_tokens and every group's block-table row."""
    m, focus = d["mappings"], _focus(d)[0]
    rows = sorted(range(len(d["batch"])), key=lambda b: d["batch"][b]["row"])
    groups = len(m["block_tables"])
    width = max((len(m["block_tables"][g][b]) for g in range(groups) for b in rows), default=0)
    shown = min(width, 24)
    cell = 34
    x0 = 250
    w = x0 + groups * (shown * cell + 30) + 40
    body = [_text(8, 16, "row", weight="bold"), _text(50, 16, "request", weight="bold"),
            _text(150, 16, "computed", weight="bold")]
    for g in range(groups):
        body.append(_text(x0 + g * (shown * cell + 30), 16, f"block_table, group {g}", weight="bold"))
    y = 26
    for b in rows:
        e = d["batch"][b]
        hl = e["req_id"] == focus
        body += [_box(4, y, 40, 22, color(b), str(e["row"]), f"request state row {e['row']}", hl),
                 _box(46, y, 100, 22, color(b), _short(e["req_id"]), f"request {e['req_id']}", hl),
                 _box(148, y, 90, 22, "#eee", str(e["num_computed_tokens"]), "num_computed_tokens", text_color="#222")]
        for g in range(groups):
            row = m["block_tables"][g][b]
            gx = x0 + g * (shown * cell + 30)
            for j, blk in enumerate(row[:shown]):
                body.append(_box(gx + j * cell, y, cell - 2, 22, "#dfe7f1", str(blk),
                                 f"block_table[{e['row']}][{j}] = {blk} (group {g})", hl, "#222", 11))
            if len(row) > shown:
                body.append(_text(gx + shown * cell + 2, y + 16, f"+{len(row) - shown}"))
        y += 26
    values = {"rows": [d["batch"][b]["row"] for b in rows],
              "num_computed_tokens": [d["batch"][b]["num_computed_tokens"] for b in rows]}
    return _svg("state", w, y + 8, body, values)


def batch_order(d: dict) -> str:
    """Batch rows (batch order) and the request-state rows they map to, `idx_mapping[b] = row`."""
    m, focus = d["mappings"], _focus(d)[0]
    n = len(d["batch"])
    rows = sorted({e["row"] for e in d["batch"]})
    ry = {r: 30 + i * 28 for i, r in enumerate(rows)}
    body = [_text(10, 18, "batch_idx -> request", weight="bold"), _text(400, 18, "request state rows (idx_mapping)",
                                                                        weight="bold")]
    for b, e in enumerate(d["batch"]):
        y = 30 + b * 28
        hl = e["req_id"] == focus
        body.append(_box(10, y, 180, 22, color(b), f"{b}: {_short(e['req_id'])} ({e['num_scheduled_tokens']} tok)",
                         f"batch {b}: request {e['req_id']}, {e['num_scheduled_tokens']} scheduled tokens", hl))
        y2 = ry[e["row"]]
        body.append(f'<line x1="190" y1="{y + 11}" x2="420" y2="{y2 + 11}" stroke="{HL if hl else color(b)}" '
                    f'stroke-width="{3 if hl else 1.5}"><title>idx_mapping[{b}] = {e["row"]}</title></line>')
        body.append(_text(196, y + 9, f"idx_mapping[{b}] = {m['idx_mapping'][b]}", size=10, fill="#444"))
    for r in rows:
        body.append(_box(420, ry[r], 90, 22, "#eee", f"row {r}", f"request state row {r}", text_color="#222"))
    h = 30 + max(n, len(rows)) * 28 + 4
    return _svg("batch", 640, h, body, {"idx_mapping": m["idx_mapping"]})


def flat_tokens(d: dict) -> str:
    """The flattened tokens: flat index above, position inside, input id below, query_start_loc boundaries."""
    m = d["mappings"]
    focus_req, focus_tok = _focus(d)
    qsl, pos, ids = m["query_start_loc"], m["positions"], m["input_ids"]
    n = min(len(pos), MAX_TOKENS)
    per_line, cw, lh = 32, 34, 70
    body = []
    batch_of = _batch_of(qsl, n)
    holder = _holders(d, n)
    lh += 10 if holder else 0
    for t in range(n):
        b = batch_of[t]
        x, y = 10 + (t % per_line) * cw, 34 + (t // per_line) * lh
        hl = t == focus_tok or (focus_tok is None and d["batch"][b]["req_id"] == focus_req)
        body.append(_text(x + cw / 2, y - 4, str(t), "middle", fill="#666", size=10))
        body.append(_box(x, y, cw - 2, 24, color(b), str(pos[t]), f"flat token {t}: request {m['req_ids'][b]} "
                         f"(batch {b}), position {pos[t]}, input id {ids[t]}", hl, size=11))
        body.append(_text(x + cw / 2, y + 38, str(ids[t]), "middle", fill="#444", size=9))
        if holder is not None:
            body.append(_text(x + cw / 2, y + 49, f"r{holder[t]}", "middle", fill="#8a5300", size=9))
    for b, q in enumerate(qsl):
        if q > n:
            break
        t = min(q, n)
        x = 10 + (t % per_line) * cw - 1 if t < n or t % per_line else 10 + per_line * cw - 1
        y = 34 + ((t if t < n else t - 1) // per_line) * lh
        body.append(f'<line x1="{x}" y1="{y - 16}" x2="{x}" y2="{y + 44}" stroke="#222" stroke-width="2">'
                    f"<title>query_start_loc[{b}] = {q}</title></line>")
        body.append(_text(x + 2, y + (62 if holder else 52) + 11 * (b % 2), f"qsl[{b}]={q}", size=10,
                          weight="bold"))
    lines = -(-n // per_line) if n else 1
    if len(pos) > n:
        body.append(_text(10, 34 + lines * lh, f"... {len(pos) - n} more tokens not drawn", fill="#8a5300"))
    legend = _text(10, 12, "flat token index (top), position (box), input_ids (below)"
                   + (", the DCP rank storing it" if holder is not None else "") + "; bars: query_start_loc",
                   fill="#555", size=11)
    return _svg("tokens", 10 + per_line * cw + 20, 34 + lines * lh + 24, [legend] + body,
                {"query_start_loc": qsl, "positions": pos[:n]})


def _holders(d: dict, n: int) -> list[int] | None:
    """With DCP: the rank whose slot_mapping stores each of the first `n` flat tokens (first KV group), else None."""
    lay = d["layout"]
    g = next((g for g, on in enumerate(lay["has_slots"]) if on and lay["group_cp"][g] > 1), None)
    if g is None:
        return None
    slots = d["mappings"]["slot_mapping"]  # [ranks][groups][tokens]
    return [next((lay["ranks"][k] for k in range(len(slots)) if slots[k][g][t] >= 0), -1) for t in range(n)]


def _batch_of(qsl: list[int], n: int) -> list[int]:
    out, b = [], 0
    for t in range(n):
        while qsl[b + 1] <= t:
            b += 1
        out.append(b)
    return out


def _short(s: str, k: int = 14) -> str:
    return s if len(s) <= k else s[: k - 1] + "…"


def block_grids(d: dict) -> list[str]:
    """One grid per KV group (and DCP rank): each block this step's requests hold, its slots, each cell the token
    it stores (written this step: solid, with its flat index; earlier: pale)."""
    out = []
    for g, grp in enumerate(d["groups"]):
        for rank in d["layout"]["ranks"]:
            cells, more = grid_cells(d, g, rank)
            out.append(_grid_svg(d, g, rank, grp, cells, more))
    return out


def _grid_svg(d: dict, g: int, rank: int, grp: dict, blocks: list[tuple[int, list]], more: int) -> str:
    bs = grp["block_size"]
    cw = max(6, min(30, 900 // bs))
    focus_req, focus_tok = _focus(d)
    cp = d["layout"]["cp_size"] > 1
    title = f"group {g} ({grp['kind']}, block_size {bs})" + (f", DCP rank {rank}" if cp else "")
    body = [_text(10, 16, title, weight="bold")]
    y = 26
    written = []
    for blk, cells in blocks:
        body.append(_text(10, y + 15, f"block {blk}", size=11))
        for off, c in enumerate(cells):
            x = 80 + off * cw
            slot = blk * bs + off
            if c is None:
                body.append(_box(x, y, cw - 1, 20, "#f3f3f3", "", f"slot {slot}: empty"))
                continue
            b, p, t = c
            hl = (t is not None and t == focus_tok) or (focus_tok is None and d["batch"][b]["req_id"] == focus_req)
            what = (f"flat token {t}, written this step" if t is not None else "held from an earlier step")
            fill = color(b) if t is not None else color(b) + "55"
            body.append(_box(x, y, cw - 1, 20, fill, str(t) if t is not None and cw >= 18 else "",
                             f"slot {slot} = {blk} * {bs} + {off}: request {d['batch'][b]['req_id']} position {p}, "
                             f"{what}", hl, size=10))
            if t is not None:
                written.append([t, slot])
        body.append(_text(84 + bs * cw, y + 15, f"slots {blk * bs}..{blk * bs + bs - 1}", size=10, fill="#666"))
        y += 24
    if more:
        body.append(_text(10, y + 14, f"... {more} more blocks not drawn", fill="#8a5300"))
        y += 20
    written.sort()
    return _svg(f"blocks-g{g}-r{rank}", 80 + bs * cw + 130, y + 6, body,
                {"group": g, "rank": rank, "written_slots": written})
