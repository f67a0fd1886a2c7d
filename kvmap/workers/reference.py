"""The reference worker: the explainer's chain in plain Python, one token at a time. It is the test oracle.

Rules: obviously correct before fast. It keeps its own state in dicts and lists (no numpy, nothing shared
with the vectorized workers except the parsed trace records), applies each step literally, and builds every
mapping by walking request -> row -> position -> logical block -> physical block -> slot. It owns every rule it
judges: it refuses what the host workers refuse (workers/state.py), in the same order, with the same located
`TraceError` (kind, step, request, group, field, message); a scheduled position without a block is `no_block`,
never a silent PAD_SLOT_ID. Under Model Runner V2 the gathered (dumped) rows of sliding-window groups start with
the null block 0 below the window (`GroupLayout.null_history_blocks`); slots walk the un-nulled rows, as
vLLM's slot kernel reads the persistent table. Outputs are the
plain-list `--dump-mappings` record, so they compare bit for bit with any other worker's `to_dict()`.
"""

from __future__ import annotations

import numpy as np

from kvmap.defaults import STANDIN_TOKEN_ID
from kvmap.errors import TraceError
from kvmap.forward.inputs import ForwardStep, forward_spec
from kvmap.forward.sampler import SamplerRows, corrections
from kvmap.kv.cache import KVCheckResult, PagedKVCache, RankedKVCache
from kvmap.layout import null_history_groups, rank_layouts, seq_layouts
from kvmap.trace import Step, TraceHeader
from kvmap.workers.contract import Worker
from kvmap.workers.mappings import DUMP_KEYS, BatchMappings, mappings_from_dict
from kvmap.workers.order import mrv2_key
from kvmap.workers.reference_rules import check_continuation, located


class ReferenceRequest:
    def __init__(self, row: int, tokens: list[int], num_computed_tokens: int, block_ids: list[list[int]]):
        self.row = row
        self.tokens = list(tokens)  # known tokens: prompt (or prefill_token_ids), then sampled
        self.num_computed_tokens = num_computed_tokens
        self.block_ids = [list(b) for b in block_ids]  # per group
        self.preempted = False
        self.prefill_len = len(tokens)  # MRV2 req_states.prefill_len: the tokens it was added with
        self.num_prompt_tokens = len(tokens)  # V1 input_batch.num_prompt_tokens (set from the prompt by _add)


