"""A planted vllm#51031 mistake: the virtual block taken from the kernel block size (kernel_block_size * cp)
instead of the manager's (block_size * cp). `validate --deep --backend` must name it at its step, request and
DCP rank."""

from __future__ import annotations

import numpy as np

from kvmap.workers.host import NumpyWorker


class VirtualBlockFromKernelSize(NumpyWorker):
    name = "vllm51031-bug"

    def compute_slot_mappings(self) -> None:
        super().compute_slot_mappings()
        b, buf, st = self.batch, self.buffers, self.state
        T = b.num_tokens
        if not self.multirank or not T:
            return
        idx = np.repeat(buf.idx_mapping[: b.num_reqs], buf.num_scheduled_tokens[: b.num_reqs])
        pos = buf.positions[:T]
        for i, lays in enumerate(self.rank_layouts):
            lay = lays[0]
            wrong_vb = pos // (lay.kernel_size * lay.cp_size)
            ids = st.block_tables[0][idx, np.minimum(wrong_vb, st.block_tables[0].shape[1] - 1)]
            buf.rank_slot_mapping[i, 0, :T] = lay.slots(ids, pos)
