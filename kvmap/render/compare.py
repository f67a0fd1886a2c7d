"""`kvmap compare`'s drawing: the ratios run/compare.py computed, with every difference in the runs' work and
each run's own warnings said first and last.

Rules: a comparison of unlike work (`--allow-different`) says so before and after its table, in bold yellow;
names are never markup (text.py `safe`, `say`).
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from kvmap.render.text import fit_table, safe, say


def render_compare(d: dict, console: Console, names: tuple[str, str]) -> None:
    for diff in d["differences"]:
        say(console, Text.assemble(("warning: the runs did different work: ", "bold yellow"), safe(diff)))
    table = fit_table(console, Text(f"B / A per phase (A = {safe(names[0])}, B = {safe(names[1])}; below 1.00 "
                                    "means B is faster)"))
    runs = d["a"].get("runs", 1) > 1 or d["b"].get("runs", 1) > 1
    unit = "" if runs else " us"  # with runs the ratio's cell is wider: the unit goes to the caption
    for col in ("phase", f"A p50{unit}", f"B p50{unit}", "B/A p50", f"A mean{unit}", f"B mean{unit}", "B/A mean"):
        table.add_column(col, justify="left" if col == "phase" else "right", no_wrap=col in ("phase", "B/A p50"))

    def fmt(x):
        return "n/a" if x is None else f"{x:.2f}"

    for name, row in d["phases"].items():
        if runs and row.get("ratio_runs"):  # the runs' mean medians and the ratio with its uncertainty
            p50 = (f"{row['a_runs_p50_us'][0]:.1f}", f"{row['b_runs_p50_us'][0]:.1f}",
                   "{:.2f} +- {:.2f}".format(*row["ratio_runs"]))
        else:
            p50 = (f"{row['a_p50_us']:.1f}", f"{row['b_p50_us']:.1f}", fmt(row["ratio_p50"]))
        table.add_row(name, *p50, f"{row['a_mean_us']:.1f}", f"{row['b_mean_us']:.1f}", fmt(row["ratio_mean"]),
                      style="bold" if name in ("mappings", "step") else None)
    if runs:
        table.caption = (f"us; p50: mean of the runs' medians (A {d['a']['runs']} runs, B {d['b']['runs']}), B/A "
                         "with its uncertainty; mean: the last run's")
    console.print(table)
    if d.get("verdict"):
        say(console, Text.assemble(("step: ", "bold"), d["verdict"]))
    for key, label in (("a", "A"), ("b", "B")):
        for w in d[key]["warnings"]:
            say(console, Text.assemble((f"warning: {label}: ", "yellow"), safe(w)))
    if d["differences"]:
        say(console, Text("warning: these ratios compare unlike work (see above)", style="bold yellow"))
