"""A real multi-process replay on torch.distributed: one process per rank, as vLLM runs its workers.

    torchrun --standalone --nproc-per-node 2 -m kvmap.run.distributed traces/dcp2.jsonl --dump-mappings d.jsonl
    kvmap replay traces/dcp2.jsonl --nproc 2          # the same, launched for you

Rules:
- Rank 0 reads the trace; every step is broadcast to all ranks (`broadcast_object_list`, a pickled `Step`, as
  vLLM's executor broadcasts `SchedulerOutput` to its workers), timed as its own phase `broadcast`. The header
  is broadcast once before the first step; no other rank opens the trace.
- Every rank keeps its own worker state and its own KV shard; DCP rank = global rank % cp (consecutive ranks
  form a DCP group, as vLLM's `decode_context_model_parallel` group); world sizes above cp are TP replicas with
  identical mappings (their KV shards hold their share of the heads).
- Cross-rank invariants are checked with collectives after every step (phase `cross_rank`): every token is
  local on exactly one rank of its DCP group (state groups: on none), the block-table rows are identical on
  every rank, and the local lengths sum to `seq_len`. A violation raises a `KvmapError` naming step, request
  and rank on every rank (all ranks see the same reduced values, so none is left waiting).
- The dump is written by rank 0 from the ranks of DCP group 0, gathered every step: byte-identical to the
  one-process emulation (`kvmap replay` without `--nproc`).
- gloo on CPU, NCCL when `--device cuda`; launched by `torchrun`, or by `launch` (`kvmap replay --nproc N`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import zlib
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from kvmap.errors import KvmapError
from kvmap.workers.mappings import dump_line


class _Trace:
    """What `replay` needs of a trace on a rank that never opens it: the broadcast header and a name."""

    def __init__(self, header, name: str) -> None:
        self.header, self.name = header, name

    def steps(self, start: int = 0, stop: int | None = None):
        return iter(())


class BroadcastSource:
    """Rank 0 reads each step from the trace, every rank receives it (`replay`'s `StepSource`)."""

    def __init__(self, dist, rank: int, steps, device=None) -> None:
        self.dist, self.rank, self.steps, self.device = dist, rank, steps, device

    def read(self) -> object:
        return next(self.steps, None) if self.rank == 0 else None

    def broadcast(self, obj: object):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]


class CrossRankCheck:
    """The per-step cross-rank invariants, with collectives (`replay`'s `cross_rank`)."""

    def __init__(self, dist, torch, rank: int, dcp_rank: int, dcp_group, header, device) -> None:
        self.dist, self.t, self.rank, self.dcp_rank = dist, torch, rank, dcp_rank
        self.group, self.header, self.device = dcp_group, header, device
        self.kv_groups = [g for g, grp in enumerate(header.kv_cache_groups) if grp.uses_slot_mapping]
        self.checks = 0

    def _tensor(self, a: np.ndarray):
        return self.t.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def __call__(self, worker) -> None:
        dist = self.dist
        m = worker.mappings()
        step = worker.current_step
        # 1. block-table rows identical on every rank: a CRC of (num_blocks, rows), min == max over the world
        crc = 0
        for table, nb in zip(m.block_tables, m.num_blocks):
            crc = zlib.crc32(np.ascontiguousarray(nb).tobytes(), crc)
            for b in range(len(nb)):
                crc = zlib.crc32(np.ascontiguousarray(table[b, : nb[b]]).tobytes(), crc)
        h = self._tensor(np.array([crc, -crc], dtype=np.int64))
        dist.all_reduce(h, op=dist.ReduceOp.MAX)
        if int(h[0]) != -int(h[1]):
            raise KvmapError(f"block-table rows differ between ranks at step {step} (rank {self.rank} has CRC "
                             f"{crc:#x})", step=step, field="block_tables")
        cp = self.header.decode_context_parallel_size
        if cp == 1:
            return
        # 2. every token local on exactly one DCP rank (state groups: on none)
        T = m.num_tokens
        slots = m.rank_slot_mapping[0]  # [G, T] this rank's
        local = self._tensor((slots >= 0).astype(np.int32))
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.group)
        want = np.zeros((len(slots), T), dtype=np.int32)
        want[self.kv_groups] = 1
        bad = np.argwhere(local.cpu().numpy() != want)
        if len(bad):
            g, tok = (int(x) for x in bad[0])
            b = int(np.searchsorted(m.query_start_loc, tok, side="right")) - 1
            n = int(local.cpu().numpy()[g, tok])
            raise KvmapError(f"position {int(m.positions[tok])} is local on {n} DCP ranks, not "
                             f"{int(want[g, tok])} (this is rank {self.dcp_rank}, its slot {int(slots[g, tok])})",
                             step=step, req_id=m.req_ids[b], group=g, field="slot_mapping")
        # 3. the local lengths sum to seq_len
        lens = self._tensor(m.dcp_local_seq_lens[0].astype(np.int64))
        dist.all_reduce(lens, op=dist.ReduceOp.SUM, group=self.group)
        diff = np.flatnonzero(lens.cpu().numpy() != m.seq_lens)
        if len(diff):
            b = int(diff[0])
            raise KvmapError(f"dcp_local_seq_lens sum to {int(lens[b])} over the ranks, seq_len is "
                             f"{int(m.seq_lens[b])} (rank {self.dcp_rank} has {int(m.dcp_local_seq_lens[0, b])})",
                             step=step, req_id=m.req_ids[b], field="dcp_local_seq_lens")
        self.checks += 1


