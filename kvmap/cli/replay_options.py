"""The options of `kvmap replay` (and the commands that share them: profile, report), declared once.

Rules: one `Annotated` alias per option, its help text said here; the command modules name the aliases, so a
command's signature is one line per option.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="cpu, or cuda[:N] (state, mappings and KV cache on the GPU; needs --backend torch or triton).",
        rich_help_panel="Backend",
    ),
]
RunnerOpt = Annotated[
    Optional[str],
    typer.Option(
        "--runner",
        help="mrv2 (Model Runner V2: batch sorted by "
        "scheduled tokens) or v1 (V1's persistent batch: lowest hole, "
        "condense): the batch order and the --forward rules, to diff dumps "
        "against either runner. Default: the trace header's runner, else "
        "mrv2.",
        show_default=False,
        rich_help_panel="Backend",
    ),
]
BatchOrderOpt = Annotated[
    Optional[str], typer.Option("--batch-order", hidden=True, help="Deprecated name of --runner.")
]
ReorderOpt = Annotated[
    Optional[int],
    typer.Option(
        "--reorder-threshold",
        help="With --runner v1: the attention "
        "backend's reorder_batch_threshold (decode-first regions; "
        "FlashAttention sets none).",
        min=1,
        rich_help_panel="Backend",
    ),
]

HtmlOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--html",
        metavar="FILE",
        help="Write a self-contained HTML "
        "report: time per step and phase, cost against batch size, "
        "batch composition, KV cache occupancy and memory efficiency "
        "(opens offline).",
        rich_help_panel="Outputs",
    ),
]

RunsOpt = Annotated[
    int,
    typer.Option(
        "--runs",
        metavar="N",
        help="Replay N times, each with a fresh worker and KV "
        "cache; the summary adds each phase's mean +- sigma over the runs' medians "
        "(other figures: the last run).",
        min=1,
        rich_help_panel="Window",
    ),
]

ForwardOpt = Annotated[
    bool,
    typer.Option(
        "--forward",
        help="Also compute every step's other forward-pass inputs "
        "(sampler indices, CUDA-graph padding, attention metadata and the "
        "decode/prefill split, backend metadata; docs/trace-format.md, "
        '"Forward-pass dump keys") as the timed phase prepare_forward; '
        "--dump-mappings then carries them.",
        rich_help_panel="Forward pass",
    ),
]

VerifyKvOpt = Annotated[
    bool,
    typer.Option(
        "--verify-kv",
        help="Read back every scheduled request's "
        "readable context from the KV cache each step and check it bit "
        "for bit.",
        rich_help_panel="KV cache",
    ),
]

NoKvOpt = Annotated[
    bool, typer.Option("--no-kv", help="Do not write the KV cache (mappings only).", rich_help_panel="KV cache")
]

KvHeadsOpt = Annotated[int, typer.Option(help="KV heads per token in the KV cache.", min=1, rich_help_panel="KV cache")]

HeadSizeOpt = Annotated[int, typer.Option(help="Head size of the KV cache.", min=1, rich_help_panel="KV cache")]

KvDtypeOpt = Annotated[
    str, typer.Option(help="KV cache dtype: bfloat16, float16, float32, fp8.", rich_help_panel="KV cache")
]

DumpOpt = Annotated[
    Optional[Path],
    typer.Option(help="Write the mappings of every step in the window (--steps; the whole trace by default; "
                "not the warm-up steps before it) as JSON Lines (docs/trace-format.md).", rich_help_panel="Outputs"),
]

JsonOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--json",
        help="Write the run (summary, per-phase statistics, per-step timings) as JSON.",
        rich_help_panel="Outputs",
    ),
]

CsvOpt = Annotated[
    Optional[Path], typer.Option("--csv", help="Write one CSV row per step and phase.", rich_help_panel="Outputs")
]

TraceOutOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--trace-out",
        help="Write a Chrome trace-event file (Perfetto), one track per phase.",
        rich_help_panel="Outputs",
    ),
]

NvtxOpt = Annotated[
    bool, typer.Option("--nvtx/--no-nvtx", help="Emit NVTX ranges (domain kvmap).", rich_help_panel="Outputs")
]

ProgressOpt = Annotated[
    bool, typer.Option("--progress/--no-progress", help="Show a progress bar.", rich_help_panel="Outputs")
]

NvtxCaptureOpt = Annotated[
    bool, typer.Option("--nvtx-capture", hidden=True, help="Wrap the measured steps in the kvmap_capture range.")
]

QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print no summary.", rich_help_panel="Outputs")]

RankOpt = Annotated[
    Optional[int],
    typer.Option(
        "--rank",
        help="DCP traces: compute only this decode context parallel rank (default: every rank, in this process).",
        min=0,
        rich_help_panel="Multi-rank",
    ),
]

NprocOpt = Annotated[
    Optional[int],
    typer.Option(
        "--nproc",
        help="Run one process per rank on "
        "torch.distributed (gloo on CPU, NCCL on cuda), launched with "
        "torchrun; the dump equals the one-process replay.",
        min=1,
        rich_help_panel="Multi-rank",
    ),
]
