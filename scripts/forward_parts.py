"""Where `prepare_forward` spends its time: the median of each forward part in the replay loop, beside the phase
and the four mapping phases of the same run (docs/performance.md, "prepare_forward against the mapping
phases (issue 26's floor)").

    python scripts/forward_parts.py [--backend numba] [--trace traces/long_mixed.jsonl.gz]
        [--attention-backend FLASHINFER] [--cudagraph-mode FULL_AND_PIECEWISE] [--cudagraph-capture-sizes default]

Each part's host function (the form the worker runs) and `forward_step` are wrapped in two `perf_counter_ns`
reads (about 0.1-0.2 us each, counted in the phase); `mappings()` is timed where a part asks for it
(the host workers' parts read the worker's own arrays instead: forward/core.py). One warm-up replay, then
one measured replay (warm-up 20 steps); medians over the steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvmap.forward import inputs as I  # noqa: E402
from kvmap.run.config import ReplayConfig  # noqa: E402
from kvmap.run.replay import replay  # noqa: E402
from kvmap.run.result import MAPPING_PHASES  # noqa: E402
from kvmap.trace import Trace  # noqa: E402
from kvmap.workers import host as H  # noqa: E402
from kvmap.workers.registry import make_worker  # noqa: E402

TIMES: dict[str, list[int]] = defaultdict(list)


def timed(name: str, fn):
    clock = time.perf_counter_ns

    def call(*args):
        t = clock()
        out = fn(*args)
        TIMES[name].append(clock() - t)
        return out

    return call


def instrument() -> None:
    init = I.ForwardBuilder.__init__

    def init_timed(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.forms = [(name, timed(name, host), b) for name, host, b in self.forms]

    I.ForwardBuilder.__init__ = init_timed
    H.HostWorker.forward_step = timed("forward_step", H.HostWorker.forward_step)
    H.HostWorker._collect = timed("mappings() (in the phase)", H.HostWorker._collect)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parent.parent / "traces/long_mixed.jsonl.gz"))
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--cudagraph-mode", default=None)
    ap.add_argument("--cudagraph-capture-sizes", default=None)
    a = ap.parse_args()
    sizes = a.cudagraph_capture_sizes or ("default" if a.cudagraph_mode not in (None, "NONE") else None)
    cfg = ReplayConfig(nvtx=False, warmup=20, forward=True, attention_backend=a.attention_backend,
                       cudagraph_mode=a.cudagraph_mode, cudagraph_capture_sizes=sizes)
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
    for name in ("forward_step", "sampler", "cudagraph", "mappings() (in the phase)", "attention", "backends"):
        t = TIMES[name][20:]  # mappings(): not called when the parts read the worker's arrays (forward/core.py)
        print(f"  {name:<26} {np.median(t) / 1e3 if t else 0.0:>7.1f}" + ("" if t else "   (not called)"))


if __name__ == "__main__":
    main()
