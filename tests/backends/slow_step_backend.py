"""A correct backend that is truly slow at one step: it sleeps SLEEP_S in the slot-mapping phase of step
SLOW_STEP (the outlier warning must name that step, and only that one)."""

from __future__ import annotations

import time

from kvmap.workers.host import NumpyWorker

SLOW_STEP = 7
SLEEP_S = 0.25  # log(0.25 s / a ~150 us step) = 7.4 > 14 / 0.6745 x MAD up to 0.36: a loaded machine cannot hide it


class SlowStepWorker(NumpyWorker):
    name = "slow_step"

    def compute_slot_mappings(self) -> None:
        if self.batch is not None and self.batch.step is not None and self.batch.step.step == SLOW_STEP:
            time.sleep(SLEEP_S)
        super().compute_slot_mappings()
