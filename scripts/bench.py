"""Benchmark kvmap's mapping path against a faithful V1-style numpy baseline, in the same run.

    python scripts/bench.py [--reps 200] [--json out.json] [--trace traces/long_mixed.jsonl.gz]
    python scripts/bench.py --forward [--replay-runs 1]   # part 2 only, with the forward phase
    python scripts/bench.py --forward --cudagraph-mode FULL_AND_PIECEWISE --attention-backend FLASHINFER

`--forward` runs only part 2, each replay with the forward pass's other inputs (`replay --forward`: the
`prepare_forward` phase, kvmap/forward), and reports that phase's median against the four mapping phases'
(issue 26's floor: at most as much). The forward-pass overrides of `kvmap replay` apply
(`--attention-backend`, `--cudagraph-mode`, `--cudagraph-capture-sizes`; without sizes a graph mode gets vLLM's
default sizes for the trace's limits).

Part 1, synthetic steps (perf-facts.md section 4): 1024 request rows, token rows of 8192, block-table rows of
512, block size 16, histories of 100-4000 tokens; each step takes B distinct rows in random order, 10% of them
prefill chunks of 64-512 tokens, the rest 1-token decodes; 64 different steps are cycled. The timed region goes
from the scheduler's Python lists (rows, tokens per request) to finished arrays (idx_mapping, query_start_loc,
seq_lens, positions, input_ids, batch block table, slot_mapping). Implementations alternate step by step after
a warm-up; every output is checked identical before timing.

Part 3 (scripts/bench_process.py, run as a child): the whole process, `kvmap replay` against a V1-style
baseline replayer process, on the long trace and one 10x longer; start-up alone; the first run with an empty
numba cache.

Part 2, the bundled long trace replayed by kvmap's loop: with each kvmap worker, and with kvmap's default
(numba) worker whose mapping phases are the baseline's code, writing into the same buffers (KV write on, KV
verify off). Medians per step.

The baseline is vLLM's V1 runner before #32951 (positions, token gather and slot mapping in numpy on the CPU):
`req_indices = np.repeat(arange, counts)`, per-token offsets by the cumsum trick, `np.take` from the flattened
token buffer, a gather of the batch's full block-table rows, and the slot from the flattened batch table.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvmap.trace import KVCacheGroup, Trace, TraceHeader  # noqa: E402
from kvmap.workers.host import HostWorker  # noqa: E402
from kvmap.workers.numba_worker import NumbaOps  # noqa: E402
from kvmap.workers.registry import make_worker  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_process import longer_trace  # noqa: E402
from example_backend import V1Baseline, V1StyleOps, own_buffers  # noqa: E402

ROWS, MAX_MODEL_LEN, BS = 1024, 8192, 16
MAX_BLOCKS = MAX_MODEL_LEN // BS  # 512


# ------------------------------------------------------------------------------------------- kvmap


def make_header(max_tokens: int) -> TraceHeader:
    return TraceHeader(model_runner_protocol="v2", block_size=BS, num_gpu_blocks=ROWS * MAX_BLOCKS,
                       kv_cache_groups=(KVCacheGroup(0, "full_attention", BS),), max_num_seqs=ROWS,
                       max_num_batched_tokens=max_tokens, max_model_len=MAX_MODEL_LEN)


class KvmapMappings:
    """kvmap's mapping phases (batch order, inputs, block tables, slots) over a WorkerState, run by one of
    its workers (numba, numpy, torch): exactly the calls the replay loop makes."""

    def __init__(self, worker) -> None:
        self.w = worker

    def upload(self) -> None:
        """Device workers: the synthetic state was written straight into the host arrays; send it once."""
        if self.w.has_h2d:
            self.w.upload_state()

    def step(self, rows_list: list[int], counts_list: list[int], req_ids: list[str] | None = None) -> int:
        w = self.w
        w.schedule(rows_list, counts_list, req_ids)
        w.mapping_phases()
        w.synchronize()  # device work is asynchronous: time it to completion
        return w.batch.num_tokens


def synthetic(seed: int = 0):
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, 32000, size=(ROWS, MAX_MODEL_LEN), dtype=np.int32)
    num_computed = rng.integers(100, 4000, size=ROWS, dtype=np.int32)
    block_table = rng.permutation(ROWS * MAX_BLOCKS).astype(np.int32).reshape(ROWS, MAX_BLOCKS)
    return rng, token_ids, block_table, num_computed


def make_steps(rng, num_computed, B: int, n: int = 64) -> list[tuple[list[int], list[int]]]:
    steps = []
    for _ in range(n):
        rows = rng.choice(ROWS, size=B, replace=False)
        counts = np.ones(B, dtype=np.int64)
        k = max(1, round(0.1 * B))
        counts[rng.choice(B, size=k, replace=False)] = rng.integers(64, 513, size=k)
        # keep every request inside its row: num_computed + count <= max_model_len
        counts = np.minimum(counts, MAX_MODEL_LEN - num_computed[rows])
        steps.append((rows.tolist(), counts.tolist()))
    return steps


def check_same(base: V1Baseline, kv: KvmapMappings, rows: list[int], counts: list[int]) -> None:
    order = np.argsort(np.array(counts), kind="stable")
    r2 = [rows[i] for i in order]
    c2 = [counts[i] for i in order]
    T = base.step(r2, c2)
    T2 = kv.step(rows, counts, req_ids=[str(r) for r in rows])
    B = len(rows)
    assert T == T2
    m, o = kv.w.mappings(), base.out
    assert np.array_equal(m.idx_mapping, o.idx_mapping[:B])
    assert np.array_equal(m.query_start_loc, o.query_start_loc[: B + 1])
    assert np.array_equal(m.seq_lens, o.seq_lens[:B])
    assert np.array_equal(m.positions, o.positions[:T])
    assert np.array_equal(m.input_ids, o.input_ids[:T])
    assert np.array_equal(m.slot_mapping[0], o.slot_mapping[0, :T])
    for i in range(B):
        nb = int(m.num_blocks[0, i])
        assert np.array_equal(m.block_tables[0][i, :nb], o.block_tables[0][i, :nb])


def stats(ns: np.ndarray, tokens: np.ndarray) -> dict:
    p10, p50, p90 = np.percentile(ns, [10, 50, 90])
    return {"median_us": p50 / 1e3, "p10_us": p10 / 1e3, "p90_us": p90 / 1e3,
            "ns_per_token": float(np.median(ns / tokens)), "n": int(len(ns))}


def bench_synthetic(reps: int, sizes: list[int], backends: list[str]) -> list[dict]:
    rng, token_ids, block_table, num_computed = synthetic()
    max_tokens = 1024 * 512
    header = make_header(max_tokens)
    kvs = {}
    for name in backends:
        w = make_worker(name, header)
        st = w.state
        st.token_ids[:, :MAX_MODEL_LEN] = token_ids
        st.block_tables[0][:, :MAX_BLOCKS] = block_table
        st.num_computed_tokens[:] = num_computed
        # a realistic row holds the blocks for its history plus its largest chunk
        st.num_blocks[0, :] = np.minimum(-(-(num_computed + 512) // BS), MAX_BLOCKS)
        kvs[f"kvmap_{name}"] = KvmapMappings(w)
        kvs[f"kvmap_{name}"].upload()
    base = V1Baseline(token_ids, [block_table], [BS], num_computed, own_buffers([block_table], max_tokens))
    out = []
    for B in sizes:
        steps = make_steps(rng, num_computed, B)
        for kv in kvs.values():
            for rows, counts in steps[:5]:
                check_same(base, kv, rows, counts)
        impls = {"v1_baseline": base.step, **{k: kv.step for k, kv in kvs.items()}}
        times = {k: [] for k in impls}
        toks = []
        clock = time.perf_counter_ns
        gc.disable()
        names = list(impls)
        for i in range(reps + 20):  # the first 20 are warm-up
            rows, counts = steps[i % len(steps)]
            for name in names[i % len(names):] + names[: i % len(names)]:  # rotate who goes first
                fn = impls[name]
                t0 = clock()
                T = fn(rows, counts)
                dt = clock() - t0
                if i >= 20:
                    times[name].append(dt)
            if i >= 20:
                toks.append(T)
        gc.enable()
        tk = np.array(toks, dtype=np.float64)
        row = {"batch_size": B, "tokens_per_step": float(np.median(tk))}
        for name, ts in times.items():
            row[name] = stats(np.array(ts, dtype=np.float64), tk)
        for k in kvs:
            row[k]["speedup"] = row["v1_baseline"]["median_us"] / row[k]["median_us"]
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------- whole replay


class BaselineOps(V1StyleOps):
    """The V1-style example backend's batch order (MRV2's, numpy) and mapping phases, with the default (numba)
    backend's compiled state updates and KV write: the two workers differ in the mapping code only."""

    def __init__(self, state, buffers, device: str = "cpu") -> None:
        super().__init__(state, buffers, device)
        self.numba = NumbaOps(state, buffers, device)  # installs the compiled state updates
        self.detail = self.numba.detail

    def new_kv_cache(self, geometry):
        return self.numba.new_kv_cache(geometry)

    def write_kv(self, worker, kv) -> None:
        self.numba.write_kv(worker, kv)

    def verify_kv(self, worker, kv, into) -> None:
        self.numba.verify_kv(worker, kv, into)


