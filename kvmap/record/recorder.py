"""Turn a running vLLM scheduler into a kvmap trace: one line per `schedule()` (the header: header.py).

Rules:
- `RecordingScheduler` wraps any vLLM v1 scheduler object: `schedule()` is serialized at once (before anything
  can mutate the output), `update_from_output()` adds the model's sampled tokens (copied before the scheduler
  trims them in place), `update_draft_token_ids()` the drafts. Offline recording and the live plugin use this
  same class.
- Under async scheduling (the engine's batch queue: `schedule()` of step N+1 runs before `update_from_output()`
  of step N) every output belongs to its OWN step: pending lines wait in a FIFO, and an output is matched to
  the line whose `SchedulerOutput` is the very object passed to `update_from_output()` (identity, never "the
  latest line"). Lines are written in step order as soon as their output is known (a synchronous
  spec-decoding line waits for its drafts, which come after the output, or for the next `schedule()`).
  `flush()`/`close()` write whatever is still pending (a line whose output never came has
  `sampled_token_ids: null`), so nothing is lost when the queue drains or the engine stops.
- Async speculative decoding (docs/trace-format.md): `num_rejected_tokens` (drafts rejected this step) and
  `num_computed_tokens_correction` (the rejections of the steps still in flight when this step was scheduled,
  by which its optimistic `num_computed_tokens` is too high) are derived from what the scheduler sees;
  `spec_draft_token_ids` (the real drafts behind the `-1` placeholders) only when a driver that can see them
  calls `note_spec_drafts()`.
- Every dataclass field of `SchedulerOutput` is written; sets become sorted lists, tuples lists; objects that
  are not plain data (sampling params, connector metadata, tensors) become null.
- The writer never breaks the engine: a write error is reported once on stderr and recording stops.
- The time spent in the recorder's own code (serializing, copying, writing; not the wrapped scheduler) is
  summed in `overhead_s` over `calls` wrapped calls.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import sys
from collections import deque
from time import perf_counter
from typing import Any


_OPAQUE = {"sampling_params", "pooling_params", "lora_request", "mm_features", "prompt_embeds",
           "kv_connector_metadata", "ec_connector_metadata", "ec_manager_metadata", "aux_output_connector_metadata",
           "kv_connector_block_state", "encoder_input_updates", "scheduled_encoder_input_stats", "kv_hints"}


def to_plain(value: Any, key: str | None = None) -> Any:
    if key in _OPAQUE:
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(to_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name), f.name) for f in dataclasses.fields(value)}
    if hasattr(value, "tolist"):  # numpy / torch
        try:
            return value.tolist()
        except Exception:  # noqa: BLE001 - opaque device tensors
            return None
    return None


class TraceWriter:
    """Writes header and step lines; flushes every line; on the first write error, warns once and stops."""

    def __init__(self, path: str, header: dict) -> None:
        self.path = path
        self.failed = False
        self.steps = 0
        try:
            raw = open(path, "wb")
            # mtime=0 and no file name: byte-identical output for identical input
            self._f: io.IOBase = (io.TextIOWrapper(gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename=""),
                                                   encoding="utf-8")
                                  if path.endswith(".gz") else io.TextIOWrapper(raw, encoding="utf-8"))
        except OSError as e:
            self._fail(e)
            return
        self.write(header)

    def _fail(self, e: Exception) -> None:
        if not self.failed:
            print(f"kvmap record: cannot write {self.path}: {e}; recording stops, the engine goes on",
                  file=sys.stderr)
        self.failed = True

    def write(self, obj: dict) -> None:
        if self.failed:
            return
        try:
            self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
            self._f.flush()
        except Exception as e:  # noqa: BLE001 - never break the engine
            self._fail(e)

    def close(self) -> None:
        if not self.failed:
            try:
                self._f.close()
            except Exception as e:  # noqa: BLE001
                self._fail(e)


class _Line:
    """One recorded step waiting for its model output (and, in synchronous spec decoding, its drafts)."""

    __slots__ = ("so", "line", "has_output", "drafts_closed", "inflight")

    def __init__(self, so: Any, line: dict, inflight: list) -> None:
        self.so = so  # the SchedulerOutput object itself: outputs are matched to it by identity
        self.line = line
        self.has_output = False
        self.drafts_closed = False
        self.inflight = inflight  # the lines still without output when this step was scheduled


class RecordingScheduler:
    """Delegates to a vLLM scheduler and records each step. Attribute access falls through to the scheduler."""

    def __init__(self, scheduler: Any, writer: TraceWriter, async_scheduling: bool | None = None,
                 num_speculative_tokens: int | None = None) -> None:
        self._scheduler = scheduler
        self._writer = writer
        self._fifo: deque[_Line] = deque()
        self._step = 0
        self.num_preemptions = 0
        if async_scheduling is None:
            async_scheduling = type(scheduler).__name__ == "AsyncScheduler" or bool(
                getattr(getattr(getattr(scheduler, "vllm_config", None), "scheduler_config", None),
                        "async_scheduling", False))
        if num_speculative_tokens is None:
            num_speculative_tokens = int(getattr(scheduler, "num_spec_tokens", 0) or 0)
        self.async_scheduling = async_scheduling
        self.num_speculative_tokens = num_speculative_tokens
        # synchronous spec decoding: a step's drafts arrive after its output (EngineCore.post_step)
        self._drafts_follow_output = num_speculative_tokens > 0 and not async_scheduling
        self._last_output: _Line | None = None
        self._rejected: dict[int, dict[str, int]] = {}  # step -> {req: rejected drafts}, for corrections
        self.overhead_s = 0.0  # time inside the recorder's own code
        self.calls = 0
        self.unmatched_outputs = 0
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)

    # ---------------------------------------------------------------------------------------- writing

    def _finish(self, e: _Line) -> None:
        line = e.line
        if self.async_scheduling and self.num_speculative_tokens:
            so = line["scheduler_output"]
            sampled = line["sampled_token_ids"]
            drafts = so.get("scheduled_spec_decode_tokens") or {}
            rej = {}
            if sampled is not None:
                for r, d in drafts.items():
                    s = sampled.get(r)
                    if s:
                        rej[r] = len(d) - (len(s) - 1)
            self._rejected[line["step"]] = rej
            line["num_rejected_tokens"] = rej
            cached = so.get("scheduled_cached_reqs") or {}
            resumed = set(cached.get("resumed_req_ids") or ())
            corr = {}
            for r in cached.get("req_ids") or ():
                if r in resumed:
                    continue  # a resumed request's count was reset by the preemption: exact
                corr[r] = sum(self._rejected.get(s, {}).get(r, 0) for s in e.inflight)
            line["num_computed_tokens_correction"] = corr
            for s in [s for s in self._rejected if s < line["step"] - 8]:
                del self._rejected[s]

    def _drain(self, force: bool = False) -> None:
        """Write the lines at the head of the FIFO whose output is known (all of them when forced)."""
        while self._fifo:
            e = self._fifo[0]
            if not force and not (e.has_output and (e.drafts_closed or not self._drafts_follow_output)):
                break
            self._fifo.popleft()
            if e is self._last_output:
                self._last_output = None
            try:
                self._finish(e)
            except Exception as ex:  # noqa: BLE001
                self._writer._fail(ex)
            self._writer.write(e.line)
            self._writer.steps += 1

    def flush(self) -> None:
        """Write every pending line now (those still without output get `sampled_token_ids: null`)."""
        self._drain(force=True)

    # ------------------------------------------------------------------------------------ the wrappers

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = self._scheduler.schedule(*args, **kwargs)
        t0 = perf_counter()
        for e in self._fifo:  # a new step: no more drafts for the earlier ones
            e.drafts_closed = True
        self._drain()
        try:
            so = to_plain(out)
            self.num_preemptions += len(so.get("preempted_req_ids") or [])
            line = {"step": self._step, "scheduler_output": so, "sampled_token_ids": None, "draft_token_ids": {}}
            self._fifo.append(_Line(out, line, [x.line["step"] for x in self._fifo if not x.has_output]))
        except Exception as e:  # noqa: BLE001
            self._writer._fail(e)
        self._step += 1
        self.overhead_s += perf_counter() - t0
        self.calls += 1
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        t0 = perf_counter()
        entry = next((e for e in self._fifo if e.so is scheduler_output), None)
        if entry is None:
            self.unmatched_outputs += 1
        else:
            try:
                req_ids = list(model_runner_output.req_ids)
                sampled = model_runner_output.sampled_token_ids
                idx = model_runner_output.req_id_to_index
                entry.line["sampled_token_ids"] = {
                    r: [int(t) for t in sampled[idx[r]]]
                    for r in scheduler_output.num_scheduled_tokens if r in idx
                } if sampled is not None and len(sampled) == len(req_ids) else (
                    {} if not req_ids and not scheduler_output.num_scheduled_tokens else None)
            except Exception as e:  # noqa: BLE001
                self._writer._fail(e)
            entry.has_output = True
            self._last_output = entry
        self.overhead_s += perf_counter() - t0
        result = self._scheduler.update_from_output(scheduler_output, model_runner_output)
        t0 = perf_counter()
        self._drain()
        self.overhead_s += perf_counter() - t0
        self.calls += 1
        return result

    def update_draft_token_ids(self, draft_token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = perf_counter()
        e = self._last_output
        if e is not None and draft_token_ids is not None:
            try:
                e.line["draft_token_ids"] = {r: [int(t) for t in d] for r, d in
                                             zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids)}
            except Exception as ex:  # noqa: BLE001
                self._writer._fail(ex)
        if e is not None:
            e.drafts_closed = True
        self.overhead_s += perf_counter() - t0
        result = self._scheduler.update_draft_token_ids(draft_token_ids, *args, **kwargs)
        t0 = perf_counter()
        self._drain()
        self.overhead_s += perf_counter() - t0
        return result

    def step_of(self, scheduler_output: Any) -> int | None:
        """The trace step of a SchedulerOutput still pending here (for a hooked worker), else None."""
        for e in self._fifo:
            if e.so is scheduler_output:
                return e.line["step"]
        return None

    def note_spec_drafts(self, scheduler_output: Any, drafts: dict) -> None:
        """For a driver that sees the real drafts behind async `-1` placeholders (the offline fake model, a
        hooked worker): `{req_id: [draft ids]}` verified in the step of `scheduler_output`."""
        for e in self._fifo:
            if e.so is scheduler_output:
                e.line["spec_draft_token_ids"] = {r: [int(t) for t in d] for r, d in drafts.items()}
                return

    def close(self) -> None:
        """Write what is pending and close the file (idempotent: the plugin calls it at shutdown and exit)."""
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._writer.close()
