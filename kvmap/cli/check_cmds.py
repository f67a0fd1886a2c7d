"""`kvmap validate`, `explain`, `record`: check a trace, explain a step, record one from vLLM."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvmap.cli.console import Spinner, out, pass_bars
from kvmap.cli.guard import user_errors
from kvmap.cli.options import AttentionBackendOpt, CaptureSizesOpt, CudagraphModeOpt, TraceArg, complete_trace
from kvmap import defaults
from kvmap.errors import KvmapError

# each command's help ends with these (one command a line; paragraphs as typer's rich help keeps them)
EXAMPLES = {
    "validate": """
Examples:
  kvmap validate /tmp/run.jsonl
  kvmap validate spec_decode --deep
  kvmap validate run.jsonl.gz --json - | jq '.problems[0]'""",
    "explain": """
Examples:
  kvmap explain --step 1
  kvmap explain worked_example --step 1 --req B --token 0
  kvmap explain long_mixed --step 152 --json
  kvmap explain worked_example --step 1 --req B --token 0 --html step1.html""",
    "record": """
Examples:
  kvmap record traces/workloads/spec_decode.yaml -o spec.jsonl
  kvmap record my_workload.yaml -o /tmp/run.jsonl.gz --no-progress
Every workload key, and the live plugin: docs/recording.md""",
    "traces": """
Examples:
  kvmap traces
  kvmap replay long_mixed --steps 100:200""",
}


@user_errors
def validate(
    trace: Annotated[Path, typer.Argument(metavar="TRACE", help="Trace file (.jsonl or .jsonl.gz), or a bundled "
                                          "trace's name.", autocompletion=complete_trace)],
    deep: Annotated[bool, typer.Option("--deep", help="Also replay through every worker, compare each step "
                                       "bit for bit with the reference, and check the KV cache every step.",
                                       rich_help_panel="Deep check")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the report as JSON ('-' for "
                                                     "stdout).", rich_help_panel="Outputs")] = None,
    max_problems: Annotated[Optional[int], typer.Option(help="Stop after N problems.", min=1,
                                                        rich_help_panel="Outputs")] = None,
    backend: Annotated[Optional[list[str]], typer.Option("--backend", "-b", metavar="NAME",
                                                         help="With --deep: check only these "
                                                         "backends (repeatable; a built-in name, module:Class or "
                                                         "file.py:Class): a conformance check against the "
                                                         "reference.", show_default=False,
                                                         rich_help_panel="Deep check")] = None,
) -> None:
    """Check a trace for every inconsistency; exit 0 if valid, 1 if problems were found, 2 if unusable."""
    from kvmap.files import write_json
    from kvmap.trace import Trace
    from kvmap.validate import validate as run_validate

    if backend and not deep:
        raise KvmapError("--backend needs --deep (it names the backends to replay against the reference)",
                         field="--backend")
    from kvmap.files import check_outputs, resolve_trace

    trace = resolve_trace(trace)
    to_stdout = check_outputs({"--json": json_out}, [trace])
    t = Trace(trace)
    report = run_validate(t, max_problems=max_problems, deep=deep, backends=backend, progress=pass_bars(True, t))
    if to_stdout:
        print(json.dumps(report.to_json(), indent=1))
    else:
        from kvmap.render.validate import render_validation

        render_validation(report, out)
        if json_out:
            write_json(json_out, report.to_json())
    if not report.valid:
        raise typer.Exit(1)


@user_errors
def explain(
    trace: TraceArg = None,
    step: Annotated[Optional[int], typer.Option("--step", help="The step to explain (default: --req's first "
                                                "scheduled step; without --req, 1).", show_default=False,
                                                rich_help_panel="What to explain")] = None,
    req: Annotated[Optional[str], typer.Option("--req", help="A request scheduled in that step.",
                                               rich_help_panel="What to explain")] = None,
    token: Annotated[Optional[int], typer.Option("--token", help="A token: its index within --req's scheduled "
                                                 "tokens, or without --req the flat token index.",
                                                 rich_help_panel="What to explain")] = None,
    group: Annotated[Optional[int], typer.Option("--group", help="Only this KV cache group.",
                                                 rich_help_panel="What to explain")] = None,
    kv_heads: Annotated[int, typer.Option(help="KV heads, for the bytes a slot occupies.", min=1,
                                          rich_help_panel="KV cache")] = defaults.KV_HEADS,
    head_size: Annotated[int, typer.Option(help="Head size, for the bytes a slot occupies.",
                                           min=1, rich_help_panel="KV cache")] = defaults.KV_HEAD_SIZE,
    kv_dtype: Annotated[str, typer.Option(help="KV dtype, for the bytes a slot occupies.",
                                          rich_help_panel="KV cache")] = defaults.KV_DTYPE,
    runner: Annotated[Optional[str], typer.Option("--runner", help="mrv2 or v1: the batch order and the "
                                                  "forward-pass rules (default: the header's runner, else mrv2).",
                                                  show_default=False, rich_help_panel="What to explain")] = None,
    attention_backend: AttentionBackendOpt = None,
    cudagraph_mode: CudagraphModeOpt = None,
    cudagraph_capture_sizes: CaptureSizesOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the explanation as JSON.",
                                           rich_help_panel="Outputs")] = False,
    html_out: Annotated[Optional[Path], typer.Option("--html", metavar="FILE", help="Write the explainer's figures "
                                                     "for the step as a self-contained HTML page: request-state "
                                                     "and block-table rows, batch order and idx_mapping, flat "
                                                     "tokens, KV blocks and slots (--req/--token highlighted).",
                                                     rich_help_panel="Outputs")] = None,
    svg_out: Annotated[Optional[Path], typer.Option("--svg", metavar="FILE", help="Write the same figures as one "
                                                    "SVG file.", rich_help_panel="Outputs")] = None,
) -> None:
    """Show how one step's scheduler decisions become rows, flat tokens, positions, blocks and KV slots."""
    from kvmap.explain.build import explain as run_explain
    from kvmap.explain.build import first_scheduled_step
    from kvmap.kv.cache import KVGeometry
    from kvmap.files import check_outputs, resolve_trace
    from kvmap.render.explain import render_explain
    from kvmap.trace import Trace

    trace_path = resolve_trace(trace)
    to_stdout = check_outputs({"--json": "-" if json_out else None, "--html": html_out, "--svg": svg_out},
                              [trace_path])
    t = Trace(trace_path)
    if step is None:
        # without --req step 1, the first with cached requests; step 0 in a one-step trace
        has_step_1 = next(iter(t.steps(1, 2)), None) is not None
        step = first_scheduled_step(t, req) if req is not None else (1 if has_step_1 else 0)
    d = run_explain(t, step, req, token, group, KVGeometry(kv_heads, head_size, kv_dtype), runner,
                    (attention_backend, cudagraph_mode, cudagraph_capture_sizes))
    if html_out or svg_out:
        from kvmap.files import write_text
        from kvmap.render.html.explain_page import explain_html, explain_svg

        if html_out:
            write_text(html_out, explain_html(d))
        if svg_out:
            write_text(svg_out, explain_svg(d))
    if json_out:
        print(json.dumps(d, indent=1))
    elif to_stdout is None:
        render_explain(d, out)


