"""`kvmap replay`, `profile`, `report`, `compare`: run the replay loop and render its data.

Rules: `-` is standard output for --json, --csv and --dump-mappings (at most one of them); then the summary
goes to stderr so that stdout holds only the data.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvmap.cli.console import ProgressBar, Spinner, err, out
from kvmap.cli.guard import user_errors
from kvmap.cli.options import (AttentionBackendOpt, BackendOpt, CaptureSizesOpt, CudagraphModeOpt, PercentilesOpt,
                               StepsOpt, TraceArg, WarmupOpt, parse_percentiles, parse_steps)
from kvmap.cli.replay_options import (BatchOrderOpt, CsvOpt, DeviceOpt, DumpOpt, ForwardOpt, HeadSizeOpt, HtmlOpt,
                                      JsonOpt, KvDtypeOpt, KvHeadsOpt, NoKvOpt, NprocOpt, NvtxCaptureOpt, NvtxOpt,
                                      ProgressOpt, QuietOpt, RankOpt, ReorderOpt, RunnerOpt, RunsOpt, TraceOutOpt,
                                      VerifyKvOpt)
from kvmap import defaults
from kvmap.errors import KvmapError

# each command's help ends with these (one command a line; paragraphs as typer's rich help keeps them)
EXAMPLES = {
    "replay": """
Examples:
  kvmap replay long_mixed --steps 100:200
  kvmap replay long_mixed --runs 5 --percentiles 50,99
  kvmap replay spec_decode --verify-kv -b numpy
  kvmap replay long_mixed --html long_mixed.html
  kvmap replay dcp2 --dump-mappings - -q | head -1""",
    "profile": """
Examples:
  kvmap profile long_mixed --steps 500:600
  kvmap profile long_mixed --steps 500:600 --builtin
  kvmap profile spec_decode -o spec --nsys /opt/nsys/bin/nsys""",
    "report": """
Examples:
  kvmap replay long_mixed --json run.json -q && kvmap report run.json
  kvmap report run.json --csv steps.csv
  kvmap report run.json --html run.html""",
    "compare": """
Examples:
  kvmap replay long_mixed -b numba --json a.json -q
  kvmap replay long_mixed -b numpy --json b.json -q
  kvmap compare a.json b.json
  (with --runs 5 on both: the ratio's uncertainty)""",
}


