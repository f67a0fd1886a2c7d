"""What one kvmap NVTX range costs: `python scripts/nvtx_cost.py`, and under Nsight Systems
`.tools/nsys/bin/nsys profile -t nvtx -s none --cpuctxsw=none -o /tmp/nv -f true python scripts/nvtx_cost.py`.

Times N push+pop pairs of kvmap's phase range (attributes built once) and of its step range (attributes built
per call, the step index as payload), minus an empty loop, and prints ns per range (median of 7 runs).
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvmap.run.markers import Markers  # noqa: E402

N = 20000


def per_range(fn) -> float:
    runs = []
    for _ in range(7):
        t0 = time.perf_counter_ns()
        for i in range(N):
            fn(i)
        runs.append((time.perf_counter_ns() - t0) / N)
    return sorted(runs)[3]


def main() -> None:
    under = "nsys" if os.environ.get("NSYS_PROFILING_SESSION_ID") or os.environ.get("NVTX_INJECTION64_PATH") else "none"
    empty = per_range(lambda i: None)
    for label, enabled in (("disabled (--no-nvtx)", False), ("enabled", True)):
        m = Markers(["prepare_inputs"], enabled=enabled)

        def phase(i, m=m):
            m.push("prepare_inputs")
            m.pop()

        def step(i, m=m):
            m.push_step(i)
            m.pop()

        print(f"profiler: {under:5}  {label:22}  phase range {per_range(phase) - empty:7.0f} ns   "
              f"step range {per_range(step) - empty:7.0f} ns")


if __name__ == "__main__":
    main()
