"""One command for a machine with an NVIDIA GPU: `python scripts/gpu_check.py [--device cuda]`.

1. Runs the GPU tests (tests/test_gpu.py): torch and Triton device workers equal the reference on every
   bundled trace (the multi-rank ones on every DCP rank), fixed buffer addresses, CUDA-event timings, KV
   read-back, and with 2 GPUs or more the distributed replay on NCCL (`kvmap replay --nproc 2 --device cuda`).
2. Replays the bundled long trace with the CPU worker (numba) and the device workers (torch, triton), KV write
   on: median host time per step and for the mapping phases, median device time per phase (CUDA events), and
   bytes copied host-to-device per step.
3. Synthetic steps at 8 / 64 / 256 / 1024 requests (the bench's workload): host and device time per step.
4. vLLM's own Model Runner V2 code natively (the `vllm-mrv2` backend, when vLLM 0.33 is installed): its dumps
   equal the reference's on the bundled MRV2-protocol traces, then CUDA-event device times per phase of
   vllm-mrv2 beside kvmap's torch and triton workers on the long trace (scripts/bench_vllm.py `gpu_phases`).
Prints one table. `--device cpu` runs the same on CPU tensors (Triton under TRITON_INTERPRET=1, tiny sizes),
to check the script itself.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


VLLM_TRACES = ("chunked_prefill", "spec_decode", "async_spec_decode", "prefix_caching", "preemption_v2",
               "hybrid_sliding_window", "kernel_block_split", "dcp2", "dcp2_mamba", "vllm51031", "full_graphs_spec")


def vllm_dump_rows(device: str, names) -> list[str]:
    """One line per bundled trace: whether vllm-mrv2 on `device` dumps what the reference dumps, step by step
    (the tests run it on "cpu", under the Triton interpreter, to check this function)."""
    from kvmap.run.config import ReplayConfig
    from kvmap.run.replay import replay
    from kvmap.trace import Trace

    lines = []
    for name in names:
        got, want = [], []
        for backend, dev, out in (("vllm-mrv2", device, got), ("reference", "cpu", want)):
            replay(Trace(ROOT / "traces" / f"{name}.jsonl"), ReplayConfig(backend=backend, device=dev, write_kv=False,
                                                                          nvtx=False, warmup=0), on_mappings=out.append)
        diff = next((w["step"] for g, w in zip(got, want) if g != w), None)
        same = diff is None and len(got) == len(want)
        lines.append(f"vllm-mrv2 on {device}, {name}: {len(got)} steps, "
                     + ("equal to the reference" if same else f"DIFFERS at step {diff}"))
    return lines


def vllm_section(device: str, trace: str) -> list[str]:
    """Section 4: vllm-mrv2 on the GPU against the reference, and its CUDA-event phase times beside kvmap's GPU
    workers. One line saying why when there is no GPU or no vLLM 0.33."""
    from kvmap import vllm_compat

    if not device.startswith("cuda"):
        return ["vLLM section: skipped (no GPU: vllm-mrv2 natively needs --device cuda; on CPU the tests run it "
                "under the Triton interpreter)"]
    if vllm_compat.installed("vllm") not in vllm_compat.SUPPORTED["vllm-mrv2"]["vllm"]:
        return ["vLLM section: skipped (vLLM 0.33 is not installed: pip install --no-deps vllm==0.33.0 and "
                "requirements-record.txt)"]
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_vllm

    lines = vllm_dump_rows(device, VLLM_TRACES)
    for backend, ph in bench_vllm.gpu_phases(Path(trace), 20).items():
        lines.append(f"CUDA events, {Path(trace).name}, {backend}: "
                     + ", ".join(f"{p} {x:.1f} us" for p, x in ph.items()))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--trace", default=str(ROOT / "traces" / "long_mixed.jsonl.gz"))
    ap.add_argument("--sizes", default="8,64,256,1024")
    ap.add_argument("--steps", type=int, default=200, help="synthetic steps per size")
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import numpy as np
    import torch

    if not cpu and not torch.cuda.is_available():
        sys.exit("gpu_check: CUDA is not available (use --device cpu to check the script)")
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if not cpu else 'cpu'}")
    if not args.skip_tests:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / "test_gpu.py")])
        print(f"GPU tests: exit code {rc}")

    from kvmap.run.config import ReplayConfig
    from kvmap.run.replay import replay
    from kvmap.run.result import MAPPING_PHASES
    from kvmap.trace import Trace

    trace = args.trace if not cpu else str(ROOT / "traces" / "chunked_prefill.jsonl")
    rows = []
    for backend, device in (("numba", "cpu"), ("torch", args.device), ("triton", args.device)):
        replay(Trace(trace), ReplayConfig(backend=backend, device=device, nvtx=False, warmup=5))  # compile, warm caches
        r = replay(Trace(trace), ReplayConfig(backend=backend, device=device, nvtx=False, warmup=5))
        m = r.measured()
        mi = [r.phases.index(p) for p in MAPPING_PHASES + ("h2d",) if p in r.phases]
        dev = r.device_phase_ns[r.warmup:] if r.device_phase_ns.size else None
        rows.append((backend, device, float(np.median(m.sum(1))) / 1e3, float(np.median(m[:, mi].sum(1))) / 1e3,
                     float(np.median(dev[:, mi].sum(1))) / 1e3 if dev is not None else float("nan"),
                     r.h2d_bytes / max(r.steps_replayed, 1)))
    print(f"\nreplay of {Path(trace).name}: median per step (us); 'mapping' = h2d + batch order + inputs + block "
          "tables + slots")
    print(f"{'backend':<8} {'device':<7} {'host step':>10} {'host mapping':>13} {'device mapping':>15} "
          f"{'H2D B/step':>11}")
    for b, d, step, hm, dm, h2d in rows:
        print(f"{b:<8} {d:<7} {step:>10.1f} {hm:>13.1f} {dm:>15.1f} {h2d:>11.0f}")

    # synthetic batches through the device workers' mapping phases
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench as Bm

    from kvmap.workers.registry import make_worker

    sizes = [int(x) for x in args.sizes.split(",")] if not cpu else [8]
    rng, tok, bt, nc0 = Bm.synthetic()
    header = Bm.make_header(1024 * 512)
    print(f"\nsynthetic steps ({args.steps if not cpu else 5} per size): median us per step, host (launch) and device "
          "(CUDA events), mapping phases only")
    print(f"{'B':>5} {'tokens':>7} | " + " | ".join(f"{b:^23}" for b in ("numba host", "torch host/device",
                                                                           "triton host/device")))
    workers = {}
    for b in ("numba", "torch", "triton"):
        w = make_worker(b, header, "cpu" if b == "numba" else args.device)
        st = w.state
        st.token_ids[:, :Bm.MAX_MODEL_LEN] = tok
        st.block_tables[0][:, :Bm.MAX_BLOCKS] = bt
        st.num_computed_tokens[:] = nc0
        st.num_blocks[0, :] = np.minimum(-(-(nc0 + 512) // Bm.BS), Bm.MAX_BLOCKS)
        if w.has_h2d:
            w.upload_state()
        workers[b] = w
    for B in sizes:
        steps = Bm.make_steps(rng, nc0, B)
        line = f"{B:>5} {int(np.median([sum(c) for _, c in steps])):>7} |"
        for b, w in workers.items():
            host, devt = [], []
            n = args.steps if not cpu else 5
            for i in range(n + 10):
                r_, c_ = steps[i % len(steps)]
                t0 = time.perf_counter_ns()
                if w.has_h2d and not cpu:
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                w.schedule(r_, c_)
                w.mapping_phases()
                t1 = time.perf_counter_ns()
                if w.has_h2d and not cpu:
                    e1.record()
                    e1.synchronize()
                    d = e0.elapsed_time(e1) * 1e3
                else:
                    d = float("nan")
                if i >= 10:
                    host.append((t1 - t0) / 1e3)
                    devt.append(d)
            cell = f"{np.median(host):8.1f}" + ("" if b == "numba" else f" / {np.median(devt):8.1f}")
            line += f" {cell:^23} |"
        print(line)

    print()
    for line in vllm_section(args.device, args.trace):
        print(line)


if __name__ == "__main__":
    main()