def run(args: argparse.Namespace) -> None:
    """One rank's replay (inside torchrun)."""
    _die_with_parent(signal.SIGKILL)  # torchrun gone (killed with kvmap): this rank goes too
    import torch
    import torch.distributed as dist

    from kvmap.files import write_json
    from kvmap.kv.cache import KVGeometry
    from kvmap.run.config import ReplayConfig
    from kvmap.run.replay import replay
    from kvmap.trace import Trace

    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        trace = Trace(args.trace) if rank == 0 else None
        box = [trace.header if trace else None, trace.name if trace else None]
        dist.broadcast_object_list(box, src=0, device=device)
        header, name = box
        cp = header.decode_context_parallel_size
        if world % cp:
            raise KvmapError(f"{world} processes cannot form DCP groups of {cp}: use a multiple of {cp}",
                             field="--nproc")
        groups = [dist.new_group(list(range(k, k + cp))) for k in range(0, world, cp)]
        dcp_rank, dcp_group = rank % cp, groups[rank // cp]
        source = BroadcastSource(dist, rank, trace.steps(0, args.stop) if trace else None, device)
        check = CrossRankCheck(dist, torch, rank, dcp_rank, dcp_group, header, device)
        dump = open(args.dump_mappings, "w") if (args.dump_mappings and rank == 0) else None

        def on_mappings(d: dict) -> None:  # collective: every rank sends its slots, rank 0 writes the line
            part = (d["slot_mapping"], d.get("dcp_local_seq_lens")) if cp > 1 else None
            parts = [None] * world if rank == 0 else None
            dist.gather_object(part, parts, dst=0)
            if dump is None or d["step"] < args.start:
                return
            if cp > 1:
                d = dict(d)
                d["slot_mapping"] = [parts[r][0][0] for r in range(cp)]
                d["dcp_local_seq_lens"] = [parts[r][1][0] for r in range(cp)]
                d.pop("dcp_ranks", None)
            dump.write(dump_line(d))

        geometry = KVGeometry(args.kv_heads, args.head_size, args.kv_dtype)
        config = ReplayConfig(backend=args.backend, device=str(device) if cuda else "cpu", start=args.start,
                              stop=args.stop, warmup=args.warmup, verify_kv=args.verify_kv, write_kv=not args.no_kv,
                              kv_geometry=geometry, nvtx=False, ranks=[dcp_rank], occupancy_ranks=range(cp),
                              batch_order=args.batch_order,
                              reorder_batch_threshold=args.reorder_threshold)
        result = replay(_Trace(header, name) if trace is None else trace, config, on_mappings=on_mappings,
                        source=source, cross_rank=check)
        if dump is not None:
            dump.close()
        result.world_size = world
        mine = {"rank": rank, "dcp_rank": dcp_rank, "rank_tokens": result.rank_tokens,
                "rank_kv_checked": result.rank_kv_checked, "rank_kv_mismatches": result.rank_kv_mismatches,
                "rank_max_local_seq_len": result.rank_max_local_seq_len, "rank_kv_bytes": result.rank_kv_bytes,
                "kv_checked": result.kv_checked, "kv_mismatches": result.kv_mismatches,
                "kv_examples": result.kv_examples, "cross_rank_checks": check.checks,
                "broadcast_p50_ns": int(np.median(result.measured()[:, result.phases.index("broadcast")]))
                if len(result.measured()) else 0}
        every = [None] * world if rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        if rank == 0 and args.result_json:
            _merge(result, every, cp)
            write_json(args.result_json, result.json_fields())  # streamed, renamed into place when whole
    except KvmapError as e:  # every rank sees the same reduced values: each names itself
        print(f"kvmap: rank {rank}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def _merge(result, every: list[dict], cp: int) -> None:
    """Rank 0's result with every DCP rank's figures (DCP group 0) and every process's KV outcome."""
    first = sorted((x for x in every if x["rank"] < cp), key=lambda x: x["dcp_rank"])
    result.ranks = [x["dcp_rank"] for x in first]
    if cp > 1:
        for key in ("rank_tokens", "rank_kv_checked", "rank_kv_mismatches", "rank_max_local_seq_len",
                    "rank_kv_bytes"):
            setattr(result, key, [v for x in first for v in x[key]])
        result.kv_bytes = sum(result.rank_kv_bytes)  # the one-process KV cache holds every rank's shard
    result.rank_broadcast_p50_ns = [x["broadcast_p50_ns"] for x in first]
    result.kv_checked = sum(x["kv_checked"] for x in every)
    result.kv_mismatches = sum(x["kv_mismatches"] for x in every)
    result.kv_examples = [e for x in every for e in x["kv_examples"]][:20]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvmap.run.distributed", description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--backend", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--verify-kv", action="store_true")
    p.add_argument("--no-kv", action="store_true")
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-size", type=int, default=None)
    p.add_argument("--kv-dtype", default=None)
    p.add_argument("--dump-mappings", default=None)
    p.add_argument("--result-json", default=None)
    p.add_argument("--from-step", dest="start", type=int, default=0)
    p.add_argument("--to-step", dest="stop", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--batch-order", default="mrv2")
    p.add_argument("--reorder-threshold", type=int, default=None)
    a = p.parse_args(argv)
    from kvmap import defaults

    a.kv_heads = a.kv_heads or defaults.KV_HEADS
    a.head_size = a.head_size or defaults.KV_HEAD_SIZE
    a.kv_dtype = a.kv_dtype or defaults.KV_DTYPE
    a.warmup = defaults.WARMUP if a.warmup is None else a.warmup
    return a


def launch(trace: Path, nproc: int, *, backend: str | None = None, device: str = "cpu", verify_kv: bool = False,
           write_kv: bool = True, kv_geometry=None, dump_mappings: Path | None = None, start: int = 0,
           stop: int | None = None, warmup: int | None = None, timeout: float | None = None,
           batch_order: str = "mrv2", reorder_batch_threshold: int | None = None):
    """Run `nproc` ranks with torchrun (`--standalone`: a free port on this machine); returns rank 0's merged
    `ReplayResult`. Refuses ranks that would not fit in memory before starting (`check_ranks_fit`); a failed rank
    is one `KvmapError`, its own located message (`rank_failure`). The dump is staged
    (files.py `staged_output`) and reaches `dump_mappings` only when every rank finished cleanly."""
    from kvmap.files import staged_output
    from kvmap.kv.cache import KVGeometry
    from kvmap.run.result import ReplayResult

    check_ranks_fit(trace, nproc, (kv_geometry or KVGeometry()) if (write_kv or verify_kv) else None)
    with tempfile.TemporaryDirectory(prefix="kvmap-dist-") as tmp, ExitStack() as stack:
        res = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "kvmap.run.distributed", str(trace), "--device", device, "--result-json", str(res),
               "--from-step", str(start), "--batch-order", batch_order]
        if backend:
            cmd += ["--backend", backend]
        if reorder_batch_threshold is not None:
            cmd += ["--reorder-threshold", str(reorder_batch_threshold)]
        if verify_kv:
            cmd.append("--verify-kv")
        if not write_kv:
            cmd.append("--no-kv")
        if kv_geometry is not None:
            cmd += ["--kv-heads", str(kv_geometry.num_kv_heads), "--head-size", str(kv_geometry.head_size),
                    "--kv-dtype", kv_geometry.dtype]
        if dump_mappings:
            cmd += ["--dump-mappings", str(stack.enter_context(staged_output(dump_mappings)))]
        if stop is not None:
            cmd += ["--to-step", str(stop)]
        if warmup is not None:
            cmd += ["--warmup", str(warmup)]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        code, output = _run_torchrun(cmd, env, timeout)
        if code or not res.exists():
            raise rank_failure(code, output)
        return ReplayResult.from_json(json.loads(res.read_text()))


RANK_BASE_BYTES = 256 * 2**20  # a rank's process before its worker: Python, torch and gloo (torchrun: one more)


def check_ranks_fit(trace: Path, nproc: int, kv_geometry) -> None:
    """Refuse `--nproc N` before any process starts when N ranks (each a process with its worker's arrays and its
    KV shard, `kv_geometry` None: no KV cache) and torchrun would not fit in the memory left (header.py's
    `HEADROOM` share of `available_memory`), naming the option, the estimate and what is available."""
    from kvmap.trace import header as hdr
    from kvmap.trace import open_trace

    h = open_trace(trace).header
    per_rank = RANK_BASE_BYTES + sum(n for _, n in hdr.worker_memory(h))
    if kv_geometry is not None:  # each rank holds its DCP shard of the pool
        kv = sum(n for _, n in hdr.kv_memory(h, kv_geometry.bytes_per_token + 1))
        per_rank += -(-kv // h.decode_context_parallel_size)
    need = (nproc + 1) * RANK_BASE_BYTES + nproc * (per_rank - RANK_BASE_BYTES)
    have, what = hdr.available_memory()
    if need > hdr.HEADROOM * have:
        raise KvmapError(f"{nproc} ranks need about {hdr._gib(need)} ({hdr._gib(per_rank)} per rank: its process, "
                         f"worker arrays and KV shard; and torchrun); {hdr._gib(have)} is the {what}: use fewer "
                         "processes", field="--nproc")


_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)", re.S)


def _how(code: int) -> str:
    """An exit status as words: "killed by signal 9 (SIGKILL)", "exit code 1"."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"killed by signal {-code}"


def rank_failure(code: int, output: str) -> KvmapError:
    """torchrun's failure as one line, never its failure table: the located message of the first rank that named
    itself (`kvmap: rank R: WHERE: WHAT`, every rank that raised a `KvmapError`), once; else the rank torchrun
    names as the root cause and how it ended (a signal: the OOM killer, a crash), with the last error line a
    Python traceback left; else torchrun's own end (killed: its status)."""
    lines = output.strip().splitlines()
    ours = sorted({(int(m[2]), m[1]) for x in lines if (m := re.search(r"kvmap: (rank (\d+): .*)", x))})
    if ours:
        return KvmapError(ours[0][1])
    if m := _ROOT_CAUSE.search(output):
        errors = [x.strip() for x in lines if re.match(r"[A-Za-z_.]*(Error|Exception|Interrupt)\b", x.strip())
                  and "ChildFailedError" not in x]  # torchrun's own
        last = f": {errors[0]}" if errors and int(m[2]) >= 0 else ""
        return KvmapError(f"rank {m[1]} (pid {m[3]}) failed, {_how(int(m[2]))}{last}; the other ranks were "
                          "stopped", field="--nproc")
    if code < 0:
        return KvmapError(f"torchrun, which runs the ranks, was {_how(code)}", field="--nproc")
    tail = "; ".join(lines[-12:])  # one line: the error stays one line
    return KvmapError(f"the distributed replay failed (exit {code}): {tail}", field="--nproc")


def _run_torchrun(cmd: list[str], env: dict, timeout: float | None) -> tuple[int, str]:
    """(exit code, stderr or stdout) of torchrun, which dies with this process: on any exception or signal
    here (Ctrl-C, SIGTERM, SIGHUP, a timeout) it is sent SIGTERM, then SIGKILL after `STOP_GRACE_S`; on this
    process's death it gets SIGTERM from the kernel (PR_SET_PDEATHSIG). Its ranks, each in a session of its
    own, set the same link to torchrun (`_die_with_parent`)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: _die_with_parent(signal.SIGTERM))
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:
        p.terminate()
        try:
            p.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        raise
    return p.returncode, err or out


STOP_GRACE_S = 5.0  # seconds torchrun gets to stop its ranks before SIGKILL (the kernel then kills the ranks)


def _die_with_parent(sig: int) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (PR_SET_PDEATHSIG); if the parent is gone
    already (this process was adopted), exit now. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(128 + int(sig))


def main(argv: list[str] | None = None) -> None:
    try:
        run(parse_args(argv))
    except KvmapError as e:
        print(f"kvmap: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
