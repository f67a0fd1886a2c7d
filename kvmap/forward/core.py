"""The step's core mappings that the forward parts read, without building the step's `BatchMappings`.

Rules:
- `CoreArrays` holds four of the mappings, as `BatchMappings` (workers/mappings.py) has them: the host workers
  give their own arrays directly (`ForwardStep.core`); any other worker leaves it None and `core_of` takes
  them from `step.mappings()`. Both give the same arrays, so a part's result does not depend on which.
- `StepArrays` is what the numba worker's one-pass builder reads (forward/compiled.py `NumbaForward.run`): the
  rows of `SamplerRows` (sampler.py) and the four of `CoreArrays`, as one plain tuple in the order below (a
  tuple costs a fraction of the objects it stands for; it is made and unpacked in one place each).
- Views valid for the step; never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class CoreArrays:
    slot_mapping: np.ndarray  # [G, T] int64, flat token -> slot (rank `rank`'s under DCP)
    positions: np.ndarray  # [T] int64, flat token -> position in its request
    tables: list  # [G] x [R, W_g] int32 the gathered tables (the kernel tables under a kernel split)
    rank: int  # the first computed DCP rank (0 without DCP)


# (query_start_loc [R + 1] int32, num_computed_tokens [R] int32, idx_mapping [R] int32 batch_idx ->
#  req_state_idx, seq_lens [R] int32, num_draft_tokens [R] int32 (batch order), has_drafts bool,
#  prefill_len [max_num_seqs] int32 req_state_idx -> MRV2's, num_prompt_tokens [max_num_seqs] int32 (V1's),
#  num_computed_tokens_correction [R] int32 | None, slot_mapping [G, T] int64, positions [T] int64,
#  tables [G] x [R, W_g] int32, rank int)
StepArrays = tuple


def from_mappings(m) -> CoreArrays:
    """The four of a `BatchMappings`."""
    tables = m.kernel_block_tables if m.kernel_block_tables is not None else m.block_tables
    return CoreArrays(m.slot_mapping, m.positions, tables, m.ranks[0])


def core_of(step) -> CoreArrays:
    """The step's `CoreArrays`: the worker's own (`step.core`) or its `BatchMappings`'."""
    c = step.core
    return from_mappings(step.mappings()) if c is None else c
