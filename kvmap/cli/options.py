"""The options several commands share (the trace, the step window, the warm-up, the backend, the percentiles)
and the one parser of `--steps` and of `--percentiles`.

Rules: an option shared by two commands is stated once, here, so that its name, help and default cannot drift
between them; a bad `--steps` is a located `KvmapError` naming the option.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvmap.errors import KvmapError
from kvmap.workers.registry import BUILTIN

__all__ = ["BACKEND_HELP", "AttentionBackendOpt", "BackendOpt", "CaptureSizesOpt", "CudagraphModeOpt",
           "PercentilesOpt", "StepsOpt", "TraceArg", "WarmupOpt", "parse_percentiles", "parse_steps"]

MAX_PERCENTILES = 5  # columns the phase table can hold at 80 columns


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


def parse_percentiles(spec: str | None) -> list[float] | None:
    """`50,90,99` -> [50, 90, 99] (each in 0..100, at most MAX_PERCENTILES, no repeats); None: the default."""
    if spec is None:
        return None
    try:
        qs = [float(x) for x in spec.split(",")]
    except ValueError:
        raise KvmapError(f"expected percentiles separated by commas (e.g. 50,90,99.9), got {spec!r}",
                         field="--percentiles") from None
    if not 1 <= len(qs) <= MAX_PERCENTILES or not all(0 <= q <= 100 for q in qs) or len(set(qs)) != len(qs):
        raise KvmapError(f"needs 1 to {MAX_PERCENTILES} different percentiles in 0..100, got {spec!r}",
                         field="--percentiles")
    return [int(q) if q.is_integer() else q for q in qs]


def complete_trace(incomplete: str) -> list[str]:
    """Shell completion of TRACE: the bundled traces' names, then trace files and folders under what is typed."""
    from kvmap.files import bundled_traces

    found = [n for n in bundled_traces() if n.startswith(incomplete)]
    prefix = incomplete[: incomplete.rfind("/") + 1]  # the folder typed so far, with its slash
    folder = Path(prefix or ".")
    try:
        entries = sorted(folder.iterdir()) if folder.is_dir() else []
    except OSError:  # completion never fails: an unreadable folder completes nothing
        entries = []
    stem = incomplete[len(prefix):]
    for p in entries:
        if p.name.startswith(stem) and not p.name.startswith(".") and (p.is_dir() or ".jsonl" in p.name):
            found.append(prefix + p.name + ("/" if p.is_dir() else ""))
    return found


BACKEND_HELP = " | ".join(f"{b.name} ({b.summary})" for b in BUILTIN.values())
TraceArg = Annotated[Optional[Path], typer.Argument(metavar="TRACE", help="Trace file (.jsonl or .jsonl.gz), or a "
                                                         "bundled trace's name (`kvmap traces`) from any folder. "
                                                         "Default: the bundled worked example.", show_default=False,
                                                         autocompletion=complete_trace)]
StepsOpt = Annotated[Optional[str], typer.Option("--steps", metavar="START:END", help="Measure steps START:END "
                                                  "(END exclusive, either may be left out); earlier steps are still "
                                                  "replayed.", rich_help_panel="Window")]
WarmupOpt = Annotated[int, typer.Option("--warmup", help="Steps replayed first and not counted: the N steps just "
                                         "before the --steps window (timed, excluded), or for a window from 0 its "
                                         "first N steps, by a throwaway worker (untimed).", min=0,
                                         rich_help_panel="Window")]
BackendOpt = Annotated[Optional[str], typer.Option("--backend", "-b", metavar="NAME", help=f"Worker implementation: "
                                                   f"{BACKEND_HELP} (triton on CPU needs TRITON_INTERPRET=1); or "
                                                   "your own as module:Class or file.py:Class (a subclass of "
                                                   "kvmap.workers.contract.Worker), or a kvmap.backends entry point.",
                                                   show_default=False, rich_help_panel="Backend")]
PercentilesOpt = Annotated[Optional[str], typer.Option("--percentiles", metavar="P,P", help="The percentiles "
                                                       "of the phase table and --json (default 50,90,99; at most "
                                                       f"{MAX_PERCENTILES}, each 0..100).", show_default=False,
                                                       rich_help_panel="Outputs")]


# the forward-pass overrides of the header's keys (kvmap/forward/config.py `resolve`): replay --forward, explain
AttentionBackendOpt = Annotated[Optional[str], typer.Option(
    "--attention-backend", metavar="NAME", help="The attention backend of every KV cache group (vLLM's enum name: "
    "FLASH_ATTN, FLASHINFER, TRITON_ATTN or another), or g=NAME per group, comma-separated; overrides the "
    "header's.", rich_help_panel="Forward pass")]
CudagraphModeOpt = Annotated[Optional[str], typer.Option(
    "--cudagraph-mode", metavar="MODE", help="vLLM's CUDAGraphMode (NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, "
    "FULL_AND_PIECEWISE); overrides the header's (none: eager).", rich_help_panel="Forward pass")]
CaptureSizesOpt = Annotated[Optional[str], typer.Option(
    "--cudagraph-capture-sizes", metavar="SIZES", help="The captured batch sizes in tokens, comma-separated, or "
    "'default' (vLLM's defaults for the trace's limits); override the header's.", rich_help_panel="Forward pass")]
