"""The replay loop: stream a trace through a worker and a paged KV cache, timing every phase of every step.

Rules:
- Each phase runs inside one NVTX range and between two `perf_counter_ns` reads; nothing else (progress,
  dumping, rendering) happens inside a timed region.
- Steps before `--steps START` are replayed in full (state and KV cache depend on them); the loop stops at
  END. The measured steps are the window START:END itself; the `warmup` steps just before START are timed
  and recorded but excluded from statistics. A window from 0 has nothing before it: its `warmup` steps are
  replayed first by a throwaway worker and KV cache, untimed (`_prewarm`), unless the caller passed its own
  `worker`, which cannot be warmed apart: then the window's first `warmup` steps are excluded. `result.py`
  `warmup_window` is that one definition; a window that holds no measured step, or a warm-up longer than the
  trace, is a located error naming the option, never a table of zeros.
- Errors from the worker are `TraceError`s; they get the trace's path here and propagate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Protocol

import numpy as np

from kvmap import defaults
from kvmap.errors import KvmapError
from kvmap.kv.cache import KVCheckResult, KVGeometry
from kvmap.ondisk import own_mappings
from kvmap.run.config import ReplayConfig
from kvmap.run.composition import COLUMNS as MIX_COLUMNS
from kvmap.run.composition import Composition
from kvmap.run.markers import Markers
from kvmap.run.occupancy import Occupancy
from kvmap.run.result import PHASES, ReplayResult, empty_window_error, warmup_window
from kvmap.run.steplog import DistinctIds, StepLog
from kvmap.trace import Trace
from kvmap.workers.contract import Worker
from kvmap.workers.registry import make_worker


class StepSource(Protocol):
    """Where a distributed replay's steps come from: rank 0 reads them, every rank receives them."""

    def read(self) -> object: ...  # rank 0: the next step (None at the end); other ranks: None

    def broadcast(self, obj: object): ...  # every rank: the step rank 0 read, or None at the end


def replay(
    trace: Trace,
    config: ReplayConfig = ReplayConfig(),
    *,
    worker: Worker | None = None,
    on_mappings: Callable[[object], None] | None = None,
    on_step: Callable[[int], None] | None = None,
    source: StepSource | None = None,
    cross_rank: Callable[[Worker], None] | None = None,
) -> ReplayResult:
    """Replay `trace` with the settings of `config` (config.py). `worker` (an instance) overrides
    `config.backend`, for benchmarks of other mapping code. `on_mappings(d)` gets every step's mappings as a
    dict, `on_step(step)` every step's index, both outside timed regions. Distributed (run/distributed.py):
    `source` reads (rank 0) and broadcasts each step, timed as `read_step` and `broadcast`; `cross_rank(worker)`
    checks the cross-rank invariants after the step (`cross_rank`)."""
    c = config
    prewarm = c.start == 0 and c.warmup > 0 and worker is None and source is None
    record_from, measure_from = warmup_window(c.start, c.stop, c.warmup, prewarm=prewarm)
    if prewarm:
        _prewarm(trace, c)
    header = trace.header
    fcfg = forward_config(header, c) if c.forward else None
    if worker is None:
        reorder = c.reorder_batch_threshold
        if reorder is None and c.batch_order == "v1":  # the attention backends' own reorder threshold
            reorder = v1_reorder(header, fcfg)
        worker = make_worker(c.backend, header, c.device, c.batch_order, reorder)
    if c.ranks is not None:
        worker.set_ranks(c.ranks)
    if fcfg is not None:
        worker.use_forward(fcfg)
    geometry = (c.kv_geometry or KVGeometry()).check()
    kv = worker.make_kv_cache(geometry) if (c.write_kv or c.verify_kv) else None
    phases = [p for p in PHASES if (p != "kv_verify" or c.verify_kv) and (not p.startswith("kv_") or kv)
              and (p != "h2d" or worker.has_h2d) and (p != "broadcast" or source)
              and (p != "cross_rank" or cross_rank) and (p != "prepare_forward" or c.forward)]
    result = _new_result(trace, worker, kv, geometry, phases, prewarm_steps=c.warmup if prewarm else 0,
                         warmup=c.warmup, step_window=[c.start, c.stop], kv_verified=c.verify_kv)
    check = KVCheckResult(max_examples=defaults.MAX_KV_EXAMPLES)
    run = _Run(worker, _stages(worker, kv, check, cross_rank, phases), Markers(phases, enabled=c.nvtx), result,
               c.series, c.series if c.step_starts is None else c.step_starts, c.occupancy_ranks)
    run.ranks_tally = _RankTally(header, worker, kv) if header.decode_context_parallel_size > 1 else None
    steps = trace.steps(0, c.stop)
    try:
        i = run.loop(steps, source, c.stop, record_from, measure_from, measure_from if c.capture else None,
                     on_mappings, on_step)
    except KvmapError as e:
        raise e.located(path=trace.name) from None
    del steps, kv, worker  # the run lets go of them in `store`, before the result's arrays are made
    run.store(check if c.verify_kv else None, measure_from)
    result.kv_checked, result.kv_mismatches = check.checked, check.mismatches
    result.kv_examples = [asdict(e) for e in check.examples]
    if len(result.steps) == result.warmup:
        raise empty_window_error(c.start, c.stop, c.warmup, i).located(path=trace.name)
    return result


