"""The paged KV cache's occupancy over the steps, per group and per DCP rank, beside contiguous allocation.

Rules:
- Measured from the worker's state after each step (outside every timed region): a live request (a row in the
  state, not preempted) holds the KV it has written, `num_computed_tokens + num_scheduled_tokens` of its last
  scheduled step; its block-table rows name the blocks it holds, but for a sliding-window or chunked-local group
  not those wholly before the window its last scheduled step started from (`GroupLayout.readable_lo`: vLLM's
  scheduler frees them, the worker's row keeps their stale ids). The null block (`null_block_id`) is held by
  no one.
- Per group: `in_use` = distinct block ids held; `shared` = those held by more than one request (prefix
  caching); `held` = tokens stored in them (a block shared by several requests counts once, with the most any of
  them wrote into it), per computed DCP rank (a rank stores the positions its interleave gives it). Free blocks
  = num_gpu_blocks - the null block - every group's in_use (vLLM's groups share one pool).
- Memory efficiency = held / (in_use x block_size) (per rank; summed over ranks for the group). Contiguous
  allocation: every live request reserving max_model_len (`live` x max_model_len), or its final length (the
  KV it holds when its life ends: `reserve_final`; a life is a request's time in a row, so it ends when the
  request finishes or is preempted under the v2 protocol, while a v1 preemption keeps the row and the life); both
  hold `tokens` = the live requests' KV lengths.
- One form per language: the compiled kernels (occupancy_kernels.py) compute a step's values; the numpy form
  (`_step_values`) stands in where numba cannot load. Both are held against the brute-force references of
  tests/test_kv_occupancy.py (bundled traces) and tests/test_kv_occupancy_random.py (random runs).
- No per-step Python objects, and what a step keeps is bounded: a step's values wait in a preallocated block of
  PENDING rows, then go on together, in step order, to the series and to the summary (memory efficiency: mean,
  p5, min; the most blocks in use), which runs as the steps go (kvsummary.py); a measured step keeps its live
  tokens and every step one entry of `reserve_final`'s difference array (4 bytes each, `array("i")`, 8 once a
  value needs it), for contiguous_final at the end. Every recorded step's values (the series the pictures and
  `--json` carry) are kept only when asked (`keep_series`), as the step log keeps its figures (steplog.Rows:
  int32 blocks, int64 once a value needs it, spilled), and handed over as one array.
"""

from __future__ import annotations

from array import array

import numpy as np

from kvmap.layout import rank_layouts
from kvmap.ondisk import release
from kvmap.run.kvsummary import Running
from kvmap.run.steplog import Rows, extend_ints, needs_int64

CONTIGUOUS = ("contiguous_max_len", "contiguous_final")  # the summaries of contiguous allocation
WINDOWED = ("sliding_window", "chunked_local")  # kinds whose blocks before the window vLLM frees
CHUNK = 1 << 14  # steps a summary pass holds at once (a long run never makes a float64 copy of a whole series)
PENDING = 1024  # steps whose values wait in `vals` before they are handed on (to the series and the summaries)
RECORD, MEASURE = 1, 2  # a pending step's kind: its values go to the series, to the summaries


def columns(num_groups: int, ranks: list[int], kv_groups: list[int]) -> list[str]:
    """The names of the series' columns: live, tokens, reserve_final, then per group in_use, shared and (KV
    groups) held per rank."""
    cols = ["live", "tokens", "reserve_final"]
    for g in range(num_groups):
        cols += [f"g{g}.in_use", f"g{g}.shared"]
        if g in kv_groups:
            cols += [f"g{g}.held.r{r}" for r in ranks]
    return cols


