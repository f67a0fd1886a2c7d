"""Lazy torch import. Rules: nothing imports torch at module import time (it costs ~2 s and ~200 MiB);
code that needs it calls `torch()`. On CPU, torch gets one intra-op thread: with two on a 2-core machine,
ops stall 16-24 ms a step whenever the other core is busy (perf-facts.md)."""

from __future__ import annotations

from types import ModuleType

_torch: ModuleType | None = None


def torch() -> ModuleType:
    global _torch
    if _torch is None:
        import torch as t

        t.set_num_threads(1)
        _torch = t
    return _torch