def v1_reorder(header, fcfg=None):
    """V1's reorder threshold from the groups' attention backends (the options' with --forward, else the
    header's; None when none is named or none sets one)."""
    from kvmap.forward.config import resolve
    from kvmap.forward.graph_parts import v1_reorder_threshold

    if fcfg is None:
        if not any(g.attention_backend for g in header.kv_cache_groups):
            return None
        try:
            fcfg = resolve(header, "v1")
        except KvmapError:
            return None
    return v1_reorder_threshold(fcfg)


def forward_config(header, c: ReplayConfig):
    """The forward settings of a replay: the header's, with the config's overrides (forward/config.py)."""
    from kvmap.forward.config import resolve

    return resolve(header, c.batch_order, c.attention_backend, c.cudagraph_mode, c.cudagraph_capture_sizes)


def _stages(worker: Worker, kv, check: KVCheckResult, cross_rank, phases: list[str]) -> list[tuple[str, Callable]]:
    """Every phase after update_states, as a call with no arguments (the worker holds the current step)."""
    return [(name, fn) for name, fn in (
        ("batch_order", worker.prepare_batch),
        ("h2d", worker.copy_to_device),
        ("prepare_inputs", worker.prepare_inputs),
        ("block_tables", worker.gather_block_tables),
        ("slot_mappings", worker.compute_slot_mappings),
        ("prepare_forward", worker.prepare_forward),
        ("kv_write", lambda: worker.write_kv(kv)),
        ("kv_verify", lambda: worker.verify_kv(kv, check)),
        ("post_update", worker.append_sampled),
        ("cross_rank", lambda: cross_rank(worker)),
    ) if name in phases]