@user_errors
def replay(
    trace: TraceArg = None,
    backend: BackendOpt = None,
    device: DeviceOpt = "cpu",
    steps: StepsOpt = None,
    runner: RunnerOpt = None,
    batch_order: BatchOrderOpt = None,
    reorder_threshold: ReorderOpt = None,
    warmup: WarmupOpt = defaults.WARMUP,
    runs: RunsOpt = 1,
    forward: ForwardOpt = False,
    attention_backend: AttentionBackendOpt = None,
    cudagraph_mode: CudagraphModeOpt = None,
    cudagraph_capture_sizes: CaptureSizesOpt = None,
    verify_kv: VerifyKvOpt = False,
    no_kv: NoKvOpt = False,
    kv_heads: KvHeadsOpt = defaults.KV_HEADS,
    head_size: HeadSizeOpt = defaults.KV_HEAD_SIZE,
    kv_dtype: KvDtypeOpt = defaults.KV_DTYPE,
    dump_mappings: DumpOpt = None,
    json_out: JsonOpt = None,
    csv_out: CsvOpt = None,
    trace_out: TraceOutOpt = None,
    html_out: HtmlOpt = None,
    nvtx: NvtxOpt = True,
    progress: ProgressOpt = True,
    nvtx_capture: NvtxCaptureOpt = False,
    percentiles: PercentilesOpt = None,
    quiet: QuietOpt = False,
    rank: RankOpt = None,
    nproc: NprocOpt = None,
) -> None:
    """Replay a trace step by step: every index mapping, a real paged KV cache, a timing summary."""
    from kvmap.files import check_outputs, resolve_trace
    from kvmap.kv.cache import KVGeometry
    from kvmap.run.config import ReplayConfig
    from kvmap.trace import Trace
    from kvmap.workers.registry import default_backend

    runner = _check_replay_options(no_kv, verify_kv, runner, batch_order)
    if device != "cpu" and backend is None:
        backend = "triton"
    backend = backend or default_backend()
    (start, stop), qs = parse_steps(steps), parse_percentiles(percentiles)
    trace = resolve_trace(trace)
    outputs = {"--dump-mappings": dump_mappings, "--json": json_out, "--csv": csv_out, "--trace-out": trace_out,
               "--html": html_out}
    to_stdout = check_outputs(outputs, [trace])
    t = Trace(trace)
    config = ReplayConfig(backend=backend, device=device, start=start, stop=stop, warmup=warmup, verify_kv=verify_kv,
                          write_kv=not no_kv, kv_geometry=KVGeometry(kv_heads, head_size, kv_dtype).check(),
                          nvtx=nvtx, capture=nvtx_capture, batch_order=runner or t.header.runner or "mrv2",
                          reorder_batch_threshold=reorder_threshold, ranks=None if rank is None else [rank],
                          forward=forward, attention_backend=attention_backend, cudagraph_mode=cudagraph_mode,
                          cudagraph_capture_sizes=cudagraph_capture_sizes,
                          series=bool(json_out or html_out), step_starts=bool(json_out or trace_out))
    if forward or attention_backend or cudagraph_mode or cudagraph_capture_sizes:
        from kvmap.run.replay import forward_config

        fcfg = forward_config(t.header, config)  # a bad override is said before anything runs
        if not forward:
            raise KvmapError("the forward-pass options apply with --forward", field="--forward")
        for line in () if quiet else fcfg.skipped:  # an older trace: what --forward leaves out
            err.print(f"note: {line}", markup=False, highlight=False)
    cp = t.header.decode_context_parallel_size
    if rank is not None and rank >= cp:
        raise KvmapError(f"the trace has {cp} DCP rank(s): --rank must be below that", field="--rank")
    if nproc is not None:
        if runs > 1:
            raise KvmapError("--runs repeats a replay in this process; with --nproc, run the command again",
                             field="--runs")
        if forward:
            raise KvmapError("--forward runs in one process: leave out --nproc", field="--forward")
        _finish(_launch(trace, cp, nproc, rank, config, dump_mappings, progress), None if quiet else out, json_out,
                csv_out, trace_out, qs, html_out)
        return
    result = _replay_runs(t, config, dump_mappings, progress, runs)
    _finish(result, None if quiet else (err if to_stdout else out), json_out, csv_out, trace_out, qs, html_out)


def _check_replay_options(no_kv: bool, verify_kv: bool, runner: str | None, batch_order: str | None) -> str | None:
    """The option combinations a replay refuses before it reads anything, each naming its option; the runner
    asked for (None: the header's), `--batch-order` being its deprecated name."""
    from kvmap.forward.config import check_runner
    from kvmap.workers.order import check_batch_order

    if no_kv and verify_kv:  # nothing written, nothing to read back
        raise KvmapError("--no-kv and --verify-kv exclude each other: --verify-kv reads back what the replay writes "
                         "into the KV cache, and --no-kv writes nothing", field="--verify-kv")
    if batch_order is not None:  # before the trace is read or any rank starts
        check_batch_order(batch_order)
        if runner is not None and runner != batch_order:
            raise KvmapError(f"--batch-order is the old name of --runner: {batch_order} contradicts --runner "
                             f"{runner}", field="--batch-order")
    return check_runner(runner) if runner is not None else batch_order


