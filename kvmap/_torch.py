"""Lazy torch import. Rules: nothing imports torch at module import time (its cost: docs/performance.md,
"Start-up"); code that needs it calls `torch()`. On CPU, torch gets one intra-op thread: with two on a 2-core
machine, ops stall whenever the other core is busy."""

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
