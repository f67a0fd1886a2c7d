"""The `kvmap` command line: parse options, call the library, render. No computation lives here.

Rules: one Typer app, one function per command. Every `KvmapError` is caught once (`_user_errors`) and
printed as one line on stderr with its location; the exit code is 2 for unusable input or usage, 1 for
"problems found" (validate) or KV mismatches. Tracebacks are for kvmap's own bugs only.
"""

from __future__ import annotations

import functools
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from kvmap.errors import KvmapError

app = typer.Typer(
    name="kvmap",
    help="Replay, time, check and explain how vLLM scheduler decisions become paged-KV GPU input tensors.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="rich",
)
out = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    """Replay, time, check and explain how vLLM scheduler decisions become paged-KV GPU input tensors."""
    if version:
        from kvmap import __version__

        out.print(f"kvmap {__version__}")
        raise typer.Exit(0)


def _user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvmapError as e:
            err.print(f"[bold red]kvmap: error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except BrokenPipeError:
            raise typer.Exit(0) from None
        except KeyboardInterrupt:
            err.print("kvmap: interrupted")
            raise typer.Exit(130) from None

    return wrapper


def parse_steps(spec: str | None) -> tuple[int, int | None]:
    """`START:END`, `START:` or `:END` (END exclusive) -> (start, stop)."""
    if not spec:
        return 0, None
    try:
        a, _, b = spec.partition(":")
        if not _:
            raise ValueError
        start = int(a) if a.strip() else 0
        stop = int(b) if b.strip() else None
    except ValueError:
        raise KvmapError(f"expected START:END (e.g. 100:200, 100: or :50), got {spec!r}", field="--steps") from None
    if start < 0 or (stop is not None and stop <= start):
        raise KvmapError(f"needs 0 <= START < END, got {spec!r}", field="--steps")
    return start, stop


TraceArg = Annotated[Optional[Path], typer.Argument(help="Trace file (.jsonl or .jsonl.gz). Default: the "
                                                         "bundled worked example.", show_default=False)]
StepsOpt = Annotated[Optional[str], typer.Option("--steps", help="Only time steps START:END (END exclusive); "
                                                  "earlier steps are still replayed.")]
BackendOpt = Annotated[Optional[str], typer.Option("--backend", "-b", help="Worker implementation: numba "
                                                   "(compiled, the default when numba imports) | numpy | reference "
                                                   "| torch | triton (device workers; triton on CPU needs "
                                                   "TRITON_INTERPRET=1).",
                                                   show_default=False)]


@app.command()
@_user_errors
def replay(
    trace: TraceArg = None,
    backend: BackendOpt = None,
    device: Annotated[str, typer.Option("--device", help="cpu, or cuda[:N] (state, mappings and KV cache on "
                                        "the GPU; needs --backend torch or triton).")] = "cpu",
    steps: StepsOpt = None,
    warmup: Annotated[int, typer.Option(help="Measured steps to exclude from statistics.", min=0)] = 2,
    verify_kv: Annotated[bool, typer.Option("--verify-kv", help="Read back every scheduled request's "
                                            "readable context from the KV cache each step and check it bit "
                                            "for bit.")] = False,
    no_kv: Annotated[bool, typer.Option("--no-kv", help="Do not write the KV cache (mappings only).")] = False,
    kv_heads: Annotated[int, typer.Option(help="KV heads per token in the KV cache.", min=1)] = 1,
    head_size: Annotated[int, typer.Option(help="Head size of the KV cache.", min=1)] = 8,
    kv_dtype: Annotated[str, typer.Option(help="KV cache dtype: bfloat16, float16, float32, fp8.")] = "bfloat16",
    dump_mappings: Annotated[Optional[Path], typer.Option(help="Write every step's mappings as JSON "
                                                          "Lines (trace-format.md).")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the run (summary, per-phase "
                                                     "statistics, per-step timings) as JSON.")] = None,
    csv_out: Annotated[Optional[Path], typer.Option("--csv", help="Write one CSV row per step and phase.")] = None,
    trace_out: Annotated[Optional[Path], typer.Option("--trace-out", help="Write a Chrome trace-event file "
                                                      "(Perfetto), one track per phase.")] = None,
    nvtx: Annotated[bool, typer.Option("--nvtx/--no-nvtx", help="Emit NVTX ranges (domain kvmap).")] = True,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
    nvtx_capture: Annotated[bool, typer.Option("--nvtx-capture", hidden=True,
                                               help="Wrap the measured steps in the kvmap_capture range.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print no summary.")] = False,
) -> None:
    """Replay a trace step by step: every index mapping, a real paged KV cache, a timing summary."""
    from kvmap.kv_cache import KVGeometry
    from kvmap.outputs import atomic_open, default_trace, write_json, write_text
    from kvmap.replay import replay as run_replay
    from kvmap.report import render_summary, summary_dict, to_chrome_trace, to_csv
    from kvmap.trace import Trace
    from kvmap.worker import default_backend

    if device != "cpu" and backend is None:
        backend = "triton"
    backend = backend or default_backend()
    start, stop = parse_steps(steps)
    t = Trace(trace or default_trace())
    geometry = KVGeometry(kv_heads, head_size, kv_dtype).check()
    with ExitStack() as stack:  # the dump is renamed into place only if the whole replay succeeds
        dump_file = stack.enter_context(atomic_open(dump_mappings)) if dump_mappings else None

        def on_mappings(d: dict) -> None:
            if d["step"] >= start:
                dump_file.write(json.dumps(d, separators=(",", ":")) + "\n")

        with _progress(progress, t, backend) as advance:
            result = run_replay(t, backend=backend, device=device, start=start, stop=stop, warmup=warmup,
                                verify_kv=verify_kv, write_kv=not no_kv, kv_geometry=geometry, nvtx=nvtx,
                                on_mappings=on_mappings if dump_file else None, on_step=advance,
                                capture=nvtx_capture)
    if not quiet:
        render_summary(result, out)
    if json_out:
        write_json(json_out, {"summary": summary_dict(result), "result": result.to_json()})
    if csv_out:
        write_text(csv_out, to_csv(result))
    if trace_out:
        write_json(trace_out, to_chrome_trace(result))
    if result.kv_mismatches:
        raise typer.Exit(1)


@app.command()
@_user_errors
def validate(
    trace: Annotated[Path, typer.Argument(help="Trace file (.jsonl or .jsonl.gz).")],
    deep: Annotated[bool, typer.Option("--deep", help="Also replay through every worker, compare each step "
                                       "bit for bit with the reference, and check the KV cache every step.")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the report as JSON ('-' for "
                                                     "stdout).")] = None,
    max_problems: Annotated[Optional[int], typer.Option(help="Stop after N problems.", min=1)] = None,
) -> None:
    """Check a trace for every inconsistency; exit 0 if valid, 1 if problems were found, 2 if unusable."""
    from kvmap.outputs import write_json
    from kvmap.trace import Trace
    from kvmap.validate import validate as run_validate

    report = run_validate(Trace(trace), max_problems=max_problems, deep=deep)
    if json_out and str(json_out) == "-":
        print(json.dumps(report.to_json(), indent=1))
    else:
        _render_validation(report)
        if json_out:
            write_json(json_out, report.to_json())
    if not report.valid:
        raise typer.Exit(1)


def _render_validation(report) -> None:
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
            out.print(f"deep: {b}: {d['steps']} steps, {d['differing_steps']} differ from the reference; KV "
                      f"{d['kv_checked']:,} positions read back, {d['kv_mismatches']} mismatches")
        for b, why in report.deep.get("skipped", {}).items():
            out.print(Text(f"deep: {b} skipped: {why}", style="dim"))
    for line in report.info:
        out.print(Text(f"info: {line}", style="dim"))


@app.command()
@_user_errors
def explain(
    trace: TraceArg = None,
    step: Annotated[int, typer.Option("--step", help="The step to explain.")] = 1,
    req: Annotated[Optional[str], typer.Option("--req", help="A request scheduled in that step.")] = None,
    token: Annotated[Optional[int], typer.Option("--token", help="A token: its index within --req's scheduled "
                                                 "tokens, or without --req the flat token index.")] = None,
    group: Annotated[Optional[int], typer.Option("--group", help="Only this KV cache group.")] = None,
    kv_heads: Annotated[int, typer.Option(help="KV heads, for the bytes a slot occupies.", min=1)] = 1,
    head_size: Annotated[int, typer.Option(help="Head size, for the bytes a slot occupies.", min=1)] = 8,
    kv_dtype: Annotated[str, typer.Option(help="KV dtype, for the bytes a slot occupies.")] = "bfloat16",
    json_out: Annotated[bool, typer.Option("--json", help="Print the explanation as JSON.")] = False,
) -> None:
    """Show how one step's scheduler decisions become rows, flat tokens, positions, blocks and KV slots."""
    from kvmap.explain import explain as run_explain
    from kvmap.kv_cache import KVGeometry
    from kvmap.outputs import default_trace
    from kvmap.render_explain import render_explain
    from kvmap.trace import Trace

    d = run_explain(Trace(trace or default_trace()), step, req, token, group, KVGeometry(kv_heads, head_size, kv_dtype))
    if json_out:
        print(json.dumps(d, indent=1))
    else:
        render_explain(d, out)


@app.command()
@_user_errors
def record(
    workload: Annotated[Path, typer.Argument(help="Workload file (YAML): scheduler settings and requests.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Trace to write (.jsonl or .jsonl.gz).")],
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> None:
    """Record a trace from vLLM's real scheduler (no model, no GPU) driven by a workload file."""
    from kvmap.record.engine import record as run_record
    from kvmap.record.engine import require_vllm
    from kvmap.record.workload import load_workload

    w = load_workload(workload)
    require_vllm()
    tmp = output.with_name(f".{output.name}.partial")
    if not output.parent.is_dir():
        raise KvmapError(f"folder {output.parent} does not exist", path=str(output))
    with _spinner(progress, f"recording {w.name}") as tick:
        try:
            s = run_record(w, str(tmp) + (".gz" if output.name.endswith(".gz") else ""), on_step=tick)
        except BaseException:
            for p in (tmp, Path(str(tmp) + ".gz")):
                p.unlink(missing_ok=True)
            raise
    written = Path(s.path)
    written.replace(output)
    out.print(f"recorded {output}: {s.steps} steps, {s.requests} requests, {s.tokens} tokens, "
              f"{s.preemptions} preemptions, {s.prefix_hit_tokens} prefix-hit tokens, "
              f"{output.stat().st_size / 1024:.1f} KiB")


@app.command()
@_user_errors
def profile(
    trace: TraceArg = None,
    steps: StepsOpt = None,
    warmup: Annotated[int, typer.Option(help="Steps replayed before the capture starts.", min=0)] = 2,
    backend: BackendOpt = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="Report name (.nsys-rep is added).")] = Path(
        "kvmap-profile"),
    nsys: Annotated[Optional[str], typer.Option(help="The nsys to use (default: $KVMAP_NSYS, PATH, "
                                                ".tools/nsys).")] = None,
    builtin: Annotated[bool, typer.Option("--builtin", help="No nsys: replay and write a Chrome trace "
                                          "(OUTPUT.trace.json, opens in Perfetto) instead.")] = False,
) -> None:
    """Replay under Nsight Systems (NVTX + OS runtime, CUDA on a GPU) and show its NVTX ranges per phase beside
    kvmap's own timings."""
    import tempfile

    from kvmap import profile as P
    from kvmap.outputs import default_trace
    from kvmap.report import render_profile
    from kvmap.result import ReplayResult

    from kvmap.trace import Trace

    start, stop = parse_steps(steps)
    trace_path = Path(trace or default_trace())
    if stop is None:  # an explicit end, so that the capture closes right after the last step
        stop = sum(1 for _ in Trace(trace_path).raw_steps())
    if start + warmup >= stop:
        raise KvmapError(f"nothing to capture: steps {start}:{stop} minus {warmup} warm-up steps", field="--steps")
    args = [str(trace_path), "--warmup", str(warmup), "--no-progress", "--quiet", "--steps", f"{start}:{stop}"]
    if backend:
        args += ["--backend", backend]
    if builtin:
        replay(trace_path, backend=backend, steps=steps, warmup=warmup,
               trace_out=output.with_name(output.name + ".trace.json"), progress=False)
        out.print(f"wrote {output.name}.trace.json (open it in https://ui.perfetto.dev)")
        return
    exe = P.find_nsys(nsys)
    if exe is None:
        raise KvmapError(f"nsys not found. Get it with {P.GET_NSYS}, or pass --nsys PATH; or run "
                         "`kvmap profile --builtin` for a Perfetto trace without nsys", field="nsys")
    with tempfile.TemporaryDirectory() as tmp:
        res_path = Path(tmp) / "result.json"
        with _spinner(True, f"profiling under {exe}"):
            P.run_nsys(exe, output, args + ["--json", str(res_path)])
        data = json.loads(res_path.read_text())
    rep = output if output.suffix == ".nsys-rep" else output.with_name(output.name + ".nsys-rep")
    ranges = P.nvtx_ranges(exe, rep)
    result = ReplayResult.from_json(data["result"])
    render_profile(result, ranges, out, rep)