class _Run:
    """One replay's loop and what it tallies: the steps seen, the recorded steps' clock reads, the bytes copied
    to the device before the measured steps, per-rank figures."""

    def __init__(self, worker: Worker, stages, markers: Markers, result: ReplayResult, series: bool = True,
                 starts: bool = True, occupancy_ranks=None) -> None:
        self.worker, self.stages, self.markers, self.result = worker, stages, markers, result
        self.events = None  # device time per phase from CUDA events (device workers on a GPU)
        if worker.device.startswith("cuda"):
            import torch as _t

            from kvmap.run.timing import EventTimer

            self.events = EventTimer(len(result.phases), lambda: _t.cuda.Event(enable_timing=True))
        self.seen = DistinctIds()  # new requests, all replayed steps
        self.seen_measured = DistinctIds()  # requests scheduled in the measured steps (a window after 0)
        self.h2d_before = 0
        self.rec = StepLog(len(result.phases), keep_start=starts)
        self.ranks_tally: _RankTally | None = None
        # the KV cache's occupancy per step (occupancy.py); workers without host state (user workers) have none
        self.occupancy = (Occupancy(worker, keep_series=series, ranks=occupancy_ranks) if hasattr(worker, "state")
                          and hasattr(worker, "rank_layouts") else None)
        self.mix = Composition() if series else None
        self.wall0 = 0.0

    def loop(self, steps, source, stop, record_from: int, measure_from: int, capture_from: int | None,
             on_mappings, on_step) -> int:
        """Replay steps until `stop` or the trace's end; the number of steps read."""
        worker, stages, markers, events, result = self.worker, self.stages, self.markers, self.events, self.result
        rec, seen, seen_measured, ranks_tally = self.rec, self.seen, self.seen_measured, self.ranks_tally
        occupancy, mix = self.occupancy, self.mix
        pop = markers.pop
        self.wall0 = time.perf_counter()
        rec.origin = time.perf_counter_ns()
        i = 0
        capturing = False
        while stop is None or i < stop:
            if i == measure_from:
                self.h2d_before = worker.h2d_bytes
            if i == capture_from:
                markers.push_capture()
                capturing = True
            markers.push_step(i)
            step, ts = _read_step(steps, source, markers, events)
            if step is None:
                pop()
                if capturing:
                    pop()
                if events:
                    events.current.clear()
                result.steps_in_trace = i
                return i
            markers.mark_counts(step.num_reqs, step.num_tokens)
            _run_phases(worker, step, stages, markers, events, ts)
            pop()  # step
            if events:
                events.end_step(keep=step.step >= record_from)
            if measure_from and step.step >= measure_from:  # from 0 it is `seen` (see `store`)
                seen_measured.update(step.scheduled_req_ids())
            if step.step >= record_from:
                rec.add(step.step, step.num_reqs, step.num_tokens, ts)
                if mix is not None:
                    mix.add(step)
            result.steps_replayed += 1
            result.tokens_scheduled += step.num_tokens
            seen.update(step.new_req_ids)
            if occupancy is not None:
                index = worker.state.req_id_to_index
                occupancy.add(i, step, worker.batch, [index[r] for r in step.new_req_ids], step.step >= record_from,
                              step.step >= measure_from)
            if ranks_tally is not None and step.step >= measure_from:
                ranks_tally.add(worker.mappings())
            if on_mappings is not None:
                on_mappings(worker.mappings_dict())
            if on_step is not None:
                on_step(step.step)
            i += 1
        if capturing:
            markers.pop()
        return i

    def store(self, check: KVCheckResult | None, measure_from: int) -> None:
        """The run's tallies into its result."""
        result, worker = self.result, self.worker
        if self.ranks_tally is not None:
            self.ranks_tally.store(result, check)
        if self.events:
            result.device_phase_ns = self.events.finish()
        result.device = worker.device
        result.h2d_bytes = worker.h2d_bytes
        result.h2d_bytes_measured = worker.h2d_bytes - self.h2d_before
        result.standin_tokens = worker.num_standin_tokens
        # the worker, its KV cache and the stages that hold them go before the arrays are made (a long run's
        # arrays are its largest part), unless the caller holds the worker
        self.worker = self.stages = self.ranks_tally = worker = None
        own_mappings()  # the arrays below and every later temporary: returned when freed (ondisk.py)
        result.steps, result.num_reqs, result.num_tokens, result.step_start_ns, result.phase_ns = self.rec.arrays()
        if self.mix is not None:
            result.mix_columns, result.mix_series = list(MIX_COLUMNS), self.mix.arrays()
        if self.occupancy is not None:
            series, result.kv_memory = self.occupancy.finish(result.steps_replayed)
            if self.occupancy.keep:
                result.kv_columns, result.kv_series = self.occupancy.cols, series
        result.wall_s = time.perf_counter() - self.wall0
        result.requests_seen = len(self.seen)
        # a state learns requests only as new ones, each scheduled in its first step: from step 0 the requests
        # scheduled in the measured steps are the new ones (no per-step id list)
        result.requests_measured = len(self.seen_measured) if measure_from else len(self.seen)
        result.warmup = int((result.steps < measure_from).sum())


def _read_step(steps, source: StepSource | None, markers: Markers, events) -> tuple[object, list[int]]:
    """The `read_step` phase (and `broadcast`, distributed): (the step or None at the end, timestamps)."""
    clock = time.perf_counter_ns
    markers.push("read_step")
    if events:
        events.mark()
    t0 = clock()
    if source is None:
        step = next(steps, None)
        ts = [t0, clock()]
    else:  # rank 0 reads, then every rank takes part in the broadcast
        obj = source.read()
        ts = [t0, clock()]
        if events:
            events.mark()
        markers.pop()
        markers.push("broadcast")
        step = source.broadcast(obj)
        ts.append(clock())
    if events:
        events.mark()
    markers.pop()
    return step, ts


