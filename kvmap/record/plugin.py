"""Live recording: a vLLM general plugin that records a running engine's scheduler to a kvmap trace.

Enable it by installing kvmap next to vLLM and naming an output file:
`KVMAP_RECORD_TRACE=/tmp/trace.jsonl.gz vllm serve ...` (`{pid}` in the name is replaced by the engine
process id, for several engine cores). vLLM calls `register()` in every process through the
`vllm.general_plugins` entry point; it patches `EngineCore.__init__` so that, once the scheduler exists, it is
wrapped by `RecordingScheduler` (the same class offline recording uses). Under async scheduling (the engine's
batch queue) each output is matched to its own step; lines are written in step order as their outputs
arrive, and whatever is pending is written when the process exits. The wrapper flushes every line and never
breaks the engine: any failure is printed once and recording stops.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys

from kvmap.record.header import eos_of, forward_keys, header_from_config
from kvmap.record.recorder import RecordingScheduler, TraceWriter

ENV = "KVMAP_RECORD_TRACE"


def register() -> None:
    """The `vllm.general_plugins` entry point. Does nothing unless KVMAP_RECORD_TRACE is set."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception as e:  # noqa: BLE001 - never break vLLM's start-up
        print(f"kvmap record: cannot hook vLLM's EngineCore ({e}); not recording", file=sys.stderr)
        return
    install(EngineCore, path)


def _wrap(core, vllm_config, path: str) -> None:
    """Wrap `core.scheduler` in a RecordingScheduler (once)."""
    if getattr(core, "_kvmap_wrapped", False) or getattr(core, "scheduler", None) is None:
        return
    core._kvmap_wrapped = True
    try:
        sc = vllm_config.scheduler_config
        spec = vllm_config.speculative_config
        is_async = bool(sc.async_scheduling) or int(getattr(core, "batch_queue_size", 1) or 1) > 1
        # under async scheduling a validator needs the stop ids to tell a discarded output from a fault
        kvc = core.scheduler.kv_cache_config
        header = header_from_config(vllm_config, kvc, forward=forward_keys(vllm_config, kvc),
                                    **(eos_of(vllm_config) if is_async else {}))
        writer = TraceWriter(path.replace("{pid}", str(os.getpid())), header)
        core.scheduler = RecordingScheduler(core.scheduler, writer, async_scheduling=is_async,
                                            num_speculative_tokens=spec.num_speculative_tokens if spec else 0)
        atexit.register(core.scheduler.close)
    except Exception as e:  # noqa: BLE001
        print(f"kvmap record: not recording ({type(e).__name__}: {e})", file=sys.stderr)


def install(engine_cls: type, path: str) -> None:
    """Wrap `engine_cls.__init__` so that its `scheduler` records to `path` (idempotent).

    vLLM's multiprocess engine core loads the general plugins from inside `EngineCore.__init__` (too late for
    that call's own wrapper), so the step methods wrap the scheduler too, on their first call, before the first
    `schedule()`; and `shutdown` writes what is still pending.
    """
    if getattr(engine_cls, "_kvmap_recording", False):
        return
    original = engine_cls.__init__

    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        _wrap(self, vllm_config, path)

    engine_cls.__init__ = __init__
    for name in ("step", "step_with_batch_queue"):
        step = getattr(engine_cls, name, None)
        if not callable(step):
            continue

        def _step(self, *args, _step=step, **kwargs):
            if not getattr(self, "_kvmap_wrapped", False):
                _wrap(self, self.vllm_config, path)
            return _step(self, *args, **kwargs)

        functools.update_wrapper(_step, step)
        setattr(engine_cls, name, _step)
    shutdown = getattr(engine_cls, "shutdown", None)
    if callable(shutdown):
        @functools.wraps(shutdown)
        def _shutdown(self, *args, **kwargs):
            try:
                return shutdown(self, *args, **kwargs)
            finally:  # the engine stops: write what is still pending (a step whose output never came too)
                rec = getattr(self, "scheduler", None)
                if isinstance(rec, RecordingScheduler):
                    rec.close()

        engine_cls.shutdown = _shutdown
    engine_cls._kvmap_recording = True