@app.command()
@_user_errors
def report(
    result: Annotated[Path, typer.Argument(help="A run saved with `kvmap replay --json`.")],
    csv_out: Annotated[Optional[Path], typer.Option("--csv", help="Also write one CSV row per step and phase.")] = None,
    trace_out: Annotated[Optional[Path], typer.Option("--trace-out", help="Also write a Chrome trace.")] = None,
) -> None:
    """Re-render a saved run: the same summary `kvmap replay` printed."""
    from kvmap.outputs import write_json, write_text
    from kvmap.report import render_summary, to_chrome_trace, to_csv

    r = _load_result(result)
    render_summary(r, out)
    if csv_out:
        write_text(csv_out, to_csv(r))
    if trace_out:
        write_json(trace_out, to_chrome_trace(r))


@app.command()
@_user_errors
def compare(
    a: Annotated[Path, typer.Argument(help="Run A (`kvmap replay --json`).")],
    b: Annotated[Path, typer.Argument(help="Run B.")],
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the ratios as JSON.")] = None,
) -> None:
    """Per-phase ratios B / A of two saved runs (two backends, two machines, two versions)."""
    from kvmap.outputs import write_json
    from kvmap.report import compare_dict, render_compare

    ra, rb = _load_result(a), _load_result(b)
    render_compare(ra, rb, out, (str(a), str(b)))
    if json_out:
        write_json(json_out, compare_dict(ra, rb))


