"""The whole process: `kvmap replay` as a user runs it, against a V1-style baseline replayer process.

    python scripts/bench_process.py [--runs 7] [--json out.json] [--trace traces/long_mixed.jsonl.gz]

What a user waits for is the process: start-up (imports, loading compiled kernels), reading and decoding
the trace, every step, the summary. This script times exactly that, from outside, with no kvmap internals:

1. `python -m kvmap replay TRACE` (default backend, KV write on, summary printed to a pipe) against
   `python BASELINE TRACE`, a V1-style replayer written below: the same parse (orjson, gzip), persistent numpy
   state (request rows, token rows, block-table rows; V1's per-request Python in the state update), V1-style
   numpy mappings (`np.repeat` request indices, the cumsum trick, a gather of full block-table rows, the slot
   from the flattened batch table) and a KV canary write into a numpy array of the same layout. Runs
   alternate (kvmap, baseline, baseline, kvmap, ...); medians. On the bundled long trace and on one 10x
   longer (the long trace concatenated, request ids suffixed per copy, steps renumbered: still valid).
   Beside them `(decode only)`: a process that starts Python, imports numpy and orjson.loads every line, and
   does nothing else; baseline / it bounds the speed-up of any replayer that decodes with a JSON library.
2. Start-up alone: `kvmap --help`, `kvmap replay` of the worked example, `kvmap validate` of it.
3. The first run with an empty numba cache (`NUMBA_CACHE_DIR` a fresh folder each run): replay of the worked
   example, with the kernels compiled at install (kvmap.aot: nothing to compile) and under the JIT
   (`KVMAP_AOT=0`: what a run costs where the install could not build them).

The baseline runs with one numba / BLAS / OpenMP thread (perf-facts.md: two threads stall on this 2-core
machine), kvmap with none of those variables set, as a user runs it (it gives OpenBLAS one thread itself).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "traces"

BASELINE = r'''
"""V1-style replayer: orjson parse, persistent numpy state, V1 numpy mappings, numpy KV canary write."""
import gzip, sys
import numpy as np
import orjson

path = sys.argv[1]
f = gzip.open(path, "rb") if open(path, "rb").read(2) == b"\x1f\x8b" else open(path, "rb")
h = orjson.loads(f.readline())
R, L, nb = h["max_num_seqs"], h["max_model_len"], h["num_gpu_blocks"]
k = h.get("num_speculative_tokens") or 0
W = L + k
groups = [g.get("block_size", h["block_size"]) for g in h["kv_cache_groups"]]
G = len(groups)
spec = h.get("kv_cache_spec") or {}
H, D = spec.get("num_kv_heads") or 1, spec.get("head_size") or 8
half = H * D
token_ids = np.zeros((R, W), np.int32)
total_len = np.zeros(R, np.int32)
num_computed = np.zeros(R, np.int32)
maxb = [-(-W // bs) for bs in groups]
tables = [np.zeros((R, m), np.int32) for m in maxb]
num_blocks = np.zeros((G, R), np.int32)
batch_tables = [np.zeros((R, m), np.int32) for m in maxb]
Tmax = max(h["max_num_batched_tokens"], h.get("max_num_scheduled_tokens") or 0)
arange = np.arange(max(Tmax, R + 1), dtype=np.int64)
positions = np.zeros(Tmax, np.int64)
input_ids = np.zeros(Tmax, np.int32)
slot_mapping = np.zeros((G, Tmax), np.int64)
kv = [np.zeros((2, nb * bs, half), np.int16) for bs in groups]  # [2, slots, H*D] bits of a 16-bit dtype
TORCH_KV = len(sys.argv) > 2 and sys.argv[2] == "torch"  # the KV cache as a torch tensor (the issue's baseline)
if TORCH_KV:
    import torch
    torch.set_num_threads(1)
    kv = [torch.zeros((2, nb * bs, half), dtype=torch.int16) for bs in groups]
lane = np.arange(2 * half, dtype=np.uint32) * np.uint32(0xC2B2AE3D)
free = list(range(R))
row_of = {}
v2 = h["model_runner_protocol"] == "v2"
steps = tokens = checksum = 0

def canary(tok, pos):
    x = tok.astype(np.uint32) * np.uint32(0x9E3779B1) ^ pos.astype(np.uint32) * np.uint32(0x85EBCA77)
    x = x[:, None] + lane[None, :]
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x.astype(np.uint16).view(np.int16)

for line in f:
    d = orjson.loads(line)
    so = d["scheduler_output"]
    for r in so.get("finished_req_ids") or ():
        if r in row_of:
            free.append(row_of.pop(r))
    if v2:
        for r in so.get("preempted_req_ids") or ():
            if r in row_of:
                free.append(row_of.pop(r))
    for nr in so["scheduled_new_reqs"]:
        row = free.pop()
        row_of[nr["req_id"]] = row
        toks = nr.get("prefill_token_ids") or nr["prompt_token_ids"]
        token_ids[row, : len(toks)] = toks
        total_len[row] = len(toks)
        num_computed[row] = nr["num_computed_tokens"]
        for g, ids in enumerate(nr["block_ids"]):
            tables[g][row, : len(ids)] = ids
            num_blocks[g, row] = len(ids)
    c = so["scheduled_cached_reqs"]
    resumed = set(c.get("resumed_req_ids") or ())
    all_tok = c.get("all_token_ids") or {}
    for i, r in enumerate(c["req_ids"]):  # V1's _update_states: Python per cached request
        row = row_of[r]
        num_computed[row] = c["num_computed_tokens"][i]
        nbi = c["new_block_ids"][i]
        if nbi is not None:
            for g, ids in enumerate(nbi):
                start = 0 if r in resumed else num_blocks[g, row]
                tables[g][row, start : start + len(ids)] = ids
                num_blocks[g, row] = start + len(ids)
        if r in all_tok:
            toks = all_tok[r]
            token_ids[row, : len(toks)] = toks
            total_len[row] = len(toks)
    nst = so["num_scheduled_tokens"]
    B = len(nst)
    rows = np.fromiter(map(row_of.__getitem__, nst), np.int32, B)
    ns = np.fromiter(nst.values(), np.int32, B)
    for r, drafts in (so.get("scheduled_spec_decode_tokens") or {}).items():
        row = row_of[r]
        end = num_computed[row] + nst[r]
        token_ids[row, end - len(drafts) : end] = [max(t, 0) for t in drafts]
    # V1 mappings: request index per token, the cumsum trick, full block-table rows, the flat batch table
    req_indices = np.repeat(arange[:B], ns)
    cu = np.cumsum(ns)
    T = int(cu[-1]) if B else 0
    nc = num_computed[rows]
    pos = positions[:T]
    np.add(nc[req_indices], arange[:T] - np.repeat(cu - ns, ns), out=pos)
    seq_lens = nc + ns
    np.take(token_ids.ravel(), pos + rows[req_indices].astype(np.int64) * W, out=input_ids[:T])
    for g, bs in enumerate(groups):
        bt = batch_tables[g]
        np.take(tables[g], rows, axis=0, out=bt[:B])
        idx = req_indices * bt.shape[1] + pos // bs
        np.add(bt.ravel()[idx].astype(np.int64) * bs, pos % bs, out=slot_mapping[g, :T])
        # KV canary write: every scheduled token's K and V lanes, through slot_mapping
        vals = canary(input_ids[:T], pos)
        if TORCH_KV:
            sl, v = torch.from_numpy(slot_mapping[g, :T]), torch.from_numpy(vals)
            kv[g][0, sl] = v[:, :half]
            kv[g][1, sl] = v[:, half:]
        else:
            kv[g][0, slot_mapping[g, :T]] = vals[:, :half]
            kv[g][1, slot_mapping[g, :T]] = vals[:, half:]
        checksum += int(slot_mapping[g, :T].sum())
    sampled = d.get("sampled_token_ids") or {}
    for r, toks in sampled.items():  # post-update: append what the model sampled
        row = row_of[r]
        n = total_len[row]
        token_ids[row, n : n + len(toks)] = toks
        total_len[row] = n + len(toks)
    steps += 1
    tokens += T
print(f"baseline: {steps} steps, {tokens} tokens, slot checksum {checksum}")
'''

# What any replayer of the trace pays at least when it decodes with a JSON library: start Python, import numpy,
# inflate the file and orjson.loads each line (orjson: the fastest decoder to Python objects measured here;
# kvmap's msgspec decode is about as fast). baseline / this is the best speed-up such a replayer can reach.
DECODE_ONLY = r'''
import gzip, sys
import numpy  # noqa: F401  (every replayer here keeps its state in numpy)
import orjson

path = sys.argv[1]
f = gzip.open(path, "rb") if open(path, "rb").read(2) == b"\x1f\x8b" else open(path, "rb")
print(sum(1 for line in f if orjson.loads(line) is not None), "lines decoded")
'''


def longer_trace(src: Path, dst: Path, times: int) -> int:
    """`src` repeated `times` times (request ids suffixed per copy, steps renumbered): each copy starts after
    the previous one ended (its last step delivers the finished ids), so the result is a valid trace."""
    op = gzip.open if src.suffix == ".gz" else open
    with op(src, "rt") as f:
        header, *steps = f.read().splitlines()
    n = 0
    with gzip.open(dst, "wt", compresslevel=6) as out:
        out.write(header + "\n")
        for k in range(times):
            for line in steps:
                d = json.loads(line)
                d["step"] = n
                n += 1
                out.write(json.dumps(d, separators=(",", ":")).replace('"req-', f'"r{k}-req-') + "\n")
    return n


DECODE = "(decode only)"
THREAD_VARS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def env(root: Path = ROOT, kvmap: bool = False, **extra: str) -> dict:
    """The environment of one run. The baseline gets one thread for every pool (what it should have on this
    machine); kvmap gets none of these set, as a user runs it (kvmap gives OpenBLAS one thread itself, and its
    kernels run on the calling thread)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(root) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    for k in THREAD_VARS:
        if kvmap:
            e.pop(k, None)
        else:
            e[k] = "1"
    e.update(extra)
    return e