class BaselineWorker(HostWorker):
    """kvmap's default worker (the same state update, KV write and post-update) with the mapping phases of the
    V1-style example backend."""

    name = "v1_baseline"
    ops_class = BaselineOps


def bench_replay(trace_path: Path, runs: int, backends: list[str], args_device: str = "cpu",
                 forward: bool = False, overrides: dict | None = None) -> dict:
    from kvmap.run.config import ReplayConfig
    from kvmap.run.replay import replay
    from kvmap.run.result import MAPPING_PHASES

    header = Trace(trace_path).header
    makers = {"v1_baseline": lambda: BaselineWorker(header),
              **{b: (lambda b=b: make_worker(b, header, args_device)) for b in backends}}
    results: dict[str, list] = {k: [] for k in makers}
    names = list(makers)
    dumps: dict[str, list] = {name: [] for name in names}  # an untimed pass first: every worker agrees
    for name in names:
        replay(Trace(trace_path), ReplayConfig(nvtx=False, forward=forward, **(overrides or {})), worker=makers[name](),
               on_mappings=dumps[name].append)
    for name, d in dumps.items():
        assert d == dumps["v1_baseline"], f"{name} and the baseline worker disagree on the trace"
    dumps.clear()
    for i in range(runs):
        for name in names[i % len(names):] + names[: i % len(names)]:
            results[name].append(replay(Trace(trace_path), ReplayConfig(nvtx=False, warmup=20, forward=forward,
                                                                        **(overrides or {})),
                                        worker=makers[name]()))
    out = {"trace": str(trace_path), "runs": runs, "steps": results[names[0]][0].steps_replayed, "phases": {}}
    for name, rs in results.items():
        m = np.concatenate([r.measured() for r in rs])
        phases = rs[0].phases
        mi = [phases.index(p) for p in MAPPING_PHASES]
        out["phases"][name] = {p: float(np.median(m[:, j])) / 1e3 for j, p in enumerate(phases)}
        out["phases"][name]["mappings"] = float(np.median(m[:, mi].sum(axis=1))) / 1e3
        out["phases"][name]["step"] = float(np.median(m.sum(axis=1))) / 1e3
        out["phases"][name]["step (mean)"] = float(np.mean(m.sum(axis=1))) / 1e3  # long prompts weigh here
    out["orjson_loads_us"] = orjson_per_line(trace_path)
    return out


