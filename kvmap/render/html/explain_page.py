"""The explain page (`kvmap explain --html`) and its one-file SVG (`--svg`): the explainer's figures for a step.

Rules: the figures are explain_svg.py's, from `kvmap explain --json`'s data; the page adds the step's facts and,
with --req/--token, the request's rows and the token's chain as text, each from that data. The SVG stacks the
same figures, each under its title, in one standalone file. Both open offline (page.py).
"""

from __future__ import annotations

import re

from kvmap.render.html.explain_svg import batch_order, block_grids, flat_tokens, state_rows
from kvmap.render.html.page import esc, page

CAPTIONS = {
    "state": "Request-state rows, as the worker keeps them (sorted by row): num_computed_tokens and each KV cache "
             "group's block-table row (logical block -> physical block id).",
    "batch": "The batch order (requests sorted by scheduled tokens) and idx_mapping: batch_idx -> request-state row.",
    "tokens": "The step's tokens flattened into one sequence: flat index, position in its request, input id; "
              "query_start_loc marks where each request starts.",
    "blocks": "Physical KV blocks: each slot (block * block_size + offset) and the token it stores; solid: written "
              "this step (with its flat index), pale: written earlier. Hover a cell for its numbers.",
}


def figures(d: dict) -> list[tuple[str, str]]:
    """[(figure id, svg)] in the explainer's order."""
    out = [("state", state_rows(d)), ("batch", batch_order(d)), ("tokens", flat_tokens(d))]
    out += [(re.search(r'data-fig="([^"]+)"', s).group(1), s) for s in block_grids(d)]
    return out


def explain_html(d: dict) -> str:
    """The page for one step's explain data."""
    figs = figures(d)
    name = d["trace"].replace("\\", "/").rsplit("/", 1)[-1]
    head = (f"<h1>kvmap explain: step {d['step']}</h1><p class=\"sub\"><span title=\"{esc(d['trace'])}\">"
            f"{esc(name)}</span> (line {d['line']}, {esc(d['protocol'])} protocol): {len(d['batch'])} requests, "
            f"{d['num_tokens']} tokens</p>")
    parts = [head, _focus_block(d)]
    for fid, svg in figs:
        key = "blocks" if fid.startswith("blocks") else fid
        n = svg.count("<rect")
        parts.append(f'<figure data-fig="{fid}" data-points="{n}"><div class="grid">{svg}</div>'
                     f"<figcaption>{esc(CAPTIONS[key])}</figcaption></figure>")
    return page(f"kvmap explain step {d['step']}", "".join(parts))


def _focus_block(d: dict) -> str:
    """--req / --token: the request's facts and the token's chain, link by link."""
    out = []
    req = d.get("request")
    if req:
        out.append(f"<h2>Request {esc(req['req_id'])}</h2><p>batch {req['batch_idx']}, row {req['row']}, "
                   f"{req['num_computed_tokens']} computed, {req['num_scheduled_tokens']} scheduled (flat tokens "
                   f"{req['tokens'][0]}..{req['tokens'][1] - 1}), seq_len {req['seq_len']}</p>")
    tok = d.get("token")
    if tok:
        links = list(tok["links"]) + [x for g in tok["groups"] for x in g.get("links", [])]
        out.append(f"<h2>Token {tok['token']} (flat {tok['flat_token_index']})</h2><ol class=\"chain\">"
                   + "".join(f"<li>{esc(x)}</li>" for x in links) + "</ol>")
    return "".join(out)


def explain_svg(d: dict) -> str:
    """The same figures in one standalone SVG, stacked, each under its title."""
    y, width, parts = 0, 0, []
    for fid, svg in figures(d):
        w = int(re.search(r'width="(\d+)"', svg).group(1))
        h = int(re.search(r'height="(\d+)"', svg).group(1))
        parts.append(f'<text x="8" y="{y + 18}" font-weight="bold" font-size="14">{esc(fid)}</text>')
        parts.append(svg.replace("<svg ", f'<svg x="0" y="{y + 26}" ', 1))
        y += h + 40
        width = max(width, w)
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{y}" viewBox="0 0 {width} {y}" font-family="system-ui, sans-serif">'
            f'<rect width="100%" height="100%" fill="#fff"/>{"".join(parts)}</svg>\n')
