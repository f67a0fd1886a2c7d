"""kvmap's default worker beside vLLM's own V1 input preparation (the `vllm-v1` backend), same traces, one run.

    python scripts/bench_vllm.py [TRACE ...] [--warmup 20] [--json out.json]
    (default traces: traces/long_mixed.jsonl.gz and a real CPU engine's, tests/data/real_engine_preemption_vllm032
    .jsonl.gz; run it where vLLM is installed: vLLM's CPU build natively, or vLLM 0.33)

Per trace: kvmap's default worker replayed by kvmap's loop (KV write off), then the vllm-v1 backend replayed by
the same loop with the V1 runner's own `_update_states` and `_prepare_inputs` timed call by call
(perf_counter_ns around vLLM's methods only: kvmap's trace checks and the dump copies are outside). V1 does
batch order, positions, input ids, block-table commit and slot mapping inside `_prepare_inputs`: it is compared
with the sum of kvmap's four mapping phases. Medians per step over the measured steps; ratio = vLLM / kvmap.
Outputs are checked identical (dumps in V1's order) before timing counts.

With a GPU: CUDA-event device times per phase of `vllm-mrv2` (Model Runner V2's kernels, natively) and kvmap's
`torch` and `triton` workers on `cuda`; without one, says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread each, as kvmap's workers (OpenMP spins on a shared box)
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvmap.run.config import ReplayConfig  # noqa: E402
from kvmap.run.replay import replay  # noqa: E402
from kvmap.run.result import MAPPING_PHASES  # noqa: E402
from kvmap.trace import Trace  # noqa: E402
from kvmap.workers.registry import default_backend, make_worker  # noqa: E402

# the long bundled trace, and a real engine's (vLLM 0.32's CPU build, tests/real_engine/run_engine.py preemption)
TRACES = [ROOT / "traces" / "long_mixed.jsonl.gz", ROOT / "tests" / "data" / "real_engine_preemption_vllm032.jsonl.gz"]
GPU_BACKENDS = ("vllm-mrv2", "torch", "triton")


def timed(obj, name: str, into: list[int]) -> None:
    """Wrap obj.name so each call's wall time (ns) is appended to `into`."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        into.append(time.perf_counter_ns() - t)
        return out

    setattr(obj, name, wrapper)


def median_us(ns) -> float:
    return float(np.median(np.asarray(ns, dtype=np.int64))) / 1e3 if len(ns) else float("nan")


def kvmap_phases(path: Path, warmup: int) -> tuple[dict, str]:
    """Medians (us) of kvmap's default worker's phases, and the worker's name."""
    backend = default_backend()
    r = replay(Trace(path), ReplayConfig(backend=backend, write_kv=False, nvtx=False, warmup=warmup,
                                         batch_order="v1"))
    ns = r.phase_ns[r.warmup:]
    col = {p: ns[:, r.phases.index(p)] for p in r.phases}
    out = {p: median_us(col[p]) for p in ("update_states", *MAPPING_PHASES)}
    out["mappings"] = median_us(sum(col[p] for p in MAPPING_PHASES))
    out["total"] = median_us(col["update_states"] + sum(col[p] for p in MAPPING_PHASES))
    out["steps"] = int(len(ns))
    return out, f"{backend} ({r.backend_detail})" if r.backend_detail else backend


def vllm_v1_phases(path: Path, warmup: int) -> tuple[dict, str]:
    """Medians (us) of the V1 runner's own `_update_states` and `_prepare_inputs`, as vllm-v1 replays."""
    trace = Trace(path)
    worker = make_worker("vllm-v1", trace.header, batch_order="v1")
    runner = worker.ops.runner
    upd: list[int] = []
    prep: list[int] = []
    timed(runner, "_update_states", upd)
    timed(runner, "_prepare_inputs", prep)
    got: list[dict] = []
    replay(trace, ReplayConfig(write_kv=False, nvtx=False, warmup=0), worker=worker, on_mappings=got.append)
    want: list[dict] = []
    replay(Trace(path), ReplayConfig(backend="reference", write_kv=False, nvtx=False, warmup=0, batch_order="v1"),
           on_mappings=want.append)
    if got != want:
        raise SystemExit(f"{path.name}: vllm-v1's mappings differ from the reference's; no timing reported")
    u, p = upd[warmup:], prep[warmup:]
    n = min(len(u), len(p))
    return {"update_states": median_us(u), "mappings": median_us(p),
            "total": median_us(np.add(u[:n], p[:n])), "steps": len(u)}, worker.backend_detail


def gpu_phases(path: Path, warmup: int) -> dict:
    """CUDA-event medians (us) per phase of each GPU backend on `cuda` ({} without a GPU)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    out = {}
    for backend in GPU_BACKENDS:
        r = replay(Trace(path), ReplayConfig(backend=backend, device="cuda", write_kv=False, nvtx=False,
                                             warmup=warmup))
        d = r.device_phase_ns[r.warmup:]
        out[backend] = {p: median_us(d[:, r.phases.index(p)]) for p in ("update_states", "h2d", *MAPPING_PHASES)
                        if p in r.phases and len(d)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", type=Path, default=TRACES)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    report = {"machine": f"{platform.machine()}, {platform.python_version()}", "traces": {}}
    for path in a.traces:
        k, k_name = kvmap_phases(path, a.warmup)
        v, v_name = vllm_v1_phases(path, a.warmup)
        g = gpu_phases(path, a.warmup)
        report["traces"][path.name] = {"kvmap": k, "vllm_v1": v, "gpu": g, "kvmap_backend": k_name,
                                       "vllm_backend": v_name}
        print(f"\n{path.name}: {k['steps']} measured steps; kvmap: {k_name}; vLLM: {v_name}")
        print(f"{'phase (median us / step)':44} {'kvmap':>9} {'vLLM V1':>9} {'vLLM/kvmap':>11}")
        for label, key in (("update_states (V1: _update_states)", "update_states"),
                           ("input prep (V1: _prepare_inputs)", "mappings"), ("both", "total")):
            print(f"{label:44} {k[key]:9.1f} {v[key]:9.1f} {v[key] / k[key]:10.1f}x")
        print("  kvmap's input prep by phase: " + ", ".join(f"{p} {k[p]:.1f}" for p in MAPPING_PHASES))
        if g:
            for backend, ph in g.items():
                print(f"  GPU (CUDA events) {backend}: " + ", ".join(f"{p} {x:.1f}" for p, x in ph.items()))
        else:
            print("  no GPU here: CUDA-event times of vllm-mrv2 and kvmap's torch/triton workers not measured")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