def _rank_tokens(x: np.ndarray, cp: int, rank: int, interleave: int) -> np.ndarray:
    """Positions 0..x-1 (each x) that DCP rank `rank` stores: interleave-sized runs dealt round robin."""
    cycle = interleave * cp
    return (x // cycle) * interleave + np.clip(x % cycle - rank * interleave, 0, interleave)


class Occupancy:
    """The tally: `add(...)` after every replayed step, `finish(steps)` once at the end."""

    def __init__(self, worker, keep_series: bool = True, ranks=None) -> None:
        """`ranks`: the DCP ranks to account (None: the worker's); every rank shares the worker's block tables."""
        st = worker.state
        h = worker.header
        self.state = st
        self.null = h.null_block_id
        self.pool = h.num_gpu_blocks
        self.ranks = list(worker.ranks if ranks is None else ranks)
        self.layouts = worker.rank_layouts if ranks is None else rank_layouts(h, self.ranks)  # [ranks][G]
        self.kv_groups = list(st.kv_groups)
        self.cols = columns(h.num_groups, self.ranks, self.kv_groups)
        R = h.max_num_seqs
        self.kv_len = np.zeros(R, dtype=np.int64)  # [R] row -> KV tokens written (its last scheduled step)
        self.computed = np.zeros(R, dtype=np.int64)  # [R] row -> num_computed_tokens of its last scheduled step
        self.block_index = np.arange(max(st.max_num_blocks), dtype=np.int64)  # [width] logical block indices
        self.first = [0] * R  # [R] row -> the step its current life started
        self.alive: set[int] = set()  # rows a request owns (preempted under v1 included)
        self.live = np.zeros(0, dtype=np.int64)  # [live] rows of the requests holding KV (not preempted)
        self.diff = array("i")  # [steps + 1 - base] reserve_final's difference array (int64 once a value needs it)
        self.base = 0  # the step diff[0] stands for: the steps before it are summed into the summary and dropped
        self.carry = 0  # reserve_final's running sum over the dropped steps
        self.next_flush = 2 * CHUNK  # diff's length at which final steps are next looked for (_maybe_flush)
        self.keep = keep_series  # keep every recorded step's values (the series), not only the summary
        self.rows = Rows(len(self.cols))  # [recorded, len(cols)] the recorded steps' values (keep_series)
        self.max_len = h.max_model_len
        self.tokens = array("i")  # the measured steps' live KV tokens from step tok_from, for contiguous_final
        self.measured_from: int | None = None  # the first measured step's index among the replayed steps
        self.effs = _efficiency_columns(self.cols, [g.block_size for g in h.kv_cache_groups], self.ranks)
        self.running = {name: Running() for name in [*(e[0] for e in self.effs), *CONTIGUOUS]}
        self.top = {f"g{g}": [0, 0] for g in range(h.num_groups)}  # most blocks in use, shared (measured)
        self.top_cols = [(top, self.cols.index(f"{g}.in_use")) for g, top in self.top.items()]
        self.dirty = True  # owners changed since the last count
        self.known = np.zeros((h.num_groups, 2), dtype=np.int64)  # [G, 2] (shared, extra) as last counted
        self.vals = np.zeros((PENDING, len(self.cols)), dtype=np.int64)  # [PENDING, cols] steps not yet handed on
        self.kinds = np.zeros(PENDING, dtype=np.uint8)  # [PENDING] pending step -> RECORD | MEASURE
        self.pending = 0
        self.kernels = _kernels()
        self.groups = [self._group(g, col) for g, (_, col) in enumerate(self.top_cols)]  # col: the group's in_use
        # [pool] the kernels' id counts, all zero between steps (the first computed step counts: owners are new)
        self.counts = np.zeros(self.pool if self.kernels is not None else 0, dtype=np.uint8)

    def _group(self, g: int, col: int) -> tuple:
        """Group g's arguments to `group_values`: (column, kind, its parameter, virtual block size, per-rank
        [block_size, cp_size, cp_rank, interleave] rows (none for a group without KV))."""
        lay = self.layouts[0][g]
        kind = {"sliding_window": 1, "chunked_local": 2}.get(lay.kind, 0)
        param = lay.sliding_window if kind == 1 else lay.attention_chunk_size if kind == 2 else 0
        ranks = [(r.block_size, r.cp_size, r.cp_rank, r.interleave) for r in (lays[g] for lays in self.layouts)]
        ranks = np.array(ranks if g in self.kv_groups else [], dtype=np.int64).reshape(-1, 4)
        return col, kind, int(param or 0), lay.virtual_block_size, ranks

    def add(self, i: int, step, batch, new_rows: list[int], record: bool, measured: bool) -> None:
        """Step `i` (`step`) has run with `batch` (rows, num_scheduled_tokens); `new_rows` started a life in it;
        `record`: a recorded step (warm-up or measured), `measured`: a measured one (the summary's).
        Rows change owner only in a step that adds, finishes, preempts or resumes requests: only then are the
        owners read again."""
        st = self.state
        _grow(self, "diff", 0)
        if len(self.diff) >= self.next_flush and not self.keep:
            self._maybe_flush(i)
        so = step.scheduler_output
        if new_rows or so.finished_req_ids or so.preempted_req_ids or so.scheduled_cached_reqs.resumed_req_ids:
            self._owners(i, new_rows)
        k = self.kernels
        if k is not None:
            k.batch_kv(batch.rows, batch.num_scheduled_tokens, st.num_computed_tokens, self.kv_len, self.computed)
        else:
            rows = batch.rows
            computed = st.num_computed_tokens[rows]
            self.computed[rows] = computed
            self.kv_len[rows] = computed + batch.num_scheduled_tokens  # KV after this step
        kind = (RECORD if record and self.keep else 0) | (MEASURE if measured else 0)
        if not kind:
            return
        if measured and self.measured_from is None:
            self.measured_from = self.tok_from = i
        n = self.pending
        self.kinds[n] = kind
        out = self.vals[n]
        if k is not None:
            self._step_kernels(out)
        else:
            out[:] = self._step_values(self.live)
        self.pending = n + 1
        if self.pending == PENDING:
            self._hand_on()

    def _step_kernels(self, out: np.ndarray) -> None:
        """The step's values into `out` by the compiled kernels (occupancy_kernels.py)."""
        k, st = self.kernels, self.state
        live, kv_len, computed, known = self.live, self.kv_len, self.computed, self.known
        recount, self.dirty = self.dirty, False
        k.live_tokens(out, live, kv_len)
        null = -1 if self.null is None else self.null
        for g, (col, kind, param, vbs, ranks) in enumerate(self.groups):
            k.group_values(out, col, st.block_tables[g], st.num_blocks[g], live, kv_len, computed, kind, param, vbs,
                           null, self.counts, known[g], recount, ranks)

    def _hand_on(self) -> None:
        """The pending steps' values on: the recorded ones to the series, the measured ones into the running
        summaries (memory efficiency, most blocks), in step order."""
        n, self.pending = self.pending, 0
        vals, kinds = self.vals[:n], self.kinds[:n]
        if self.keep:
            self.rows.extend_many(vals[(kinds & RECORD) != 0])
        v = vals[(kinds & MEASURE) != 0]
        if not len(v):
            return
        self.tokens = extend_ints(self.tokens, v[:, 1])
        for name, in_use, held, bs in self.effs:
            m = v[v[:, in_use] != 0]
            self.running[name].add_many(m[:, held].sum(axis=1) / (m[:, in_use] * (bs * len(held))))
        m = v[v[:, 0] != 0]
        self.running["contiguous_max_len"].add_many(m[:, 1] / (m[:, 0] * self.max_len))
        for top, k in self.top_cols:  # in_use, then shared
            top[0], top[1] = max(top[0], int(v[:, k].max())), max(top[1], int(v[:, k + 1].max()))

    def _maybe_flush(self, i: int) -> None:
        """Sum the steps whose reserve_final is known into the summary and drop them: a step's is known once every
        life it saw has ended (before the first step of every life still running, and before this one)."""
        self._hand_on()
        upto = min([i, *(self.first[r] for r in self.alive)])
        if upto - self.base >= CHUNK:
            self._flush(upto)
        self.next_flush = len(self.diff) + CHUNK

    def _flush(self, upto: int) -> None:
        """Steps base..upto-1 are final: their contiguous_final ratios into the summary, CHUNK steps at a time;
        then they are dropped."""
        n = upto - self.base
        diff = np.frombuffer(self.diff, dtype=self.diff.typecode)[:n]
        tokens = np.frombuffer(self.tokens, dtype=self.tokens.typecode)
        used = 0
        if self.measured_from is not None:
            lo, hi = max(self.base, self.tok_from), min(upto, self.tok_from + len(tokens))
            carry = self.carry + int(diff[: max(lo - self.base, 0)].sum(dtype=np.int64))
            for s in range(lo, hi, CHUNK):
                e = min(s + CHUNK, hi)
                part = np.cumsum(diff[s - self.base : e - self.base], dtype=np.int64)
                part += carry
                carry = int(part[-1])
                self.running["contiguous_final"].add_many(_ratio(tokens[s - self.tok_from : e - self.tok_from],
                                                                 part))
            used = max(hi - self.tok_from, 0)
        self.carry += int(diff.sum(dtype=np.int64))
        del diff, tokens
        self.diff, self.tokens = array(self.diff.typecode, self.diff[n:]), array(self.tokens.typecode,
                                                                                self.tokens[used:])
        self.base = upto
        if self.measured_from is not None:
            self.tok_from += used

    def _owners(self, i: int, new_rows: list[int]) -> None:
        """Read the rows' owners after step `i`: close the lives that ended (their final reservation spans
        first..i-1), start those of `new_rows`. Python sets: a handful of rows change in a step."""
        st = self.state
        owned = set(st.req_id_to_index.values())
        ended = (self.alive - owned) | (self.alive & set(new_rows))
        kv_len, first = self.kv_len, self.first
        for r in ended:
            n = int(kv_len[r])
            _bump(self, first[r], n)
            _bump(self, i, -n)
        for r in new_rows:
            first[r] = i
        self.alive = owned
        self.dirty = True
        self.live = np.fromiter(owned if not st.preempted else
                                (r for q, r in st.req_id_to_index.items() if q not in st.preempted), np.int64)

    def _step_values(self, live: np.ndarray) -> list[int]:
        """One recorded step's values, in `cols` order (reserve_final is filled in at the end). A shared block
        is a cached full block (vLLM shares only full blocks), and a dropped one (null, or before the window) lay
        wholly before it: each stores a full block per rank, so held = every row's stored tokens less those.
        Blocks become shared or null only when owners change (a prefix hit comes with a new request): in other
        steps a full-attention group only appends fresh blocks, so its shared and extra entries stay as counted."""
        st = self.state
        kv_len = self.kv_len[live]
        out = [len(live), int(kv_len.sum()), 0]
        recount, self.dirty = self.dirty, False
        for g, table in enumerate(st.block_tables):
            lay0 = self.layouts[0][g]
            nb = st.num_blocks[g, live]
            skip = None
            if lay0.kind in WINDOWED:  # vLLM frees the blocks before the window: the held range moves each step
                skip = np.minimum(lay0.readable_lo(self.computed[live]) // lay0.virtual_block_size, nb)
            if recount or skip is not None:
                self.known[g] = self._count(table, live, nb, skip)
            shared, extra = self.known[g]  # blocks held by several rows; entries that are not a distinct block
            entries = int(nb.sum()) - (int(skip.sum()) if skip is not None else 0)
            out += [entries - extra, shared]
            if g not in self.kv_groups:
                continue
            dropped = int(skip.sum()) if skip is not None else 0  # leading blocks freed (full on every rank)
            for k in range(len(self.ranks)):
                lay = self.layouts[k][g]
                end = np.minimum(kv_len, nb * lay.virtual_block_size)
                if lay.cp_size > 1:
                    end = _rank_tokens(end, lay.cp_size, lay.cp_rank, lay.interleave)
                out.append(int(end.sum()) - (extra + dropped) * lay.block_size)
        return out

    def _count(self, table: np.ndarray, live: np.ndarray, nb: np.ndarray, skip: np.ndarray | None) -> tuple[int, int]:
        """(blocks held by more than one row, held entries that are not a distinct block: shares and nulls)."""
        width = int(nb.max()) if len(nb) else 0
        mask = self.block_index[:width] < nb[:, None]  # [live, width] the rows' entries
        if skip is not None:
            mask &= self.block_index[:width] >= skip[:, None]
        ids = table[live, :width][mask]
        count = np.bincount(ids, minlength=self.pool)
        if self.null is not None:
            count[self.null] = 0
        return int(np.count_nonzero(count > 1)), len(ids) - int(np.count_nonzero(count))

    def finish(self, steps: int) -> tuple[np.ndarray, dict]:
        """After `steps` replayed steps: (the recorded steps' series [recorded, len(cols)], int32 or int64 as the
        values need, empty without keep_series; the summary {efficiency: {name: {mean, p5, min, steps}}, groups:
        {g: {max_in_use, max_shared}}}). The lives still running end with the trace."""
        self._hand_on()
        _grow(self, "diff", 0)
        for r in self.alive:
            n = int(self.kv_len[r])
            _bump(self, self.first[r], n)
            _bump(self, steps, -n)
        out = self.rows.take()
        if len(out):  # the series' reserve_final column, before _flush drops the difference array
            out = _fill_reserve(np.frombuffer(self.diff, dtype=self.diff.typecode)[: steps - self.base], self.carry,
                                out)
        self._flush(steps)
        self.diff = array("i")
        self.tokens = array("i")
        summary = {"efficiency": {k: x.summary() for k, x in self.running.items()},
                   "groups": {g: {"max_in_use": a, "max_shared": b} for g, (a, b) in self.top.items()}}
        return out, summary


def _fill_reserve(diff: np.ndarray, carry: int, out: np.ndarray) -> np.ndarray:
    """`out` (the last len(out) of diff's steps) with column 2 the running sum of `diff` from `carry` (each step's
    reserve_final), CHUNK steps at a time, each let go (a series on disk stays there: ondisk.py); an int64 copy
    once a value passes int32."""
    skip = len(diff) - len(out)
    carry += int(diff[:skip].sum(dtype=np.int64))
    for lo in range(0, len(out), CHUNK):
        part = np.cumsum(diff[skip + lo : skip + lo + CHUNK], dtype=np.int64)
        part += carry
        carry = int(part[-1])
        if out.dtype == np.int32 and needs_int64(part):
            out = out.astype(np.int64)
        out[lo : lo + CHUNK, 2] = part
        release(out)
    return out


def _efficiency_columns(cols: list[str], block_sizes: list[int], ranks: list[int]) -> list[tuple]:
    """(summary name, in_use column, held columns, block_size) per KV group, then per rank with several."""
    out = []
    for g, bs in enumerate(block_sizes):
        held = [cols.index(f"g{g}.held.r{r}") for r in ranks if f"g{g}.held.r{r}" in cols]
        if not held:
            continue
        in_use = cols.index(f"g{g}.in_use")
        out.append((f"g{g}", in_use, held, bs))
        if len(held) > 1:
            out += [(f"g{g}.r{r}", in_use, [c], bs) for r, c in zip(ranks, held)]
    return out


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    b = b.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)


def _grow(tally, name: str, value: int) -> None:
    """Append to an int32 array, widened to int64 the first time a value needs it."""
    arr = getattr(tally, name)
    try:
        arr.append(value)
    except OverflowError:
        setattr(tally, name, array("q", arr))
        getattr(tally, name).append(value)


def _kernels():
    """The compiled kernels (occupancy_kernels.py), or None where numba cannot load (the numpy form then)."""
    from kvmap import aot
    from kvmap.errors import KvmapError

    try:
        return aot.load("kvmap.run.occupancy_kernels")
    except KvmapError:
        return None


def _bump(tally, at: int, delta: int) -> None:
    """diff[at] += delta (`at` a step index; diff starts at step `base`), widening diff to int64 when the sum
    needs it."""
    try:
        tally.diff[at - tally.base] += delta
    except OverflowError:
        tally.diff = array("q", tally.diff)
        tally.diff[at - tally.base] += delta
