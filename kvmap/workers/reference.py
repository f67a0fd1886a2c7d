"""The reference worker: the explainer's chain in plain Python, one token at a time. It is the test oracle.

Rules: obviously correct before fast. It keeps its own state in dicts and lists (no numpy, nothing shared
with the vectorized workers except the parsed trace records), applies each step literally, and builds every
mapping by walking request -> row -> position -> logical block -> physical block -> slot. Outputs are the
plain-list `--dump-mappings` record, so they compare bit for bit with any other worker's `to_dict()`.
"""

from __future__ import annotations

import numpy as np

from kvmap.workers.buffers import PAD_SLOT_ID
from kvmap.errors import TraceError
from kvmap.workers.state import STANDIN_TOKEN_ID
from kvmap.trace import Step, TraceHeader


class ReferenceRequest:
    def __init__(self, row: int, tokens: list[int], num_computed_tokens: int, block_ids: list[list[int]]):
        self.row = row
        self.tokens = list(tokens)  # known tokens: prompt (or prefill_token_ids), then sampled
        self.num_computed_tokens = num_computed_tokens
        self.block_ids = [list(b) for b in block_ids]  # per group
        self.preempted = False


class ReferenceWorker:
    name = "reference"

    def __init__(self, header: TraceHeader) -> None:
        self.header = header
        self.free_rows = list(range(header.max_num_seqs))
        self.requests: dict[str, ReferenceRequest] = {}
        self.missing_samples = False
        self.num_standin_tokens = 0
        self._out: dict | None = None
        self._step: Step | None = None
        self._step_ids: dict[str, tuple[int, list[int]]] = {}  # req_id -> (first position, this step's ids)

    @property
    def current_step(self) -> int:
        assert self._step is not None
        return self._step.step

    # The phases the replay loop times; the reference does all its work in update_states and
    # compute_mappings, the others exist so that every worker has the same phases.
    def update_states(self, step: Step) -> None:
        self._step = step
        so = step.scheduler_output
        for r in so.finished_req_ids:
            self._free(r)
        for r in so.preempted_req_ids:
            if self.header.model_runner_protocol == "v2":
                self._free(r)
            elif r in self.requests:
                self.requests[r].preempted = True
        for nr in so.scheduled_new_reqs:
            if nr.req_id in self.requests:
                raise TraceError("scheduled as a new request while it is still live", step=step.step,
                                 line=step.line, req_id=nr.req_id, field="scheduled_new_reqs")
            if not self.free_rows:
                raise TraceError("more than max_num_seqs live requests", step=step.step, line=step.line,
                                 req_id=nr.req_id, field="scheduled_new_reqs")
            row = self.free_rows.pop()
            self.requests[nr.req_id] = ReferenceRequest(row, nr.token_ids, nr.num_computed_tokens, nr.block_ids)
        c = so.scheduled_cached_reqs
        for i, r in enumerate(c.req_ids):
            if r not in self.requests:
                raise TraceError("unknown request", step=step.step, line=step.line, req_id=r,
                                 field="scheduled_cached_reqs.req_ids")
            req = self.requests[r]
            req.num_computed_tokens = c.num_computed_tokens[i]
            if r in c.all_token_ids:
                req.tokens = list(c.all_token_ids[r])
            new = c.new_block_ids[i]
            if r in c.resumed_req_ids:
                req.preempted = False
                req.block_ids = [list(b) for b in new]
            elif new is not None:
                for g, ids in enumerate(new):
                    req.block_ids[g].extend(ids)
            if req.preempted:
                raise TraceError("scheduled after preemption without being resumed", step=step.step,
                                 line=step.line, req_id=r, field="scheduled_cached_reqs.resumed_req_ids")

    def prepare_batch(self) -> None:
        pass

    def prepare_inputs(self) -> None:
        pass

    def gather_block_tables(self) -> None:
        pass

    def compute_slot_mappings(self) -> None:
        step = self._step
        assert step is not None
        so = step.scheduler_output
        k = self.header.num_speculative_tokens
        sched = list(so.num_scheduled_tokens.items())  # scheduler order

        def key(item: tuple[str, int]) -> tuple[bool, bool, int]:
            req_id, n = item
            if k == 0:
                return (False, False, n)
            has_drafts = len(so.scheduled_spec_decode_tokens.get(req_id, [])) > 0
            return (not has_drafts, n != 1 + k, n)

        self._step_ids = {}
        batch = sorted(sched, key=key)  # Python's sort is stable
        out: dict = {"req_ids": [], "idx_mapping": [], "query_start_loc": [0], "seq_lens": [], "positions": [],
                     "input_ids": [], "block_tables": [[] for _ in self.header.kv_cache_groups],
                     "slot_mapping": [[] for _ in self.header.kv_cache_groups]}
        for req_id, n in batch:
            req = self.requests[req_id]
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            start = req.num_computed_tokens
            out["req_ids"].append(req_id)
            out["idx_mapping"].append(req.row)  # batch row -> request-state row
            out["query_start_loc"].append(out["query_start_loc"][-1] + n)
            out["seq_lens"].append(start + n)
            for g in range(len(self.header.kv_cache_groups)):
                out["block_tables"][g].append(list(req.block_ids[g]))
            real = n - len(drafts)
            first_input = len(out["input_ids"])
            while len(req.tokens) < start + real:  # tokens the trace never recorded
                if not self.missing_samples:
                    raise TraceError("positions past the request's known tokens", step=step.step,
                                     line=step.line, req_id=req_id, field="num_scheduled_tokens")
                req.tokens.append(STANDIN_TOKEN_ID)
                self.num_standin_tokens += 1
            for i in range(n):
                position = start + i
                out["positions"].append(position)
                if i < real:
                    out["input_ids"].append(req.tokens[position])
                else:
                    d = drafts[i - real]
                    out["input_ids"].append(d if d >= 0 else STANDIN_TOKEN_ID)
                for g, group in enumerate(self.header.kv_cache_groups):
                    bs = group.block_size
                    logical_block = position // bs
                    offset = position % bs
                    if logical_block >= len(req.block_ids[g]):
                        out["slot_mapping"][g].append(PAD_SLOT_ID)  # the vectorized worker rejects this first
                        continue
                    physical_block = req.block_ids[g][logical_block]
                    out["slot_mapping"][g].append(physical_block * bs + offset)
            self._step_ids[req_id] = (start, out["input_ids"][first_input:])
        out["step"] = step.step
        self._out = out

    def mappings_dict(self) -> dict:
        assert self._out is not None
        return self._out

    def mappings(self):
        return mappings_from_dict(self.mappings_dict(), len(self.header.kv_cache_groups))

    def append_sampled(self) -> None:
        step = self._step
        assert step is not None
        if step.sampled_token_ids is None:
            self.missing_samples = True
            return
        for r, toks in step.sampled_token_ids.items():
            self.requests[r].tokens.extend(toks)

    def readable_context(self, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(batch_idx, position, slot, token id) of every position the scheduled requests may read."""
        out: list[tuple[int, int, int, int]] = []
        g = self.header.kv_cache_groups[group]
        assert self._out is not None
        for b, (req_id, seq_len) in enumerate(zip(self._out["req_ids"], self._out["seq_lens"])):
            req = self.requests[req_id]
            lo = readable_start(g.kind, g.sliding_window, g.attention_chunk_size, req.num_computed_tokens)
            start, step_ids = self._step_ids[req_id]
            for p in range(lo, seq_len):
                blk = req.block_ids[group][p // g.block_size]
                token = step_ids[p - start] if p >= start else req.tokens[p]
                out.append((b, p, blk * g.block_size + p % g.block_size, token))
        cols = np.array(out, dtype=np.int64).reshape(-1, 4)
        return cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3]

    def _free(self, req_id: str) -> None:
        req = self.requests.pop(req_id, None)
        if req is not None:
            self.free_rows.append(req.row)


def readable_lo(group, num_computed_tokens: np.ndarray) -> np.ndarray:
    """`readable_start` for a batch: [num_reqs] first readable position in a KV cache group."""
    if group.kind == "sliding_window":
        return np.maximum(num_computed_tokens - group.sliding_window + 1, 0)
    if group.kind == "chunked_local":
        return num_computed_tokens // group.attention_chunk_size * group.attention_chunk_size
    return np.zeros_like(num_computed_tokens)


def readable_start(kind: str, sliding_window: int | None, chunk: int | None, num_computed_tokens: int) -> int:
    """First position a step starting at `num_computed_tokens` may read (vLLM's skipped-token rule)."""
    if kind == "sliding_window":
        assert sliding_window is not None
        return max(0, num_computed_tokens - sliding_window + 1)
    if kind == "chunked_local":
        assert chunk is not None
        return num_computed_tokens // chunk * chunk
    return 0


def mappings_from_dict(d: dict, num_groups: int):
    """A plain-list mappings record -> `BatchMappings` (block rows right-padded with 0)."""
    from kvmap.workers.buffers import BatchMappings

    B = len(d["req_ids"])
    tables, nbs = [], []
    for rows in d["block_tables"]:
        w = max((len(r) for r in rows), default=0)
        t = np.zeros((B, w), dtype=np.int32)
        for b, r in enumerate(rows):
            t[b, : len(r)] = r
        tables.append(t)
        nbs.append([len(r) for r in rows])
    qsl = np.array(d["query_start_loc"], dtype=np.int32)
    seq = np.array(d["seq_lens"], dtype=np.int32)
    n = np.diff(qsl).astype(np.int32)
    return BatchMappings(
        req_ids=d["req_ids"],
        idx_mapping=np.array(d["idx_mapping"], dtype=np.int32),
        num_scheduled_tokens=n,
        num_computed_tokens=seq - n,
        query_start_loc=qsl,
        seq_lens=seq,
        positions=np.array(d["positions"], dtype=np.int64),
        input_ids=np.array(d["input_ids"], dtype=np.int32),
        block_tables=tables,
        num_blocks=np.array(nbs, dtype=np.int32).reshape(num_groups, B),
        slot_mapping=np.array(d["slot_mapping"], dtype=np.int64).reshape(num_groups, -1),
    )