def wall(cmd: list[str], **extra: str) -> float:
    """Wall seconds of one run. A command may start with ("root", DIR): kvmap imported from DIR."""
    root = ROOT
    if cmd[0] == "root":
        root, cmd = Path(cmd[1]), cmd[2:]
    t0 = time.perf_counter()
    # cwd is the checkout too: `python -m` puts the current folder first on sys.path
    kvmap = cmd[1:3] == ["-m", "kvmap"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                   env=env(root, kvmap=kvmap, **extra), cwd=root)
    return time.perf_counter() - t0


def kvmap_cmd(*args: str, root: str | None = None) -> list[str]:
    return (["root", root] if root else []) + [sys.executable, "-m", "kvmap", *args]


def alternate(cmds: dict[str, list[str]], runs: int) -> dict[str, list[float]]:
    """Each command once untimed (warm caches), then `runs` rounds, the order rotating every round."""
    names = list(cmds)
    for n in names:
        wall(cmds[n])
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(runs):
        for n in names[i % len(names):] + names[: i % len(names)]:
            times[n].append(wall(cmds[n]))
    return times


def summary(ts: list[float]) -> dict:
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "runs": len(ts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(TRACES / "long_mixed.jsonl.gz"))
    ap.add_argument("--runs", type=int, default=7, help="timed runs per command (after one untimed)")
    ap.add_argument("--cold-runs", type=int, default=3, help="first runs with an empty numba cache")
    ap.add_argument("--no-x10", action="store_true", help="skip the 10x longer trace")
    ap.add_argument("--also", default="numpy", help="other kvmap backends to run as processes too (comma list; "
                    "'' for none): shown for comparison, the speed-up is the default backend's")
    ap.add_argument("--torch-baseline", action="store_true", help="also the baseline with its KV cache a torch "
                    "tensor (as issue #15 measured it: it imports torch)")
    ap.add_argument("--compare-root", help="another kvmap checkout (e.g. the previous version) to run beside this "
                    "one, alternating, in every table")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    out: dict = {"python": sys.version.split()[0], "whole_process": [], "startup": {}, "first_run": None}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "v1_baseline_replay.py"
        base.write_text(BASELINE)
        decode_only = Path(tmp) / "decode_only.py"
        decode_only.write_text(DECODE_ONLY)
        traces = [Path(args.trace)]
        if not args.no_x10:
            x10 = Path(tmp) / ("x10_" + Path(args.trace).name.replace(".jsonl", "").replace(".gz", "") + ".jsonl.gz")
            longer_trace(Path(args.trace), x10, 10)
            traces.append(x10)
        also = [b for b in args.also.split(",") if b]
        flags = {k: os.environ[k] for k in ("PYTHONDONTWRITEBYTECODE", "KVMAP_AOT") if k in os.environ}
        out["env"] = flags
        if flags:
            print("environment: " + ", ".join(f"{k}={v}" for k, v in flags.items()) + " (inherited by every run)")
        print(f"whole process: `kvmap replay TRACE` (default backend, KV write on, summary to a pipe) against a "
              f"V1-style baseline replayer process; {args.runs} alternating runs each, wall seconds median "
              f"[min-max]; speed-up = baseline / kvmap")
        for tr in traces:
            steps = sum(1 for _ in (gzip.open if tr.suffix == ".gz" else open)(tr, "rb")) - 1
            cmds = {"kvmap": kvmap_cmd("replay", str(tr)),
                    **{f"kvmap -b {b}": kvmap_cmd("replay", str(tr), "-b", b) for b in also},
                    **({"kvmap (compare-root)": kvmap_cmd("replay", str(tr), root=args.compare_root)}
                       if args.compare_root else {}),
                    "baseline": [sys.executable, str(base), str(tr)],
                    DECODE: [sys.executable, str(decode_only), str(tr)]}
            if args.torch_baseline:
                cmds["baseline, torch KV"] = [sys.executable, str(base), str(tr), "torch"]
            ts = alternate(cmds, args.runs)
            row = {"trace": tr.name, "steps": steps, **{n: summary(t) for n, t in ts.items()}}
            row["speedup"] = row["baseline"]["median_s"] / row["kvmap"]["median_s"]
            row["decode_only_bound"] = row["baseline"]["median_s"] / row[DECODE]["median_s"]
            out["whole_process"].append(row)
            print(f"  {tr.name} ({steps} steps)")
            for n in ts:
                r = row[n]
                sp = row["baseline"]["median_s"] / r["median_s"]
                sp_t = (f", {row['baseline, torch KV']['median_s'] / r['median_s']:.2f}x over the torch-KV baseline"
                        if args.torch_baseline and not n.startswith("baseline") else "")
                tail = ("" if n.startswith("baseline") else
                        f"  bound {sp:.2f}x (Python, numpy, orjson.loads of each line: nothing else)" if n == DECODE
                        else f"  speed-up {sp:.2f}x{sp_t}")
                print(f"    {n:<22} {r['median_s']:>7.3f} [{r['min_s']:.3f}-{r['max_s']:.3f}]{tail}")
        small = str(TRACES / "worked_example.jsonl")
        cmds = {"kvmap --help": kvmap_cmd("--help"), "kvmap replay worked_example": kvmap_cmd("replay", small),
                "kvmap validate worked_example": kvmap_cmd("validate", small),
                **({"(compare-root) --help": kvmap_cmd("--help", root=args.compare_root),
                    "(compare-root) replay worked_example": kvmap_cmd("replay", small, root=args.compare_root),
                    "(compare-root) validate worked_example": kvmap_cmd("validate", small, root=args.compare_root)}
                   if args.compare_root else {}),
                # references for how busy the machine is: an empty interpreter, and one that imports numpy
                "(python -c pass)": [sys.executable, "-c", "pass"],
                "(python -c 'import numpy')": [sys.executable, "-c", "import numpy"]}
        ts = alternate(cmds, args.runs)
        print(f"\nstart-up alone ({args.runs} alternating runs each, warm numba cache): wall seconds")
        for n, t in ts.items():
            s = out["startup"][n] = summary(t)
            print(f"  {n:<32} median {s['median_s']:.3f} [{s['min_s']:.3f}-{s['max_s']:.3f}]")
        if args.cold_runs:
            # a fresh NUMBA_CACHE_DIR each run: with the kernels compiled at install there is nothing to compile;
            # under the JIT (KVMAP_AOT=0, as where the install could not build them) every kernel compiles
            roots = {"first run, empty numba cache": (None, {}),
                     "first run, JIT (KVMAP_AOT=0), empty cache": (None, {"KVMAP_AOT": "0"})}
            if args.compare_root:
                roots["(compare-root) first run"] = (args.compare_root, {})
            cold: dict[str, list[float]] = {n: [] for n in roots}
            for _ in range(args.cold_runs):
                for n, (root, extra) in roots.items():
                    with tempfile.TemporaryDirectory() as cache:
                        cold[n].append(wall(kvmap_cmd("replay", small, root=root), NUMBA_CACHE_DIR=cache, **extra))
            out["first_run"] = summary(cold["first run, empty numba cache"])
            for n, t in cold.items():
                s = summary(t)
                if n != "first run, empty numba cache":
                    out["startup"][n] = s
                print(f"  {n:<32} median {s['median_s']:.3f} [{s['min_s']:.3f}-{s['max_s']:.3f}] "
                      f"({args.cold_runs} runs, `kvmap replay` of the worked example)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