class ReferenceWorker(Worker):
    name = "reference"
    computes_forward = True

    def __init__(self, header: TraceHeader, device: str = "cpu") -> None:
        super().__init__(header, device)
        self._set_layouts()
        self.free_rows = list(range(header.max_num_seqs))
        self.requests: dict[str, ReferenceRequest] = {}
        self.missing_samples = False
        self._standins = 0
        self._out: dict | None = None
        self._step: Step | None = None
        self._step_ids: dict[str, tuple[int, list[int]]] = {}  # req_id -> (first position, this step's ids)

    def set_ranks(self, ranks) -> None:
        super().set_ranks(ranks)
        self._set_layouts()

    def _set_layouts(self) -> None:
        h = self.header
        self.rank_layouts = rank_layouts(h, self.ranks)  # [num_ranks][G]
        self.layouts = self.rank_layouts[0]
        self.cp_size = h.decode_context_parallel_size
        self.kernel_split = h.has_kernel_split
        self.seq_layouts = seq_layouts(h, self.ranks)
        # [G] block ids a row holds: cdiv(max_model_len + k, block span), and 1 + k for a state group's
        # (uses_slot_mapping false) state indices
        k, width = h.num_speculative_tokens, h.max_model_len + h.num_speculative_tokens
        self.row_width = [-(-width // lay.virtual_block_size) if grp.uses_slot_mapping
                          else max(-(-width // lay.virtual_block_size), 1 + k)
                          for grp, lay in zip(h.kv_cache_groups, self.layouts)]

    @property
    def current_step(self) -> int:
        assert self._step is not None
        return self._step.step

    @property
    def num_standin_tokens(self) -> int:
        return self._standins

    # The phases the replay loop times; the reference does all its work in update_states and
    # compute_mappings, the others exist so that every worker has the same phases.
    def update_states(self, step: Step) -> None:
        """Apply the step in the host workers' order (workers/state.py), refusing what they refuse."""
        self._step = step
        self.forward = None
        so = step.scheduler_output
        budget = max(self.header.max_num_batched_tokens, self.header.max_num_scheduled_tokens or 0)
        if so.total_num_scheduled_tokens > budget:
            raise TraceError(f"{so.total_num_scheduled_tokens} tokens exceed the header's token budget {budget}",
                             line=step.line, step=step.step, field="total_num_scheduled_tokens")
        v2 = self.header.model_runner_protocol == "v2"
        freed = set(so.finished_req_ids) | (set(so.preempted_req_ids) if v2 else set())
        for r in sorted(freed):  # MRV2's finish_requests: sorted ids, whatever the trace's order
            self._free(r)
        for r in so.preempted_req_ids:
            if not v2 and r in self.requests:
                self.requests[r].preempted = True
        for nr in so.scheduled_new_reqs:
            self._add(step, nr)
        self._update_cached(step)
        self._check_positions(step)

    def _add(self, step: Step, nr) -> None:
        """A new request: a free row, its tokens and its block rows. A live one is a streaming-input
        continuation: checked against what it held, freed, and added again (the freed row comes straight back)."""
        held = self.requests.get(nr.req_id)
        if held is not None and not held.preempted:
            check_continuation(self.header, step, nr, held)
            self._free(nr.req_id)
        if nr.req_id in self.requests:
            raise self._error(step, nr.req_id, "scheduled as new while preempted (it must come back resumed)",
                              "scheduled_new_reqs", "new_id_not_new")
        if not self.free_rows:
            raise self._error(step, nr.req_id, f"more than max_num_seqs={self.header.max_num_seqs} live requests",
                              "scheduled_new_reqs", "budget_seqs")
        row = self.free_rows.pop()
        self._check_tokens(step, nr.req_id, nr.token_ids,
                           "prefill_token_ids" if nr.prefill_token_ids is not None else "prompt_token_ids")
        self._check_width(step, nr.req_id, nr.block_ids, "block_ids")
        self.requests[nr.req_id] = req = ReferenceRequest(row, nr.token_ids, nr.num_computed_tokens, nr.block_ids)
        req.num_prompt_tokens = len(nr.prompt_token_ids)

    def _update_cached(self, step: Step) -> None:
        """Cached requests: num_computed_tokens (less an async correction), resumed rows, full token lists,
        then appended blocks."""
        c = step.scheduler_output.scheduled_cached_reqs
        for r in c.req_ids:
            self._live(step, r, "scheduled_cached_reqs.req_ids")
        corr = step.async_spec.num_computed_tokens_correction if step.async_spec is not None else {}
        for r, nc in zip(c.req_ids, c.num_computed_tokens):
            k = corr.get(r, 0)  # async spec decode: the worker-true start
            if k > nc:
                raise self._error(step, r, f"correction {k} is larger than num_computed_tokens {nc}",
                                  "num_computed_tokens_correction", "schema")
            self.requests[r].num_computed_tokens = nc - k
        for r in c.resumed_req_ids:
            req = self._live(step, r, "scheduled_cached_reqs.resumed_req_ids")
            req.preempted = False
            new = c.new_block_ids[c.req_ids.index(r)]
            if new is None:
                raise self._error(step, r, "resumed without a replacement block row", "new_block_ids",
                                  "resumed_no_blocks")
            self._check_width(step, r, new, "new_block_ids")
            req.block_ids = [list(b) for b in new]
        for r, toks in c.all_token_ids.items():
            req = self._live(step, r, "all_token_ids")
            self._check_tokens(step, r, toks, "all_token_ids")
            req.tokens = list(toks)
            if r in c.resumed_req_ids:  # v1 protocol: MRV2 would re-add it with every token as prefill tokens
                req.prefill_len = len(toks)
        for r in c.req_ids:
            if self.requests[r].preempted:
                raise self._error(step, r, "scheduled after preemption without being resumed",
                                  "scheduled_cached_reqs.resumed_req_ids", "preempted_scheduled")
        for r, new in zip(c.req_ids, c.new_block_ids):
            if new is None or r in c.resumed_req_ids:
                continue
            req = self.requests[r]
            for g, ids in enumerate(new):
                if ids and len(req.block_ids[g]) + len(ids) > self.row_width[g]:
                    raise self._error(step, r, f"appending {len(ids)} blocks overflows the row width "
                                      f"{self.row_width[g]}", "new_block_ids", "row_width", group=g)
                req.block_ids[g].extend(ids)

    def _check_positions(self, step: Step) -> None:
        """Every scheduled position is within max_model_len, has a block in every group that addresses KV by
        position, and (before the drafts) holds a known token; in scheduler order, the same rule first."""
        so = step.scheduler_output
        ends = [(r, self._live(step, r, "num_scheduled_tokens").num_computed_tokens + n)
                for r, n in so.num_scheduled_tokens.items()]
        mml = self.header.max_model_len
        for r, end in ends:
            if end > mml:
                raise self._error(step, r, f"positions up to {end - 1} exceed max_model_len {mml}",
                                  "num_scheduled_tokens", "max_model_len")
        for g, (grp, layout) in enumerate(zip(self.header.kv_cache_groups, self.layouts)):
            span = layout.virtual_block_size
            for r, end in ends:
                have = len(self.requests[r].block_ids[g])
                if grp.uses_slot_mapping and have * span < end:
                    raise self._error(step, r, f"position {end - 1} has no block: the row holds {have} blocks of "
                                      f"{span} tokens", "block_ids/new_block_ids", "no_block", group=g)
        for r, end in ends:
            req = self.requests[r]
            real_end = end - len(so.scheduled_spec_decode_tokens.get(r, []))
            known = len(req.tokens)
            if real_end > known and not self.missing_samples:
                raise self._error(step, r, f"positions {known}..{real_end - 1} are past the request's {known} "
                                  "known tokens", "num_scheduled_tokens", "tokens_unknown")
            while len(req.tokens) < real_end:  # tokens the trace never recorded
                req.tokens.append(STANDIN_TOKEN_ID)
                self._standins += 1

    def _live(self, step: Step, req_id: str, field: str) -> ReferenceRequest:
        req = self.requests.get(req_id)
        if req is None:
            raise self._error(step, req_id, "unknown request: it was never added, or it already finished", field,
                              "unknown_request")
        return req

    def _check_tokens(self, step: Step, req_id: str, tokens: list[int], field: str) -> None:
        if len(tokens) > self.header.max_model_len:
            raise self._error(step, req_id, f"{len(tokens)} tokens exceed max_model_len {self.header.max_model_len}",
                              field, "max_model_len")

    def _check_width(self, step: Step, req_id: str, block_ids: list[list[int]], field: str) -> None:
        for g, ids in enumerate(block_ids):
            if len(ids) > self.row_width[g]:
                raise self._error(step, req_id, f"{len(ids)} blocks exceed the row width {self.row_width[g]}",
                                  field, "row_width", group=g)

    _error = staticmethod(located)

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
        self._step_ids = {}
        if self.v1_batch is not None:
            batch = [(r, so.num_scheduled_tokens[r]) for r in self.v1_order(step)]
        else:  # Python's sort is stable
            batch = sorted(sched, key=lambda e: mrv2_key(e[1], len(so.scheduled_spec_decode_tokens.get(e[0], [])), k))
        G = len(self.header.kv_cache_groups)
        out: dict = {"req_ids": [], "idx_mapping": [], "query_start_loc": [0], "seq_lens": [], "positions": [],
                     "input_ids": [], "block_tables": [[] for _ in range(G)],
                     "kernel_block_tables": [[] for _ in range(G)]}
        slots = [[[] for _ in range(G)] for _ in self.ranks]  # [num_ranks][G][T]
        kernel_rows: list[list[int]] = [[] for _ in range(G)]  # this request's kernel rows
        nulled = null_history_groups(self.header) if self.is_mrv2 else ()
        for req_id, n in batch:
            req = self.requests[req_id]
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            start = req.num_computed_tokens
            out["req_ids"].append(req_id)
            out["idx_mapping"].append(req.row)  # batch row -> request-state row
            out["query_start_loc"].append(out["query_start_loc"][-1] + n)
            out["seq_lens"].append(start + n)
            for g in range(G):
                gathered = list(req.block_ids[g])  # the forward-pass row
                if g in nulled:  # Model Runner V2: the null block 0 below the window
                    n0 = self.layouts[g].null_history_blocks(start)
                    gathered[:n0] = [0] * n0
                out["block_tables"][g].append(gathered)
                out["kernel_block_tables"][g].append(self.layouts[g].kernel_row(gathered))
                kernel_rows[g] = self.layouts[g].kernel_row(req.block_ids[g])  # slots: the un-nulled row
            real = n - len(drafts)
            first_input = len(out["input_ids"])
            for i in range(n):
                position = start + i
                out["positions"].append(position)
                if i < real:
                    out["input_ids"].append(req.tokens[position])
                else:
                    d = drafts[i - real]
                    if d < 0 and step.async_spec is not None and req_id in step.async_spec.spec_draft_token_ids:
                        d = step.async_spec.spec_draft_token_ids[req_id][i - real]
                    if d < 0:
                        self._standins += 1
                    out["input_ids"].append(d if d >= 0 else STANDIN_TOKEN_ID)
                for i, layouts in enumerate(self.rank_layouts):  # every position has a block (_check_positions)
                    for g, layout in enumerate(layouts):
                        if self.kernel_split:  # through the kernel row, as the attention kernel sees it
                            slots[i][g].append(layout.kernel_slot(kernel_rows[g], position))
                        else:
                            slots[i][g].append(layout.slot(req.block_ids[g], position))
            self._step_ids[req_id] = (start, out["input_ids"][first_input:])
        out["step"] = step.step
        if self.cp_size > 1:
            out["slot_mapping"] = slots
            out["dcp_local_seq_lens"] = [[lay.dcp_local_seq_len(s) for s in out["seq_lens"]]
                                         for lay in self.seq_layouts]
            if len(self.ranks) != self.cp_size:
                out["dcp_ranks"] = list(self.ranks)
        else:
            out["slot_mapping"] = slots[0]
        if not self.kernel_split:
            del out["kernel_block_tables"]
        self._out = {k: out[k] for k in DUMP_KEYS if k in out}

    def mappings_dict(self) -> dict:
        assert self._out is not None
        return self._out if self.forward is None else {**self._out, **self.forward.to_dict()}

    def forward_step(self) -> ForwardStep:
        """This step's rows as the forward parts read them, from the reference's own request records."""
        m = self.mappings()
        spec = self._step.scheduler_output.scheduled_spec_decode_tokens
        rows = SamplerRows(m.idx_mapping, m.query_start_loc, m.seq_lens, m.num_computed_tokens,
                           np.array([len(spec.get(r, ())) for r in self._out["req_ids"]], np.int32),
                           self._by_row(lambda q: q.prefill_len), self._by_row(lambda q: q.num_prompt_tokens),
                           m.input_ids, bool(spec), corrections(self._step, lambda: self._out["req_ids"]))
        return ForwardStep(rows, lambda: m, lambda: self._by_row(lambda q: q.tokens[-1]))

    def _by_row(self, value) -> np.ndarray:
        """[max_num_seqs] int32: value(request) at each live request's row, 0 elsewhere."""
        out = [0] * self.header.max_num_seqs
        for q in self.requests.values():
            out[q.row] = value(q)
        return np.array(out, np.int32)

    def prepare_forward(self) -> None:
        """The forward inputs by the scalar specs (kvmap/forward)."""
        assert self.forward_config is not None
        self.forward = forward_spec(self.forward_config, self.forward_step())

    def mappings(self) -> BatchMappings:
        assert self._out is not None
        return mappings_from_dict(self._out, len(self.header.kv_cache_groups), self.cp_size,
                                  [lay.kernel_blocks_per_block for lay in self.layouts])

    def write_kv(self, kv: PagedKVCache | RankedKVCache) -> None:
        m = self.mappings()
        shards = kv.shards if isinstance(kv, RankedKVCache) else [kv]
        for i, shard in enumerate(shards):
            shard.write(m.input_ids, m.positions, m.rank_slots(i))

    def verify_kv(self, kv: PagedKVCache | RankedKVCache, into: KVCheckResult) -> None:
        def check(i: int, shard: PagedKVCache) -> None:
            for g, grp in enumerate(self.header.kv_cache_groups):
                if grp.uses_slot_mapping:  # state groups hold no per-token KV
                    shard.verify_context(g, self.current_step, self._out["req_ids"], *self.readable_context(g, i),
                                         into=into)

        if isinstance(kv, RankedKVCache):
            kv.verify(into, check)
        else:
            check(0, kv)

    def append_sampled(self) -> None:
        step = self._step
        assert step is not None
        if step.sampled_token_ids is None:
            self.missing_samples = True
            return
        sampled = step.sampled_token_ids
        for r, toks in sampled.items():  # every row first: nothing is appended if one overflows
            if len(self._live(step, r, "sampled_token_ids").tokens) + len(toks) > self.header.max_model_len:
                raise self._error(step, r, "sampled tokens overflow max_model_len", "sampled_token_ids",
                                  "max_model_len")
        for r, toks in sampled.items():
            self.requests[r].tokens.extend(toks)

    def readable_context(self, group: int, rank_index: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                           np.ndarray]:
        """(batch_idx, position, slot, token id) of every position the scheduled requests may read that the
        `rank_index`-th computed DCP rank holds."""
        out: list[tuple[int, int, int, int]] = []
        layout = self.rank_layouts[rank_index][group]
        assert self._out is not None
        for b, (req_id, seq_len) in enumerate(zip(self._out["req_ids"], self._out["seq_lens"])):
            req = self.requests[req_id]
            start, step_ids = self._step_ids[req_id]
            for p in range(layout.readable_start(req.num_computed_tokens), seq_len):
                if not layout.is_local(p):
                    continue
                token = step_ids[p - start] if p >= start else req.tokens[p]
                out.append((b, p, layout.slot(req.block_ids[group], p), token))
        cols = np.array(out, dtype=np.int64).reshape(-1, 4)
        return cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3]

    def _free(self, req_id: str) -> None:
        req = self.requests.pop(req_id, None)
        if req is not None:
            self.free_rows.append(req.row)
