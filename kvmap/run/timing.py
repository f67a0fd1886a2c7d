"""Device timing: CUDA events from a pool, recorded at every phase boundary, resolved late.

Rules: recording an event costs a few microseconds and never waits. Nothing synchronizes per phase or per step:
a step's events are resolved only when it is `lag` steps old (its work is long finished, so the wait is
normally zero) and at the end of the replay; resolved events go back to the pool. `elapsed_time` between
consecutive boundaries gives each phase's device time as the stream saw it (queueing included).
"""

from __future__ import annotations

from collections import deque

import numpy as np


class EventTimer:
    def __init__(self, num_phases: int, make_event, lag: int = 64) -> None:
        self.num_phases = num_phases
        self.make_event = make_event  # () -> an object with record(), synchronize(), elapsed_time(other) in ms
        self.lag = lag
        self.free: list = []
        self.pending: deque = deque()
        self.rows: list[np.ndarray] = []
        self.current: list = []

    def _event(self):
        return self.free.pop() if self.free else self.make_event()

    def mark(self) -> None:
        """Record a boundary: call once before the first phase of a step and after every phase."""
        ev = self._event()
        ev.record()
        self.current.append(ev)

    def end_step(self, keep: bool) -> None:
        evs, self.current = self.current, []
        if keep:
            self.pending.append(evs)
        else:
            self.pending.append(None)
            self.free.extend(evs)
        while len(self.pending) > self.lag:
            self._resolve(self.pending.popleft())

    def _resolve(self, evs) -> None:
        if evs is None:
            return
        evs[-1].synchronize()
        ns = [int(evs[i].elapsed_time(evs[i + 1]) * 1e6) for i in range(len(evs) - 1)]
        self.rows.append(np.array(ns, dtype=np.int64))
        self.free.extend(evs)

    def finish(self) -> np.ndarray:
        """[steps kept, num_phases] int64 ns."""
        while self.pending:
            self._resolve(self.pending.popleft())
        if not self.rows:
            return np.zeros((0, self.num_phases), dtype=np.int64)
        return np.stack(self.rows)