def orjson_per_line(trace_path: Path, passes: int = 3) -> float:
    """The yardstick for read_step, measured in the same run: `orjson.loads` of each step line alone (the line
    already in memory; no checks, no state), median over the lines, the best of `passes`."""
    import gzip

    import orjson

    data = Path(trace_path).read_bytes()
    lines = (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).splitlines()[1:]
    clock = time.perf_counter_ns

    def one_pass() -> float:
        ns = []
        for line in lines:
            t0 = clock()
            orjson.loads(line)
            ns.append(clock() - t0)
        return float(np.median(ns)) / 1e3

    return min(one_pass() for _ in range(passes))


# ------------------------------------------------------------------------------------------- memory, start-up


def peak_rss_mib(args: list[str]) -> float:
    """Peak RSS of `python -m kvmap ARGS` run in a fresh child."""
    import subprocess

    code = ("import resource, subprocess, sys; subprocess.run([sys.executable, '-m', 'kvmap', *sys.argv[1:]], "
            "check=True, stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True)
    return int(out.stdout.strip()) / 1024


def startup_ms(args: list[str], runs: int = 11) -> float:
    import shutil
    import subprocess

    exe = shutil.which("kvmap") or sys.executable
    cmd = [exe, *args] if exe != sys.executable else [exe, "-m", "kvmap", *args]
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts[1:])) * 1e3


