"""The replay's options, as one value: what to replay (the window, the warm-up), with what (backend, device,
batch order, DCP ranks) and what to check and record (KV cache, NVTX ranges).

Rules: every option of `kvmap.run.replay.replay` that is a setting lives here, once, with its default; what
the replay calls back (`on_mappings`, `on_step`, a distributed step source, a cross-rank check) and a caller's
own worker instance are the replay's arguments, not settings. The CLI builds one `ReplayConfig` from its
options; a variant of a config is `dataclasses.replace(config, ...)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmap import defaults

if TYPE_CHECKING:  # pragma: no cover
    from kvmap.kv.cache import KVGeometry

__all__ = ["ReplayConfig"]


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    backend: str | None = None  # a registered name, module:Class, file.py:Class (None: the default backend)
    device: str = "cpu"  # cpu, or cuda[:N] (device backends)
    start: int = 0  # the window START:STOP of measured steps (STOP exclusive, None: to the end)
    stop: int | None = None
    warmup: int = defaults.WARMUP  # steps replayed first and not counted (result.py `warmup_window`)
    verify_kv: bool = False  # read back every scheduled request's readable context each step
    write_kv: bool = True  # write the canary K/V through slot_mapping
    kv_geometry: KVGeometry | None = None  # None: KVGeometry()'s defaults
    nvtx: bool = True  # one NVTX range per phase and step
    capture: bool = False  # wrap the measured steps in the NVTX capture range (for nsys)
    batch_order: str = "mrv2"  # the runner, "mrv2" or "v1": its batch order (workers/order.py) and forward rules
    reorder_batch_threshold: int | None = None  # v1: the attention backend's reorder_batch_threshold
    ranks: Sequence[int] | None = None  # the DCP ranks to compute (None: every rank, in this process)
    # the DCP ranks the KV memory figures cover (None: the ranks computed); a torch.distributed rank computes
    # one rank's mappings but reports its whole DCP group's memory, as the one-process replay does
    occupancy_ranks: Sequence[int] | None = None
    # the forward pass's other inputs (kvmap/forward), computed as the `prepare_forward` phase when True; the
    # overrides of the header's forward keys (None: the header's; forward/config.py `resolve`)
    forward: bool = False
    attention_backend: str | None = None  # NAME (every group) or g=NAME,...
    cudagraph_mode: str | None = None  # vLLM's CUDAGraphMode name
    cudagraph_capture_sizes: str | None = None  # comma-separated token counts
    series: bool = True  # keep the per-step series only outputs read: KV occupancy, batch composition (--json,
    # --html) and step starts (--json, --trace-out); the summary figures are kept either way
    step_starts: bool | None = None  # keep every step's start (--json, --trace-out); None: as `series`
