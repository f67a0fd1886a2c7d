"""What a replay measured, as plain data: per-step phase times and counts, KV-check outcome, context.

Rules: measurement and rendering are apart. `replay` fills a `ReplayResult`; renderers (report.py) turn it
into tables, JSON, CSV or Chrome traces; `to_json`/`from_json` round-trip it so that `kvmap report` can
re-render a saved run. Times are integer nanoseconds (`*_ns`); statistics are derived, never stored twice.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field

import numpy as np

PHASES = (
    "read_step",  # read and decode one trace line into records
    "broadcast",  # distributed: rank 0 sends the step to every rank (as vLLM's executor sends SchedulerOutput)
    "update_states",  # finish/preempt/add requests, num_computed_tokens, block ids, staged drafts
    "batch_order",  # MRV2 batch order -> idx_mapping order
    "h2d",  # device workers: one staged non-blocking host-to-device copy of what changed
    "prepare_inputs",  # idx_mapping, query_start_loc, seq_lens, positions, input_ids
    "block_tables",  # gather the batch's block-table rows, every group
    "slot_mappings",  # slot_mapping, every group
    "kv_write",  # write the canary K/V through slot_mapping
    "kv_verify",  # read back the readable context and compare bits (--verify-kv)
    "post_update",  # append sampled tokens to the token rows
    "cross_rank",  # distributed: the cross-rank invariants, checked with collectives
)
MAPPING_PHASES = ("batch_order", "prepare_inputs", "block_tables", "slot_mappings")


@dataclass
class ReplayResult:
    trace: str
    backend: str
    protocol: str
    groups: list[dict]  # [{kind, block_size, sliding_window}]
    phases: list[str]
    warmup: int  # timed-window steps excluded from statistics
    step_window: list[int | None]  # [start, stop) of the timed window
    # per recorded step, int64 arrays (compact: 8 bytes a value, so long replays stay flat in memory)
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
    requests_seen: int = 0
    tokens_scheduled: int = 0
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
                                                    "machine": platform.machine(),
                                                    "processor": platform.processor() or platform.machine()})

    # ------------------------------------------------------------------ derived

    def measured(self) -> np.ndarray:
        """[n - warmup, phases] int64 ns of the steps that count."""
        return self.phase_ns.reshape(-1, len(self.phases))[self.warmup :]

    def measured_counts(self) -> tuple[np.ndarray, np.ndarray]:
        return self.num_reqs[self.warmup :], self.num_tokens[self.warmup :]

    def to_json(self) -> dict:
        d = asdict(self)
        for k in _ARRAYS:
            d[k] = getattr(self, k).tolist()
        d["kind"] = "kvmap-replay-result/1"
        return d

    @classmethod
    def from_json(cls, d: dict) -> ReplayResult:
        d = dict(d)
        d.pop("kind", None)
        known = set(cls.__dataclass_fields__)
        kw = {k: v for k, v in d.items() if k in known}
        for k in _ARRAYS:
            kw[k] = np.asarray(kw.get(k, []), dtype=np.int64)
        kw["phase_ns"] = kw["phase_ns"].reshape(-1, len(kw["phases"]))
        kw["device_phase_ns"] = kw["device_phase_ns"].reshape(-1, len(kw["phases"]))
        return cls(**kw)


_ARRAYS = ("steps", "num_reqs", "num_tokens", "phase_ns", "step_start_ns", "device_phase_ns")