def bench_memory(trace: Path) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        long10 = Path(tmp) / "x10.jsonl.gz"
        steps10 = longer_trace(trace, long10, 10)  # the same 10x trace the whole-process benchmark uses
        base = ["replay", "--no-progress", "--quiet", "--no-nvtx"]
        short = peak_rss_mib(base + [str(trace)])
        longer = peak_rss_mib(base + [str(long10)])
    small = str(Path(__file__).resolve().parent.parent / "traces" / "worked_example.jsonl")
    return {"trace_steps": steps10 // 10, "x10_steps": steps10, "peak_rss_mib": short, "x10_peak_rss_mib": longer,
            "rss_growth": longer / short - 1, "help_ms": startup_ms(["--help"]),
            "validate_small_ms": startup_ms(["validate", small])}


# ------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300, help="timed steps per batch size and implementation")
    ap.add_argument("--sizes", default="8,64,256,1024")
    ap.add_argument("--backends", default="numba,numpy,torch",
                    help="kvmap workers to time (default: the host ones and torch on CPU; triton on CPU runs "
                         "under the interpreter, useless for timing)")
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parent.parent / "traces" / "long_mixed.jsonl.gz"))
    ap.add_argument("--replay-runs", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-RSS and start-up checks")
    ap.add_argument("--process-runs", type=int, default=7,
                    help="runs per command of the whole-process benchmark (scripts/bench_process.py); 0 skips it")
    ap.add_argument("--forward", action="store_true",
                    help="only the whole replay, with the forward phase (prepare_forward) against the mapping phases")
    ap.add_argument("--attention-backend", help="--forward: as `kvmap replay --attention-backend`")
    ap.add_argument("--cudagraph-mode", help="--forward: as `kvmap replay --cudagraph-mode`")
    ap.add_argument("--cudagraph-capture-sizes", help="--forward: comma-separated (default: vLLM's defaults)")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    if args.forward:
        bench_forward(Path(args.trace), args.replay_runs, [b for b in args.backends.split(",") if b], args.json_out,
                      forward_overrides(Path(args.trace), args))
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    backends = [b for b in args.backends.split(",") if b]
    syn = bench_synthetic(args.reps, sizes, backends)
    impls = ["v1_baseline"] + [f"kvmap_{b}" for b in backends]
    print(f"mappings per step, synthetic: median us [p10-p90], ns per token, speed-up over the baseline "
          f"({args.reps} steps per cell, implementations interleaved; outputs checked identical)")
    head = f"{'B':>5} {'tokens':>6}"
    for name in impls:
        head += f" | {name:^30}"
    print(head)
    for r in syn:
        line = f"{r['batch_size']:>5} {r['tokens_per_step']:>6.0f}"
        for name in impls:
            a = r[name]
            sp = f" {a['speedup']:.2f}x" if "speedup" in a else "      "
            line += (f" | {a['median_us']:>6.1f} [{a['p10_us']:>4.0f}-{a['p90_us']:<4.0f}] "
                     f"{a['ns_per_token']:>5.1f}ns{sp}")
        print(line)
    rep = bench_replay(Path(args.trace), args.replay_runs, backends) if args.replay_runs else None
    if rep:
        print(f"\nwhole replay of {Path(rep['trace']).name} ({rep['steps']} steps, {rep['runs']} runs each, "
              "KV write on, verify off): median us per step (and the mean step); ratio = baseline / kvmap")
        cols = list(rep["phases"])
        print(f"{'phase':<16}" + "".join(f" {c:>12}" for c in cols) + "".join(f" {'ratio ' + c:>14}" for c in cols[1:]))
        base = rep["phases"]["v1_baseline"]
        totals = ["mappings", "step", "step (mean)"]
        names = list(dict.fromkeys(p for c in cols for p in rep["phases"][c] if p not in totals))
        for p in names + totals:
            vals = [rep["phases"][c].get(p) for c in cols]
            row = f"{p:<16}" + "".join(f" {v:>12.1f}" if v is not None else f" {'-':>12}" for v in vals)
            row += "".join(f" {base[p] / v:>13.2f}x" if (v and p in base) else f" {'-':>14}" for v in vals[1:])
            print(row)
        ref = rep["orjson_loads_us"]
        print(f"yardstick: orjson.loads of a line alone (in memory; no checks, no state) {ref:.1f} us median; "
              "read_step / it: " + ", ".join(f"{c} {rep['phases'][c]['read_step'] / ref:.2f}x" for c in cols))
    mem = None if args.no_memory else bench_memory(Path(args.trace))
    if mem:
        print(f"\nmemory and start-up: peak RSS replaying {mem['trace_steps']} steps {mem['peak_rss_mib']:.0f} MiB, "
              f"{mem['x10_steps']} steps (10x) {mem['x10_peak_rss_mib']:.0f} MiB ({mem['rss_growth']:+.1%}); "
              f"`kvmap --help` {mem['help_ms']:.0f} ms, `kvmap validate` on the worked example "
              f"{mem['validate_small_ms']:.0f} ms (medians of 10)")
    proc = bench_process(args.trace, args.process_runs) if args.process_runs else None
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"machine": {"python": platform.python_version(),
                                                               "numpy": np.__version__,
                                                               "processor": platform.processor()},
                                                   "synthetic": syn, "replay": rep, "memory": mem,
                                                   "process": proc}, indent=1))


