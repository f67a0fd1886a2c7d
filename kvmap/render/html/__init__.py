"""The pictures: a replay's HTML report (report.py, drawn in the browser by report.js with the vendored uPlot) and
the explainer's figures for one step (explain_page.py, SVG drawn here: explain_svg.py, explain_cells.py).

Rules: imported only when `--html` or `--svg` is asked for, never at start-up. Every page is one self-contained
file (page.py: scripts and styles inlined, nothing fetched). Every number drawn comes from the data `--json`
writes (`summary_dict` and the result's arrays; `kvmap explain --json`), never measured or recomputed here;
series.py only downsamples. Why uPlot, with measurements: docs/pictures.md.
"""