def _run_phases(worker: Worker, step, stages, markers: Markers, events, ts: list[int]) -> None:
    """`update_states(step)`, then every other phase, each in its NVTX range between two clock reads."""
    clock, push, pop = time.perf_counter_ns, markers.push, markers.pop
    push("update_states")
    worker.update_states(step)
    ts.append(clock())
    if events:
        events.mark()
    pop()
    for name, fn in stages:
        push(name)
        fn()
        ts.append(clock())
        if events:
            events.mark()
        pop()


def _new_result(trace: Trace, worker: Worker, kv, geometry: KVGeometry, phases: list[str], **kw) -> ReplayResult:
    """The run's record before its first step: what ran, with which phases, KV cache and ranks."""
    h = trace.header
    result = ReplayResult(
        trace=trace.name, backend=worker.name, protocol=h.model_runner_protocol,
        backend_detail=getattr(worker, "backend_detail", ""),
        groups=[{"kind": g.kind, "block_size": g.block_size, "sliding_window": g.sliding_window}
                for g in h.kv_cache_groups],
        phases=phases, kv_bytes=kv.bytes if kv else 0, kv_geometry=asdict(geometry) if kv else {}, **kw)
    result.cp_size, result.tp_size = h.decode_context_parallel_size, h.tensor_parallel_size
    result.engine = engine_dict(h)
    result.interleave = h.cp_kv_cache_interleave_size
    result.ranks = list(worker.ranks)
    if h.has_kernel_split:
        result.kernel_block_sizes = [g.kernel_block_size or g.block_size for g in h.kv_cache_groups]
    if h.decode_context_parallel_size > 1 and kv is not None:
        result.rank_kv_bytes = [kv.bytes_per_rank] * len(worker.ranks)
    return result


def engine_dict(h) -> dict:
    """The trace header as plain data (the engine's pool, limits and features), without the source path."""
    d = asdict(h)
    d.pop("source", None)
    d["stop_token_ids"] = list(d["stop_token_ids"])
    d["kv_cache_groups"] = [{k: v for k, v in g.items() if v is not None} for g in d["kv_cache_groups"]]
    return d


class _RankTally:
    """Per-DCP-rank figures over the measured steps (as every count of the summary): local tokens, the largest
    local length."""

    def __init__(self, header, worker: Worker, kv) -> None:
        self.ranks = list(worker.ranks)
        self.tokens = np.zeros(len(self.ranks), dtype=np.int64)  # [ranks] tokens local on each rank
        self.max_local = np.zeros(len(self.ranks), dtype=np.int64)  # [ranks] largest dcp_local_seq_len
        self.kv_group = next((g for g, grp in enumerate(header.kv_cache_groups) if grp.uses_slot_mapping), 0)

    def add(self, m) -> None:
        if m.rank_slot_mapping is not None and m.num_tokens:
            self.tokens += (m.rank_slot_mapping[:, self.kv_group] >= 0).sum(axis=1)
        if m.dcp_local_seq_lens is not None and m.num_reqs:
            np.maximum(self.max_local, m.dcp_local_seq_lens.max(axis=1), out=self.max_local)

    def store(self, result: ReplayResult, check: KVCheckResult | None) -> None:
        result.rank_tokens = self.tokens.tolist()
        result.rank_max_local_seq_len = self.max_local.tolist()
        if check is not None:
            result.rank_kv_checked = [check.rank_checked.get(r, 0) for r in self.ranks]
            result.rank_kv_mismatches = [check.rank_mismatches.get(r, 0) for r in self.ranks]


def _prewarm(trace: Trace, config: ReplayConfig) -> None:
    """Replay the first `config.warmup` steps with a throwaway worker and KV cache, untimed and without NVTX
    ranges, so that compiling, caches and the allocator are warm before a window that starts at 0."""
    steps = config.warmup
    r = replay(trace, replace(config, start=0, stop=steps, warmup=0, nvtx=False, capture=False))
    if r.steps_in_trace is not None and r.steps_in_trace < steps:
        raise KvmapError(f"{steps} warm-up steps, but the trace has only {r.steps_in_trace}; lower --warmup",
                         field="--warmup")
