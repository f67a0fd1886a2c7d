"""Rich rendering of a validation report (`kvmap validate`); data in, text out."""

from __future__ import annotations

from rich.console import Console


def render_validation(report, out: Console) -> None:
    from collections import Counter

    from rich.table import Table
    from rich.text import Text

    from kvmap.validate import KINDS

    if report.valid:
        out.print(f"[green]valid[/]: {report.trace}: {report.steps} steps, {report.requests} requests, no problems")
    else:
        first = report.problems[0]
        out.print(f"[red]{len(report.problems)} problem(s)[/] in {report.trace} ({report.steps} steps read"
                  + (f"; stopped after {len(report.problems)}" if report.truncated else "") + ")")
        out.print(Text(f"first: {report.trace}:{first.line}: {first.where()}: {first.message}"))
        table = Table(title_justify="left")
        for col in ("line", "step", "request", "group", "field", "kind", "problem"):
            table.add_column(col, overflow="fold")
        for p in report.problems[:200]:
            table.add_row(*(Text(x) for x in (str(p.line or ""), "" if p.step is None else str(p.step),
                                              p.req_id or "", "" if p.group is None else str(p.group), p.field or "",
                                              p.kind, p.message)))
        out.print(table)
        if len(report.problems) > 200:
            out.print(f"... and {len(report.problems) - 200} more (use --json for all)")
        by = Counter(p.kind for p in report.problems)
        out.print("by kind: " + ", ".join(f"{k} {n} ({KINDS[k]})" for k, n in by.most_common()), highlight=False)
    if report.deep:
        for b, d in report.deep["backends"].items():
            if d.get("error"):
                out.print(Text(f"deep: {b}: stopped after {d['steps']} steps: {d['error']}"))
                continue
            out.print(f"deep: {b}: {d['steps']} steps, {d['differing_steps']} differ from the reference; KV "
                      f"{d['kv_checked']:,} positions read back, {d['kv_mismatches']} mismatches")
        for b, why in report.deep.get("skipped", {}).items():
            out.print(Text(f"deep: {b} skipped: {why}", style="dim"))
    for line in report.info:
        out.print(Text(f"info: {line}", style="dim"))


