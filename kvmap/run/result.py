"""What a replay measured, as plain data: per-step phase times and counts, KV-check outcome, context.

Rules: measurement and rendering are apart. `replay` fills a `ReplayResult`; renderers (report.py) turn it
into tables, JSON, CSV or Chrome traces; `to_json`/`from_json` round-trip it so that `kvmap report` can
re-render a saved run. Times are integer nanoseconds (`*_ns`); statistics are derived, never stored twice.
- "Measured steps" has one definition (`warmup_window`): the steps of the window START:END. The `warmup`
  steps just before START are replayed, timed and recorded, but not counted; a window from 0 has nothing
  before it, so there the first `warmup` steps are replayed first by a throwaway worker, untimed
  (`prewarm_steps`); only a caller's own worker instance takes them from the window instead (`warmup`
  recorded steps inside it). Every count, mean and rate of the summary,
  `--json`, `--csv` and `report` is over the measured steps; only `steps_replayed` and the KV check's
  `kv_checked` count every replayed step.
- A saved run carries what produced it (`provenance`, provenance.py), the summary's percentiles and, with
  `--runs N`, every run's per-phase medians (`runs_p50_us`, runs.py); runs saved before these have none, and
  load: a missing field takes its default, an unknown key is ignored.
"""

from __future__ import annotations

import math
import platform
from dataclasses import MISSING, asdict, dataclass, field, fields

import numpy as np

from kvmap.aot import cpu_model
from kvmap.errors import KvmapError

PHASES = (
    "read_step",  # read and decode one trace line into records
    "broadcast",  # distributed: rank 0 sends the step to every rank (as vLLM's executor sends SchedulerOutput)
    "update_states",  # finish/preempt/add requests, num_computed_tokens, block ids, staged drafts
    "batch_order",  # MRV2 batch order -> idx_mapping order
    "h2d",  # device workers: one staged non-blocking host-to-device copy of what changed
    "prepare_inputs",  # idx_mapping, query_start_loc, seq_lens, positions, input_ids
    "block_tables",  # gather the batch's block-table rows, every group
    "slot_mappings",  # slot_mapping, every group
    "prepare_forward",  # --forward: the forward pass's other inputs (sampler indices, ...; kvmap/forward)
    "kv_write",  # write the canary K/V through slot_mapping
    "kv_verify",  # read back the readable context and compare bits (--verify-kv)
    "post_update",  # append sampled tokens to the token rows
    "cross_rank",  # distributed: the cross-rank invariants, checked with collectives
)
MAPPING_PHASES = ("batch_order", "prepare_inputs", "block_tables", "slot_mappings")
RESULT_KIND = "kvmap-replay-result/1"  # a saved run's "kind"
DEFAULT_PERCENTILES = (50, 90, 99)  # the summary's percentile columns unless --percentiles says otherwise


def warmup_window(start: int, stop: int | None, warmup: int, prewarm: bool = True) -> tuple[int, int]:
    """(first recorded step, first measured step) of the window START:STOP with `warmup` warm-up steps;
    `prewarm`: a window from 0 is warmed by a throwaway pass, so all of it is measured."""
    if start == 0 and prewarm:
        return 0, 0
    if start == 0:
        if stop is not None and warmup >= stop:
            raise KvmapError(f"{warmup} warm-up steps leave nothing to measure in the window 0:{stop}; "
                             "lower --warmup or widen --steps", field="--warmup")
        return 0, warmup
    if warmup > start:
        raise KvmapError(f"{warmup} warm-up steps are taken just before the window, but it starts at step "
                         f"{start}: use --warmup {start} or less, or a window from 0", field="--warmup")
    return start - warmup, start


def empty_window_error(start: int, stop: int | None, warmup: int, steps_read: int) -> KvmapError:
    """The window held no measured step: say which option and what the trace holds."""
    if not steps_read:  # whatever the window: say so without blaming an option the user may not have given
        return KvmapError("the trace has no steps (a header and nothing after it): nothing to replay")
    window = f"{start}:{'' if stop is None else stop}"
    held = f"the trace has {steps_read} steps (0..{steps_read - 1})"
    if steps_read > start:  # the window starts inside the trace: the warm-up ate it
        return KvmapError(f"{warmup} warm-up steps leave nothing to measure: {held}; lower --warmup",
                          field="--warmup")
    return KvmapError(f"the window {window} is outside the trace: {held}", field="--steps")


