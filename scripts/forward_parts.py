"""Where `prepare_forward` spends its time: the median of each piece in the replay loop, beside the phase and the
four mapping phases of the same run (docs/performance.md, "prepare_forward against the mapping phases (issue
26's floor)").

    python scripts/forward_parts.py [--backend numba] [--trace traces/long_mixed.jsonl.gz]
        [--attention-backend FLASHINFER] [--cudagraph-mode FULL_AND_PIECEWISE] [--cudagraph-capture-sizes default]
        [--runner v1] [--warmup 20]

The numba worker (one pass, forward/compiled.py `NumbaForward`): the pass (`NumbaForward.run`) and each kernel
call in it; the rest of the phase is the worker gathering the step's arrays (workers/host.py). Any other host
worker: `forward_step` and each part's numpy form (inputs.py PARTS); `mappings()` where a part asks for it.
Each timed call is wrapped in two `perf_counter_ns` reads (about 0.1-0.2 us each, counted in the phase). A
kernel's median is over the steps that call it (the count beside it: pad_tails runs on padded steps only,
common_split for a second split rule or a FULL step, paged_kv per FlashInfer group). One warm-up replay, then
one measured replay (warm-up 20 steps, and each timed call's first 20 calls: `--warmup`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvmap.forward import compiled as NF  # noqa: E402
from kvmap.forward import inputs as I  # noqa: E402
from kvmap.run.config import ReplayConfig  # noqa: E402
from kvmap.run.replay import replay  # noqa: E402
from kvmap.run.result import MAPPING_PHASES  # noqa: E402
from kvmap.trace import Trace  # noqa: E402
from kvmap.workers import host as H  # noqa: E402
from kvmap.workers.registry import make_worker  # noqa: E402

TIMES: dict[str, list[int]] = defaultdict(list)
KERNELS = ("step_rows", "pad_tails", "common_split", "paged_kv")


def timed(name: str, fn):
    clock = time.perf_counter_ns

    def call(*args):
        t = clock()
        out = fn(*args)
        TIMES[name].append(clock() - t)
        return out

    return call


class TimedKernels:
    """The kernels with each call timed (NumbaForward's `k`)."""

    def __init__(self, k) -> None:
        for name in KERNELS:
            setattr(self, name, timed(name, getattr(k, name)))


def instrument() -> None:
    init = I.ForwardBuilder.__init__

    def init_timed(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.forms = [(name, timed(name, host), b) for name, host, b in self.forms]

    I.ForwardBuilder.__init__ = init_timed
    nf_init = NF.NumbaForward.__init__

    def nf_init_timed(self, *args, **kwargs):
        nf_init(self, *args, **kwargs)
        self.k = TimedKernels(self.k)
        for _, _, b in self.split.flashinfer:  # FlashInfer's buffers call paged_kv through their own `k`
            b.k = self.k

    NF.NumbaForward.__init__ = nf_init_timed
    NF.NumbaForward.run = timed("NumbaForward.run", NF.NumbaForward.run)
    H.HostWorker.forward_step = timed("forward_step", H.HostWorker.forward_step)
    H.HostWorker._collect = timed("mappings() (in the phase)", H.HostWorker._collect)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parent.parent / "traces/long_mixed.jsonl.gz"))
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--cudagraph-mode", default=None)
    ap.add_argument("--cudagraph-capture-sizes", default=None)
    ap.add_argument("--runner", default="mrv2", choices=("mrv2", "v1"),
                    help="as `kvmap replay --runner` (the batch order and the rules)")
    ap.add_argument("--warmup", type=int, default=20, help="steps (and first calls) left out of the medians")
    a = ap.parse_args()
    sizes = a.cudagraph_capture_sizes or ("default" if a.cudagraph_mode not in (None, "NONE") else None)
    cfg = ReplayConfig(nvtx=False, warmup=a.warmup, forward=True, attention_backend=a.attention_backend,
                       cudagraph_mode=a.cudagraph_mode, cudagraph_capture_sizes=sizes, batch_order=a.runner)
    instrument()
    path = Path(a.trace)
    for _ in range(2):  # the first replay warms up (compiles, caches); the second is measured
        TIMES.clear()
        r = replay(Trace(path), cfg, worker=make_worker(a.backend, Trace(path).header))
    m, phases = r.measured(), r.phases
    mappings = np.median(m[:, [phases.index(p) for p in MAPPING_PHASES]].sum(axis=1)) / 1e3
    forward = np.median(m[:, phases.index("prepare_forward")]) / 1e3
    print(f"{path.name}, {a.backend} worker, {r.steps_replayed} steps: median us per step")
    print(f"{'mapping phases':<28} {mappings:>7.1f}")
    print(f"{'prepare_forward':<28} {forward:>7.1f}   ({forward / mappings:.2f}x the mapping phases)")
    one_pass = bool(TIMES["NumbaForward.run"])
    names = ("NumbaForward.run",) + tuple("  " + k for k in KERNELS) + ("forward_step (numpy forms' step)",) \
        if one_pass else ("forward_step", "sampler", "cudagraph", "mappings() (in the phase)", "attention", "backends")
    for name in names:
        t = TIMES[name.strip().split(" (")[0] if one_pass else name][a.warmup:]
        calls = f"   ({len(t)} calls)" if one_pass and name.startswith("  ") else ""
        print(f"  {name:<34} {np.median(t) / 1e3 if t else 0.0:>7.1f}" + (calls if t else "   (not called)"))


if __name__ == "__main__":
    main()