@user_errors
def record(
    workload: Annotated[Path, typer.Argument(metavar="WORKLOAD", help="Workload file (YAML): scheduler settings "
                                             "and requests (docs/recording.md).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Trace to write (.jsonl or .jsonl.gz).")],
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> None:
    """Record a trace from vLLM's real scheduler (no model, no GPU) driven by a workload file."""
    from kvmap.record.engine import record as run_record
    from kvmap.record.engine import require_vllm
    from kvmap.record.workload import load_workload

    from kvmap.files import check_outputs, output_kind

    if check_outputs({"--output": output}, [workload]) or output_kind(output) != "file":
        raise KvmapError("record writes a trace file: give a file name", path=str(output), field="--output")
    w = load_workload(workload)
    require_vllm()
    target = Path(os.path.realpath(output))  # a link stays a link: the file it names is replaced
    tmp = target.with_name(f".{target.name}.partial")
    with Spinner(progress, f"recording {w.name}") as tick:
        try:
            s = run_record(w, str(tmp) + (".gz" if output.name.endswith(".gz") else ""), on_step=tick)
        except BaseException:
            for p in (tmp, Path(str(tmp) + ".gz")):
                p.unlink(missing_ok=True)
            raise
    written = Path(s.path)
    written.replace(target)
    from kvmap.render.text import say

    say(out, f"recorded {output}: {s.steps} steps, {s.requests} requests, {s.tokens} tokens, "
              f"{s.preemptions} preemptions, {s.prefix_hit_tokens} prefix-hit tokens, "
              f"{output.stat().st_size / 1024:.1f} KiB")




@user_errors
def traces() -> None:
    """List the bundled traces: each name works as TRACE from any folder (`kvmap replay long_mixed`)."""
    from rich.text import Text

    from kvmap.files import bundled_traces_dir
    from kvmap.run.catalog import catalog
    from kvmap.render.text import fit_table, safe, say

    rows = catalog()
    if not rows:
        raise KvmapError("no bundled traces: the traces/ folder is not beside this kvmap (install with "
                         "`pip install -e .` from the repository)", path=str(bundled_traces_dir()))
    table = fit_table(out, Text(f"bundled traces in {safe(str(bundled_traces_dir()))}"))
    for col in ("name", "steps", "requests", "tokens", "protocol", "KV groups", "KiB"):
        table.add_column(col, justify="left" if col in ("name", "protocol", "KV groups") else "right",
                         no_wrap=col in ("name", "protocol", "KV groups"))
    for f in rows:
        if f.error:
            table.add_row(f.name, "", "", "", "", Text(safe(f.error), style="red"), f"{f.size_bytes / 1024:.1f}")
            continue
        table.add_row(f.name, str(f.steps), str(f.requests), f"{f.tokens:,}", f.protocol, f.groups,
                      f"{f.size_bytes / 1024:.1f}")
    out.print(table)
    say(out, "use a name as TRACE from any folder, e.g. `kvmap replay long_mixed --steps 100:200`")