def _launch(trace: Path, cp: int, nproc: int, rank: int | None, config, dump_mappings: Path | None,
            progress: bool = True):
    """`--nproc`: one process per rank under torchrun; its options checked before any process starts; a spinner
    on a terminal while the ranks start and replay (seconds before the first step)."""
    from kvmap.cli.console import Spinner
    from kvmap.run.distributed import launch

    if rank is not None:
        raise KvmapError("--rank and --nproc exclude each other: with --nproc every process is a rank",
                         field="--rank")
    if nproc % cp:  # said before any process starts (each rank would say it again after seconds)
        raise KvmapError(f"{nproc} processes cannot form DCP groups of {cp}: use a multiple of {cp}",
                         field="--nproc")
    if config.device != "cpu":
        from kvmap.workers.device import check_gpus_for_ranks

        check_gpus_for_ranks(config.device, nproc)
    with Spinner(progress, f"starting {nproc} ranks under torchrun, then replaying"):
        return launch(trace, nproc, backend=config.backend, device=config.device, verify_kv=config.verify_kv,
                      write_kv=config.write_kv, kv_geometry=config.kv_geometry, dump_mappings=dump_mappings,
                      start=config.start, stop=config.stop, warmup=config.warmup, batch_order=config.batch_order,
                      reorder_batch_threshold=config.reorder_batch_threshold)


def _replay_runs(t, config, dump_mappings: Path | None, progress: bool, runs: int):
    """`--runs N`: N replays in this process, each with a fresh worker and KV cache (and its own warm-up); the
    last run's result, carrying every run's per-phase medians; the dump is the last run's."""
    from kvmap.run.runs import run_medians

    medians = []
    for k in range(runs):
        result = _replay_here(t, config, dump_mappings if k == runs - 1 else None, progress)
        if runs > 1:
            medians.append(run_medians(result))
    if runs > 1:
        result.runs_p50_us = medians
    return result


def _replay_here(t, config, dump_mappings: Path | None, progress: bool):
    """The replay in this process; the dump is renamed into place only if the whole replay succeeds."""
    from kvmap.files import atomic_open
    from kvmap.run.replay import replay as run_replay
    from kvmap.workers.mappings import dump_line

    with ExitStack() as stack:
        dump_file = stack.enter_context(atomic_open(dump_mappings)) if dump_mappings else None

        def on_mappings(d: dict) -> None:
            if d["step"] >= config.start:
                dump_file.write(dump_line(d))

        with ProgressBar(progress, t, config.backend) as advance:
            return run_replay(t, config, on_mappings=on_mappings if dump_file else None, on_step=advance)


def _finish(result, console, json_out, csv_out, trace_out, percentiles: list[float] | None = None,
            html_out: Path | None = None) -> None:
    """Record what produced the run and the percentiles asked for; render the summary (unless `console` is None),
    write the outputs asked for; exit 1 on KV mismatches."""
    from kvmap.files import write_json, write_text
    from kvmap.render.report import kv_failure_line, render_summary, summary_dict, to_chrome_trace, to_csv
    from kvmap.run.provenance import provenance

    result.provenance = provenance()
    if percentiles:
        result.percentiles = percentiles

    if console is not None:
        render_summary(result, console)
    if json_out:
        write_json(json_out, {"summary": summary_dict(result), "result": result.json_fields()})
    if csv_out:
        write_text(csv_out, to_csv(result))
    if trace_out:
        write_json(trace_out, to_chrome_trace(result, stream=True))
    if html_out:
        _write_html(html_out, result)
    if result.kv_mismatches:
        if console is None:  # quiet: no summary lists them, so one line says why the exit is 1
            typer.echo(f"kvmap: {kv_failure_line(result)}", err=True)
        raise typer.Exit(1)


def _write_html(path: Path, result) -> None:
    """The HTML report (render/html/report.py), imported only when asked for."""
    from kvmap.files import write_text
    from kvmap.render.html.report import report_html

    write_text(path, report_html(result))


