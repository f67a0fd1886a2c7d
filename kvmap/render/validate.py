"""Rich rendering of a validation report (`kvmap validate`); data in, text out.

Rules: file names, request ids and messages are plain text with control characters escaped, never markup;
the table keeps its key columns (line, step, request, group, kind) whole at 80 columns and wraps the field and
the problem text; messages are not wrapped when piped (so that grep finds them whole).
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from kvmap.render.text import WIDE, fit_table, safe, say

MAX_ROWS = 200
KEY_COLUMNS = ("line", "step", "request", "group", "kind")


def render_validation(report, out: Console) -> None:
    from kvmap.validate import KINDS

    trace = safe(str(report.trace))
    if report.valid:
        say(out, Text.assemble(("valid", "green"), f": {trace}: {report.steps} steps, {report.requests} requests, "
                                                   "no problems"))
    else:
        first = report.problems[0]
        found = report.problems.found()
        say(out, Text.assemble((f"{found} problem(s)", "red"), f" in {trace} ({report.steps} steps "
                               "read" + (f"; stopped after {found}" if report.truncated else "")
                               + ")"))
        at = f"{report.trace}:{first.line}" if first.line is not None else str(report.trace)  # --deep: no line
        say(out, f"first: {at}: {first.where()}: {first.message}")
        out.print(_problem_table(report.problems[:MAX_ROWS], out))
        if found > MAX_ROWS:
            kept = len(report.problems)
            say(out, f"... and {found - MAX_ROWS} more (use --json for "
                     + (f"the first {kept}, counts by kind for the rest)" if found > kept else "all)"))
        by = report.problems.by_kind()
        say(out, "by kind: " + ", ".join(f"{k} {n} ({KINDS[k]})" for k, n in by.most_common()))
    if report.deep:
        for b, d in report.deep["backends"].items():
            if d.get("error"):
                say(out, f"deep: {b}: stopped after {d['steps']} steps: {d['error']}")
                continue
            say(out, f"deep: {b}: {d['steps']} steps, {d['differing_steps']} differ from the reference; KV "
                     f"{d['kv_checked']:,} positions read back, {d['kv_mismatches']} mismatches")
            fp = d.get("forward_parts")
            if fp and fp["native"]:  # a backend running another code's forward parts (vLLM's): say whose
                say(out, f"deep: {b}: forward inputs compared: {', '.join(fp['native'])} built by the backend's "
                         f"own code, {', '.join(fp['kvmap']) or 'nothing'} by kvmap's host forms on its mappings")
        for b, why in report.deep.get("skipped", {}).items():
            say(out, f"deep: {b} skipped: {why}", style="dim")
    for line in report.info:
        say(out, f"info: {line}", style="dim")


def _problem_table(problems, out: Console):
    """Wide: one column per part. Narrow (below WIDE columns): the field goes above the problem text in one
    cell, split after its dots, so that the key columns stay whole and no word is cut."""
    wide = out.width >= WIDE
    table = fit_table(out, "")
    cols = ("line", "step", "request", "group", "field", "kind", "problem") if wide else (
        "line", "step", "request", "group", "kind", "problem")
    for col in cols:
        key = col in KEY_COLUMNS
        table.add_column(col, no_wrap=key, overflow="fold", min_width=len(col) if key else None)
    for p in problems:
        cells = [Text(safe(x)) for x in (str(p.line or ""), "" if p.step is None else str(p.step), p.req_id or "",
                                         "" if p.group is None else str(p.group))]
        field = safe(p.field or "")
        if wide:
            cells += [Text(_split_path(field, 30)), Text(p.kind), Text(safe(p.message))]
        else:
            problem = Text(_split_path(field, 30) + "\n", style="dim") if field else Text()
            cells += [Text(p.kind), problem.append(safe(p.message), style="")]
        table.add_row(*cells)
    return table


def _split_path(field: str, width: int) -> str:
    """A dotted field path on lines of at most `width`, broken after a dot or slash, never inside a name."""
    parts, lines, line = [], [], ""
    for piece in field.replace("/", "/\0").replace(".", ".\0").split("\0"):
        parts.append(piece)
    for piece in parts:
        if line and len(line) + len(piece) > width:
            lines.append(line)
            line = ""
        line += piece
    return "\n".join([*lines, line])