def _load_result(path: Path):
    from kvmap.result import ReplayResult

    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise KvmapError("no such file", path=str(path)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KvmapError(f"not JSON ({e})", path=str(path)) from None
    d = d.get("result", d) if isinstance(d, dict) else d
    if not isinstance(d, dict) or d.get("kind") != "kvmap-replay-result/1":
        raise KvmapError("not a kvmap run (write one with `kvmap replay --json FILE`)", path=str(path))
    try:
        return ReplayResult.from_json(d)
    except (TypeError, ValueError) as e:
        raise KvmapError(f"a damaged kvmap run ({e})", path=str(path)) from None


class _spinner:
    def __init__(self, enabled: bool, what: str) -> None:
        self.enabled = enabled and err.is_terminal
        self.what = what

    def __enter__(self):
        if not self.enabled:
            return None
        self.status = err.status(self.what)
        self.status.start()
        return lambda step: self.status.update(f"{self.what}: step {step}")

    def __exit__(self, *exc):
        if self.enabled:
            self.status.stop()


class _progress:
    """A Rich progress bar over the trace file (by bytes read: no counting pass), updated outside timed regions.
    Shown before the slow start (numba's kernels load, or compile once into their cache, inside the first
    step), saying what is happening."""

    def __init__(self, enabled: bool, trace, backend: str = "") -> None:
        self.enabled = enabled and err.is_terminal
        self.trace = trace
        self.backend = backend

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        first = ("compiling kernels, once (seconds; cached for later runs)" if not _kernels_cached() else
                 "loading kernels") if self.backend == "numba" else "starting"
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                            TextColumn("step {task.fields[step]}"), TimeElapsedColumn(), console=err, transient=True)
        self.bar.start()
        task = self.bar.add_task(first, total=self.trace.size_bytes(), step="-")
        update, read = self.bar.update, self.trace.bytes_read

        def advance(step: int) -> None:
            update(task, completed=read(), step=step, description="replaying")

        return advance

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()


def _kernels_cached() -> bool:
    """Whether numba's cache holds kvmap's CPU kernels (index files), looked up without importing numba."""
    import os

    import kvmap

    where = os.environ.get("NUMBA_CACHE_DIR")
    folder = Path(where) if where else Path(kvmap.__file__).parent / "__pycache__"
    return folder.is_dir() and any(folder.rglob("kernels_cpu.*.nbi"))


# Commands that hold nothing past their own return (every file they write is closed inside the command), so
# the process may end without Python's teardown; `record` (vLLM) and `profile` (nsys) end the usual way.
_FAST_EXIT = {"replay", "validate", "explain", "report", "compare"}


def main() -> None:
    """Run the app. After a command in `_FAST_EXIT`, flush and end the process at once: tearing the
    interpreter down with numba's LLVM loaded took 0.3-1 s of every `kvmap replay` on this machine."""
    if len(sys.argv) < 2 or sys.argv[1] not in _FAST_EXIT:
        app()
        return
    try:
        app()
        code = 0
    except SystemExit as e:
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass
    import os

    os._exit(code)


if __name__ == "__main__":
    main()