@dataclass
class ReplayResult:
    trace: str
    backend: str
    protocol: str
    groups: list[dict]  # [{kind, block_size, sliding_window}]
    phases: list[str]
    backend_detail: str = ""  # how the backend ran, e.g. the numba worker's kernels: ahead-of-time or JIT
    step_window: list[int | None] = field(default_factory=lambda: [0, None])  # [start, stop) as asked
    prewarm_steps: int = 0  # steps 0..N-1 replayed first by a throwaway worker, untimed (a window from 0)
    warmup: int = 0  # recorded steps excluded from statistics: those just before the window (or its first, from 0)
    # per recorded step, integer arrays (int64 loaded; a replay's as narrow as the values allow: steplog.py); a
    # replay's past one block of steps keeps phase_ns, step_start_ns and the series on disk (ondisk.py)
    steps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [n] step index
    num_reqs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [n]
    num_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [n]
    phase_ns: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))  # [n, len(phases)]
    step_start_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [n] from the replay's start
    # device workers on a GPU: [n, len(phases)] device time per phase from CUDA events (empty on CPU)
    device_phase_ns: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    device: str = "cpu"
    h2d_bytes: int = 0  # bytes sent host -> device by the staged copies, all steps
    steps_replayed: int = 0  # including steps before the window
    requests_seen: int = 0  # new requests, all replayed steps
    requests_measured: int | None = None  # distinct requests scheduled in the measured steps
    tokens_scheduled: int = 0  # all replayed steps (the summary counts the measured steps' num_tokens)
    steps_in_trace: int | None = None  # set when the replay reached the trace's end before the window's
    h2d_bytes_measured: int | None = None  # h2d_bytes during the measured steps
    standin_tokens: int = 0  # input ids made up because the trace lacks sampled_token_ids
    kv_bytes: int = 0
    kv_geometry: dict = field(default_factory=dict)
    kv_verified: bool = False
    kv_checked: int = 0
    kv_mismatches: int = 0
    kv_examples: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    # multi-rank (decode context parallelism): per computed DCP rank, empty when cp = 1
    cp_size: int = 1
    tp_size: int = 1
    interleave: int = 1
    ranks: list[int] = field(default_factory=list)  # DCP ranks computed
    world_size: int = 1  # processes (1: every rank emulated in this process)
    rank_tokens: list[int] = field(default_factory=list)  # [ranks] scheduled tokens local to the rank (KV writes)
    rank_kv_bytes: list[int] = field(default_factory=list)  # [ranks] bytes of each rank's KV shard
    rank_kv_checked: list[int] = field(default_factory=list)  # [ranks]
    rank_kv_mismatches: list[int] = field(default_factory=list)  # [ranks]
    rank_max_local_seq_len: list[int] = field(default_factory=list)  # [ranks] largest dcp_local_seq_len
    kernel_block_sizes: list[int] = field(default_factory=list)  # [groups], when some group splits
    rank_broadcast_p50_ns: list[int] = field(default_factory=list)  # [ranks] distributed: median broadcast per step
    machine: dict = field(default_factory=lambda: {"python": platform.python_version(),
                                                    "machine": platform.machine(), "processor": cpu_model()})
    # what produced the run (provenance.py): {kvmap, date, argv, host}; {} in runs saved before it was recorded
    provenance: dict = field(default_factory=dict)
    percentiles: list[float] = field(default_factory=lambda: list(DEFAULT_PERCENTILES))  # the summary's columns
    # `--runs N` (N > 1): per run, in run order, {phase (and mappings, step): median per measured step, us}; this
    # result's per-step arrays are the last run's
    runs_p50_us: list[dict] = field(default_factory=list)
    # the engine as the trace header gives it (pool, limits, groups, features), for reports; {} in older runs
    engine: dict = field(default_factory=dict)
    # the KV cache's memory efficiency over the measured steps (occupancy.py, kvstats.py `memory_dict`):
    # {efficiency: {name: {mean, p5, min, steps}}, groups: {g0: {max_in_use, max_shared}}}; {} without a KV tally
    kv_memory: dict = field(default_factory=dict)
    # the KV cache's occupancy per recorded step (occupancy.py; kept with --json, --html): column names, then
    # [n, len(kv_columns)] integers
    kv_columns: list[str] = field(default_factory=list)
    kv_series: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    # the batch's composition per recorded step (composition.py; kept with --json, --html): column names, then
    # [n, len(mix_columns)] integers
    mix_columns: list[str] = field(default_factory=list)
    mix_series: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))

    # ------------------------------------------------------------------ derived

    def measured(self) -> np.ndarray:
        """[n - warmup, phases] int64 ns of the steps that count."""
        return self.phase_ns.reshape(-1, len(self.phases))[self.warmup :]

    def measured_counts(self) -> tuple[np.ndarray, np.ndarray]:
        return self.num_reqs[self.warmup :], self.num_tokens[self.warmup :]

    def measured_steps(self) -> np.ndarray:
        """The trace step indices that count (the window, less a warm-up taken from its start when at 0)."""
        return self.steps[self.warmup :]

    def warmup_steps(self) -> np.ndarray:
        return self.steps[: self.warmup]

    def warmup_before_window(self) -> bool:
        """True when the recorded warm-up steps lie before the window (it starts after 0), not inside it."""
        return bool(self.step_window[0])

    def to_json(self) -> dict:
        """The saved run as plain JSON values (a copy: lists of the per-step arrays)."""
        d = asdict(self)
        for k in _ARRAYS:
            d[k] = getattr(self, k).tolist()
        d["kind"] = RESULT_KIND
        return d

    def json_fields(self) -> dict:
        """The saved run as `to_json` gives it, the same keys in the same order, but the per-step arrays as they
        are (numpy) and every other value shared, not copied: for `files.write_json`, which streams the arrays
        (the CLI's writers; `to_json` would hold the whole document as Python lists)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["kind"] = RESULT_KIND
        return d

    @classmethod
    def from_json(cls, d: dict) -> ReplayResult:
        """A saved run back; a field of the wrong type or shape is a `KvmapError` naming it (no traceback)."""
        d = dict(d)
        d.pop("kind", None)
        known = set(cls.__dataclass_fields__)
        kw = {k: v for k, v in d.items() if k in known}
        for k, f in cls.__dataclass_fields__.items():
            if k in kw and k not in _ARRAYS:
                _check_field(k, kw[k], f.type)
            elif k not in kw and f.default is MISSING and f.default_factory is MISSING:
                raise KvmapError("missing", field=k)
        if not all(0 <= q <= 100 for q in kw.get("percentiles", DEFAULT_PERCENTILES)):
            raise KvmapError("percentiles must lie in 0..100", field="percentiles")
        if not kw["phases"] or len(set(kw["phases"])) != len(kw["phases"]):
            raise KvmapError("must name each phase once, at least one", field="phases")
        for k, keys in (("groups", _GROUP_KEYS), ("kv_examples", _EXAMPLE_KEYS)):
            for i, item in enumerate(kw.get(k, [])):
                if not keys <= set(item):
                    raise KvmapError(f"item {i} lacks {sorted(keys - set(item))}", field=k)
        window = kw.get("step_window", [0, None])
        if len(window) != 2 or window[0] is None or window[0] < 0 or window[1] is not None and window[1] <= window[0]:
            raise KvmapError(f"{window} is not [start, stop > start or null]", field="step_window")
        for i, run in enumerate(kw.get("runs_p50_us", [])):  # --runs: per run, phase -> a finite median in us
            if not all(type(v) in (int, float) and math.isfinite(v) for v in run.values()):
                raise KvmapError(f"run {i} has a median that is not a finite number", field="runs_p50_us")
        for k in _ARRAYS:
            try:
                kw[k] = np.asarray(kw.get(k, []), dtype=np.int64)
            except (TypeError, ValueError, OverflowError):
                raise KvmapError("not an array of integers", field=k) from None
        if any(a.ndim != 1 for k, a in kw.items() if k in _ARRAYS[:3] + ("step_start_ns",)) or \
                len({len(kw[k]) for k in _ARRAYS[:3]}) != 1:
            raise KvmapError("steps, num_reqs and num_tokens must be flat and of one length", field="steps")
        for k, cols in (("kv_series", "kv_columns"), ("mix_series", "mix_columns")):
            width = len(kw.get(cols, []))
            if kw[k].size and (not width or kw[k].size != width * len(kw["steps"])):
                raise KvmapError(f"{kw[k].size} values are not one row of {cols} per step", field=k)
            kw[k] = kw[k].reshape(-1, max(width, 1))
        for k in ("phase_ns", "device_phase_ns"):
            if kw[k].size % len(kw["phases"]):
                raise KvmapError(f"{kw[k].size} values are not whole rows of {len(kw['phases'])} phases", field=k)
            kw[k] = kw[k].reshape(-1, len(kw["phases"]))
        if len(kw["phase_ns"]) != len(kw["steps"]) or not 0 <= kw.get("warmup", 0) <= len(kw["steps"]):
            raise KvmapError(f"{len(kw['phase_ns'])} rows of phase times for {len(kw['steps'])} steps with "
                             f"{kw.get('warmup', 0)} warm-up steps", field="phase_ns")
        return cls(**kw)


_ARRAYS = ("steps", "num_reqs", "num_tokens", "phase_ns", "step_start_ns", "device_phase_ns", "kv_series",
           "mix_series")
_GROUP_KEYS = {"kind", "block_size"}
_EXAMPLE_KEYS = {"step", "req_id", "group", "position", "slot", "expected_token", "found"}
_SCALARS = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "dict": (dict,),
            "list": (list,), "None": (type(None),)}


def _check_field(name: str, value: object, annotation: str) -> None:
    """`value` has the type `annotation` names ("int | None", "list[int]", "list[int | None]", "dict"...)."""
    outer, _, inner = annotation.partition("[")
    kinds = tuple(t for part in outer.split("|") for t in _SCALARS[part.strip()])
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if ok and inner:
        for item in value:
            _check_field(name, item, inner.rstrip("]"))
    if not ok:
        raise KvmapError(f"{json_type(value)} is not {annotation}", field=name)


def json_type(value: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)
