"""One self-contained HTML page: the shell, escaping, number cells, and the vendored assets inlined.

Rules:
- A page opens offline: no URL is fetched, every script and style is inlined (`page`); the only script library
  is uPlot, vendored (vendor/, its version and licence beside it) and read only when a picture is asked for.
  A missing asset is one `KvmapError` line naming the extra, never a traceback.
- Every text from a trace or a run (file names, request ids, messages) goes through `esc`; embedded JSON
  through `script_json` (no `</script>` can end it early).
- A number shown in a table is written from the run data with its full value beside it
  (`data-key`: its path in the data, `/`-separated; `data-value`: its JSON), so a test can hold the page to
  `--json`.
"""

from __future__ import annotations

import html
import json
from importlib import resources

from kvmap.errors import KvmapError

UPLOT_VERSION = "1.6.32"  # npm uplot@1.6.32, dist/uPlot.iife.min.js and dist/uPlot.min.css, unchanged
EXTRA = "kvmap[html]"


def asset(name: str) -> str:
    """A file shipped with the HTML renderers (vendor/ included), as text."""
    try:
        return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    except (FileNotFoundError, OSError):
        raise KvmapError(f"the HTML renderer's file {name} is missing: reinstall kvmap with its pictures "
                         f"(pip install '{EXTRA}')", field="--html") from None


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def script_json(data: object) -> str:
    """JSON safe inside <script type="application/json">: `<`, `>`, `&` escaped (JSON stays the same)."""
    s = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def num(key: str, value, text: str | None = None) -> str:
    """A table cell showing `value` (formatted as `text`), with its key and exact value as attributes."""
    if value is None:
        return f'<td class="n" data-key="{esc(key)}" data-value="null">-</td>'
    shown = text if text is not None else (f"{value:,}" if isinstance(value, int) else f"{value:,.1f}")
    return f'<td class="n" data-key="{esc(key)}" data-value="{esc(json.dumps(value))}">{esc(shown)}</td>'


def table(caption: str, head: list[str], rows: list[str], cls: str = "") -> str:
    """A table from its header cells' texts and already-built rows (`<tr>...</tr>`)."""
    th = "".join(f"<th>{esc(h)}</th>" for h in head)
    return (f'<table class="{cls}"><caption>{esc(caption)}</caption><thead><tr>{th}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


def page(title: str, body: str, *, scripts: list[str] = (), data: object = None, with_plots: bool = False) -> str:
    """The whole page: styles and scripts inlined, `data` embedded as #kvmap-data, errors caught from the start."""
    css = asset("page.css") + (asset("vendor/uPlot.min.css") if with_plots else "")
    js = [asset("vendor/uPlot.iife.min.js")] if with_plots else []
    js += [asset(s) for s in scripts]
    # last: every figure's box in page pixels (data-box), for the browser test's per-figure screenshot check
    js.append("document.querySelectorAll('figure').forEach(f=>{const r=f.getBoundingClientRect();"
              "f.dataset.box=JSON.stringify([r.left+scrollX,r.top+scrollY,r.width,r.height].map(Math.round));});"
              "document.documentElement.dataset.ready='1';")
    catch = ("window.addEventListener('error',e=>{document.documentElement.dataset.errors="
             "(document.documentElement.dataset.errors||'')+String(e.message)+'\\n';});")
    embedded = (f'<script type="application/json" id="kvmap-data">{script_json(data)}</script>'
                if data is not None else "")
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{esc(title)}</title>"
            f"<script>{catch}</script><style>{css}</style></head><body>{body}{embedded}"
            + "".join(f"<script>{s}</script>" for s in js) + "</body></html>\n")
