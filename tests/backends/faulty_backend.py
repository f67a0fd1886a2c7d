"""A deliberately wrong user backend: vLLM-style off-by-one at block boundaries (the first token of every block
but the first takes its slot from the block before). `validate --deep --backend` must catch it."""

from __future__ import annotations

import numpy as np

from kvmap.workers.host import NumpyWorker


class OffByOneWorker(NumpyWorker):
    name = "off_by_one"

    def compute_slot_mappings(self) -> None:
        super().compute_slot_mappings()
        b, buf, st = self.batch, self.buffers, self.state
        T = b.num_tokens
        pos = buf.positions[:T]
        batch_idx = np.repeat(np.arange(b.num_reqs), buf.num_scheduled_tokens[: b.num_reqs])
        rows = buf.idx_mapping[: b.num_reqs][batch_idx]
        for g, table in enumerate(st.block_tables):
            bs = st.block_sizes[g]
            wrong = (pos % bs == 0) & (pos > 0)
            blocks = table[rows[wrong], pos[wrong] // bs - 1]  # the bug: the previous block
            buf.slot_mapping[g, :T][wrong] = blocks.astype(np.int64) * bs + pos[wrong] % bs


class NotAWorker:
    pass