@user_errors
def profile(
    trace: TraceArg = None,
    steps: StepsOpt = None,
    warmup: WarmupOpt = defaults.WARMUP,
    backend: BackendOpt = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="Report name (.nsys-rep is added).",
                                         rich_help_panel="Outputs")] = Path(
        "kvmap-profile"),
    nsys: Annotated[Optional[str], typer.Option(metavar="FILE", help="The nsys to use (default: $KVMAP_NSYS, PATH, "
                                                ".tools/nsys).", rich_help_panel="Nsight Systems")] = None,
    builtin: Annotated[bool, typer.Option("--builtin", help="No nsys: replay and write a Chrome trace "
                                          "(OUTPUT.trace.json, opens in Perfetto) instead.",
                                          rich_help_panel="Nsight Systems")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for nsys (the profiled replay, "
                                           "then nsys stats) before giving up.", min=1,
                                           rich_help_panel="Nsight Systems")] = defaults.NSYS_TIMEOUT_S,
    force_overwrite: Annotated[bool, typer.Option("--force-overwrite", help="Replace an existing report (as nsys's "
                                                  "own option; without it an existing report is refused).",
                                                  rich_help_panel="Outputs")] = False,
) -> None:
    """Replay under Nsight Systems (NVTX + OS runtime, CUDA on a GPU) and show its NVTX ranges per phase beside
    kvmap's own timings."""
    import tempfile

    from kvmap.run import profile as P
    from kvmap.files import check_outputs, output_kind, resolve_trace
    from kvmap.render.report import render_profile
    from kvmap.run.result import ReplayResult

    from kvmap.trace import Trace

    start, stop = parse_steps(steps)
    trace_path = resolve_trace(trace)
    rep = output if output.suffix == ".nsys-rep" else output.with_name(output.name + ".nsys-rep")
    written = output.with_name(output.name + ".trace.json") if builtin else rep
    if (output_kind(output) != "file" or check_outputs({"--output": written}, [trace_path])
            or output_kind(written) != "file"):  # `-o -`, `-o /dev/stdout`: never a name made beside them
        raise KvmapError("profile writes a report file: give a file name", path=str(output), field="--output")
    P.check_overwrite(written, force_overwrite)
    if not builtin:  # `nsys stats` exports the report beside it as OUTPUT.sqlite: an output too
        check_outputs({"--output": rep.with_suffix(".sqlite")}, [trace_path])
        P.check_overwrite(rep.with_suffix(".sqlite"), force_overwrite)
    from kvmap.run.result import empty_window_error, warmup_window

    warmup_window(start, stop, warmup)  # a warm-up that does not fit is an error before nsys starts
    total = sum(1 for _ in Trace(trace_path).raw_steps())
    if stop is None:  # an explicit end, so that the capture closes right after the last step
        stop = total
    if start >= total:
        raise empty_window_error(start, stop, warmup, total)
    if start == 0 and warmup > total:
        raise KvmapError(f"{warmup} warm-up steps, but the trace has only {total}; lower --warmup", field="--warmup")
    args = [str(trace_path), "--warmup", str(warmup), "--no-progress", "--quiet", "--steps", f"{start}:{stop}"]
    if backend:
        args += ["--backend", backend]
    if builtin:
        replay(trace_path, backend=backend, steps=steps, warmup=warmup, trace_out=written, progress=False)
        from kvmap.render.text import say

        say(out, f"wrote {output.name}.trace.json (open it in https://ui.perfetto.dev)")
        return
    exe = P.find_nsys(nsys)
    if exe is None:
        raise P.nsys_missing(nsys)
    with tempfile.TemporaryDirectory() as tmp, P.staged(rep) as staged:  # renamed to rep when all went well
        res_path = Path(tmp) / "result.json"
        with Spinner(True, f"profiling under {exe}"):
            P.run_nsys(exe, staged, args + ["--json", str(res_path)], timeout=timeout)
        data = json.loads(res_path.read_text())
        ranges = P.nvtx_ranges(exe, staged.with_suffix(".nsys-rep"), timeout=timeout)
    if not ranges:
        from kvmap.run.markers import WORKS_WITH, nvtx_version

        raise KvmapError(f"nsys recorded no kvmap NVTX ranges: the nvtx package here is {nvtx_version()}; "
                         f"{WORKS_WITH}", path=str(rep))
    result = ReplayResult.from_json(data["result"])
    render_profile(result, ranges, out, rep)


