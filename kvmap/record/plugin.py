"""Live recording: a vLLM general plugin that records a running engine's scheduler to a kvmap trace.

Enable it by installing kvmap next to vLLM and naming an output file:
`KVMAP_RECORD_TRACE=/tmp/trace.jsonl.gz vllm serve ...` (`{pid}` in the name is replaced by the engine
process id, for several engine cores). vLLM calls `register()` in every process through the
`vllm.general_plugins` entry point; it patches `EngineCore.__init__` so that, once the scheduler exists, it is
wrapped by `RecordingScheduler` (the same class offline recording uses). The wrapper flushes every line and
never slows or breaks the engine: any failure is printed once and recording stops.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys

from kvmap.record.recorder import RecordingScheduler, TraceWriter, header_from_config

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


def install(engine_cls: type, path: str) -> None:
    """Wrap `engine_cls.__init__` so that its `scheduler` records to `path` (idempotent)."""
    if getattr(engine_cls, "_kvmap_recording", False):
        return
    original = engine_cls.__init__

    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        try:
            header = header_from_config(vllm_config, self.scheduler.kv_cache_config)
            writer = TraceWriter(path.replace("{pid}", str(os.getpid())), header)
            self.scheduler = RecordingScheduler(self.scheduler, writer)
            atexit.register(self.scheduler.close)
        except Exception as e:  # noqa: BLE001
            print(f"kvmap record: not recording ({type(e).__name__}: {e})", file=sys.stderr)

    engine_cls.__init__ = __init__
    engine_cls._kvmap_recording = True