def forward_overrides(trace: Path, args) -> dict:
    """The replay's forward-pass overrides; a graph mode without sizes gets vLLM's default sizes."""
    from kvmap.forward.cudagraph import default_capture_sizes

    sizes = args.cudagraph_capture_sizes
    if args.cudagraph_mode not in (None, "NONE") and sizes is None:
        h = Trace(trace).header
        sizes = ",".join(map(str, default_capture_sizes(h.max_num_seqs, h.max_num_batched_tokens,
                                                        h.num_speculative_tokens)))
    return {"attention_backend": args.attention_backend, "cudagraph_mode": args.cudagraph_mode,
            "cudagraph_capture_sizes": sizes}


def bench_forward(trace: Path, runs: int, backends: list[str], json_out: str | None,
                  overrides: dict | None = None) -> dict:
    """Part 2 with `--forward`: each worker's median prepare_forward against its four mapping phases together."""
    rep = bench_replay(trace, runs, backends, forward=True, overrides=overrides)
    said = ", ".join(f"{k} {v if k != 'cudagraph_capture_sizes' else str(v)[:20] + '...'}"
                     for k, v in (overrides or {}).items() if v)
    print(f"whole replay of {trace.name} with --forward ({rep['steps']} steps, {runs} run(s) each, KV write on"
          f"{'; ' + said if said else ''}): median us per step")
    print(f"{'worker':<14} {'mappings':>10} {'prepare_forward':>16} {'forward / mappings':>19} {'step':>8}")
    for name, ph in rep["phases"].items():
        print(f"{name:<14} {ph['mappings']:>10.1f} {ph['prepare_forward']:>16.1f} "
              f"{ph['prepare_forward'] / ph['mappings']:>18.2f}x {ph['step']:>8.1f}")
    if json_out:
        Path(json_out).write_text(json.dumps({"replay_forward": rep}, indent=1))
    return rep


def bench_process(trace: str, runs: int) -> dict:
    """scripts/bench_process.py in a child (it knows nothing of kvmap's internals); its tables pass through."""
    import subprocess
    import tempfile

    print()
    sys.stdout.flush()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "process.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "bench_process.py"), "--trace", trace,
                        "--runs", str(runs), "--json", str(out)], check=True)
        return json.loads(out.read_text())


if __name__ == "__main__":
    main()