@user_errors
def report(
    result: Annotated[Path, typer.Argument(help="A run saved with `kvmap replay --json`.")],
    csv_out: Annotated[Optional[Path], typer.Option("--csv", help="Also write one CSV row per step and phase.")] = None,
    trace_out: Annotated[Optional[Path], typer.Option("--trace-out", help="Also write a Chrome trace.")] = None,
    html_out: HtmlOpt = None,
    percentiles: PercentilesOpt = None,
) -> None:
    """Re-render a saved run: what produced it (kvmap version, date, command line, host), then the same summary
    `kvmap replay` printed."""
    from kvmap.files import check_outputs, write_json, write_text
    from kvmap.render.report import render_summary, to_chrome_trace, to_csv

    qs = parse_percentiles(percentiles)
    to_stdout = check_outputs({"--csv": csv_out, "--trace-out": trace_out, "--html": html_out}, [result])
    r = _load_result(result)
    if qs:
        r.percentiles = qs
    render_summary(r, err if to_stdout else out, produced_by=True)
    if csv_out:
        write_text(csv_out, to_csv(r))
    if trace_out:
        write_json(trace_out, to_chrome_trace(r, stream=True))
    if html_out:
        _write_html(html_out, r)


@user_errors
def compare(
    a: Annotated[Path, typer.Argument(help="Run A (`kvmap replay --json`).")],
    b: Annotated[Path, typer.Argument(help="Run B.")],
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the ratios as JSON ('-' for "
                                                     "stdout).")] = None,
    allow_different: Annotated[bool, typer.Option("--allow-different", help="Compare runs that did different "
                                                  "work (trace, measured steps, KV cache) anyway, with a "
                                                  "warning for each difference.")] = False,
) -> None:
    """Per-phase ratios B / A of two saved runs of the same work (two backends, two machines, two versions)."""
    from kvmap.files import check_outputs, write_json
    from kvmap.render.compare import render_compare
    from kvmap.run.compare import compare_dict

    to_stdout = check_outputs({"--json": json_out}, [a, b])
    ra, rb = _load_result(a), _load_result(b)
    d = compare_dict(ra, rb)
    if d["differences"] and not allow_different:
        raise KvmapError("the runs did different work, so their ratios would mislead: " + "; ".join(
            d["differences"]) + " (--allow-different compares them anyway)", path=f"{a} vs {b}")
    render_compare(d, err if to_stdout else out, (str(a), str(b)))
    if json_out:
        write_json(json_out, d)


def _load_result(path: Path):
    from kvmap.run.result import ReplayResult

    try:
        d = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise KvmapError("no such file", path=str(path)) from None
    except OSError as e:  # a directory, no permission
        raise KvmapError(f"cannot read: {e.strerror or e}", path=str(path)) from None
    except ValueError as e:  # not JSON, not UTF-8, an integer of more than 4300 digits
        raise KvmapError(f"not JSON ({e})", path=str(path)) from None
    except RecursionError:
        raise KvmapError("not a kvmap run: JSON nested too deeply", path=str(path)) from None
    d = d.get("result", d) if isinstance(d, dict) else d
    if not isinstance(d, dict) or d.get("kind") != "kvmap-replay-result/1":
        raise KvmapError("not a kvmap run (write one with `kvmap replay --json FILE`)", path=str(path))
    try:
        return ReplayResult.from_json(d)
    except KvmapError as e:
        raise e.located(path=str(path)) from None


