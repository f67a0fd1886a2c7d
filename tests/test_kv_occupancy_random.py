"""Random runs of the KV occupancy tally (run/occupancy.py), both forms (the compiled kernels and numpy), against a
brute-force reference: plain Python dicts and sets over a synthetic worker state, block by block and position by
position.

Most steps edit several fields at once: requests finish, are preempted (V1's protocol keeps the row, V2's drops
it), resume with new blocks, and arrive in freed rows with prefix-cache hits (another live request's full blocks,
the null block before a window) in the same step; scheduled rows append fresh blocks, windowed groups free the
blocks their window left (the row keeps the stale ids, which the pool hands out again). The generator keeps
vLLM's rules the tally relies on: only full blocks are shared or null; every change of owner is named in the
step; in a step without one, full-attention groups only append fresh ids; a resumed request computes back to its
length before it may end; no request passes max_model_len. Each seed runs with and without the series, and with
the pending block, the series' blocks (spilled to disk) and the summary's chunk made small; a failure names its
seed (`pytest -k "seed_17-"` replays it).
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace as NS

import numpy as np
import pytest

from kvmap.layout import GroupLayout
from kvmap.run import occupancy, steplog
from kvmap.run.kvsummary import BINS

SEEDS = range(120)
POOL = 200_000  # num_gpu_blocks: the ids a run can reach
KINDS = ["full_attention", "full_attention", "sliding_window", "chunked_local", "mamba"]


def config(seed: int) -> dict:
    """A random engine: 1-3 groups (the first full attention), DCP (small blocks, so that the reference can walk
    every position) or huge values (cp = 1, two or three rows, tokens a step in units of 2**22 or 2**24: sums past
    int32, in a few seeds only reserve_final's), a null block or none."""
    rnd = random.Random(seed)
    huge = rnd.random() < 0.25
    cp = 1 if huge else rnd.choice([1, 1, 2, 4])
    groups = []
    for g in range(rnd.randint(1, 3)):
        kind = rnd.choice(KINDS) if g else "full_attention"
        bs = 1 << 22 if huge else rnd.choice([2, 4, 16])
        vbs = bs * cp
        groups.append(NS(block_size=bs, kind=kind, uses_slot_mapping=kind != "mamba", dcp_sharded=kind != "mamba",
                         sliding_window=rnd.choice([vbs, 2 * vbs + 3, 5 * vbs]) if kind == "sliding_window" else None,
                         attention_chunk_size=rnd.choice([vbs, 2 * vbs, 3 * vbs + 1]) if kind == "chunked_local"
                         else None))
    ranks = sorted(rnd.sample(range(cp), rnd.randint(1, cp)))
    fits = [i for i in (1, 2, 8) if cp > 1 and all(g.block_size % i == 0 for g in groups)]  # vLLM: I divides bs
    return dict(seed=seed, cp=cp, interleave=rnd.choice(fits or [1]), groups=groups, ranks=ranks,
                R=rnd.randint(2, 3 if huge else 8), max_len=(1 << 31) - 1 if huge else 600,
                unit=rnd.choice([1 << 22, 1 << 24]) if huge else 1, null=rnd.choice([None, 0]),
                protocol=rnd.choice(["v1", "v2"]), steps=rnd.randint(5, 60),
                record_from=rnd.choice([0, 0, 2, 5]), measure_extra=rnd.choice([0, 0, 1, 3]))


def first_held(grp, computed: int, vbs: int) -> int:
    """The first block index a request holds: the blocks wholly before a window's readable start are freed."""
    if grp.kind == "sliding_window":
        return max(0, computed - grp.sliding_window + 1) // vbs
    if grp.kind == "chunked_local":
        return computed // grp.attention_chunk_size * grp.attention_chunk_size // vbs
    return 0


class Engine:
    """A synthetic scheduler and worker state (one pool of block ids, reference-counted): `run()` plays the steps
    and returns, per step, the state and the step as the tally sees them, and the reference's values."""

    def __init__(self, c: dict) -> None:
        self.c, self.rnd = c, random.Random(c["seed"] * 7 + 1)
        self.room = 50 * c["unit"]  # a request this close to max_model_len ends
        self.vbs = [g.block_size * (c["cp"] if g.dcp_sharded else 1) for g in c["groups"]]
        width = [math.ceil((c["max_len"] + 64) / v) if g.uses_slot_mapping else 1
                 for v, g in zip(self.vbs, c["groups"])]
        G, R = len(c["groups"]), c["R"]
        self.tables = [np.zeros((R, w), np.int32) for w in width]
        self.num_blocks = np.zeros((G, R), np.int32)
        self.num_computed = np.zeros(R, np.int32)  # row -> num_computed_tokens of its last scheduled step
        self.owner: dict[str, int] = {}  # req -> row
        self.preempted: set[str] = set()
        self.computed: dict[str, int] = {}  # req -> tokens computed before its next scheduled step
        self.kv_len: dict[int, int] = {}  # row -> KV written in its last scheduled step
        self.length: dict[str, int] = {}  # req -> the most KV it has held (a resumed request computes back to it)
        self.refs = [0] * POOL  # id -> held entries (all groups share one pool)
        self.allocated = 0  # ids with a held entry: every group's in_use summed, as the pool sees it
        self.free: list[int] = []
        self.next_id = 1 if c["null"] == 0 else 0
        self.lives: list[list[int]] = []  # [first step, last step, final KV]
        self.life_of: dict[int, list[int]] = {}
        self.n_new = 0

    def fresh(self) -> int:
        """An id no one holds (a freed one or a new one), now held once."""
        if self.free and self.rnd.random() < 0.5:
            b = self.free.pop(self.rnd.randrange(len(self.free)))
        else:
            b, self.next_id = self.next_id, self.next_id + 1
        return self.hold(b)

    def hold(self, b: int) -> int:
        """One more held entry of id b (a prefix hit shares a held id)."""
        self.allocated += not self.refs[b]
        self.refs[b] += 1
        return b

    def drop(self, b: int) -> None:
        """One held entry of id b less; the id goes back to the pool with its last one (the null block is held by
        no one)."""
        if b == self.c["null"]:
            return
        self.refs[b] -= 1
        if not self.refs[b]:
            self.allocated -= 1
            self.free.append(b)

    def release(self, row: int, g: int, lo: int, hi: int) -> None:
        """Drop row's entries lo..hi-1 of group g."""
        for b in self.tables[g][row, lo:hi].tolist():
            self.drop(b)

    def held_range(self, row: int, g: int) -> tuple[int, int]:
        """The entries of row's group g its request holds: from the window's first block to its blocks."""
        grp = self.c["groups"][g]
        lo = first_held(grp, int(self.num_computed[row]), self.vbs[g]) if grp.uses_slot_mapping else 0
        return min(lo, int(self.num_blocks[g, row])), int(self.num_blocks[g, row])

    def free_row(self, row: int) -> None:
        """A request ends or is preempted: every entry it holds is dropped."""
        for g in range(len(self.c["groups"])):
            self.release(row, g, *self.held_range(row, g))

    def place(self, q: str, donors: list[int]) -> None:
        """A new or resumed request's blocks: a prefix hit of whole blocks of every group (a multiple of their
        spans' least common multiple, at most a donor's KV), taken from the donor where it holds them, the null
        block (or a stale id) wholly before a window; then the request computes from the hit."""
        row, rnd, c = self.owner[q], self.rnd, self.c
        donor = rnd.choice(donors) if donors and rnd.random() < 0.6 else None
        unit = math.lcm(*(v for v, g in zip(self.vbs, c["groups"]) if g.uses_slot_mapping))
        most = 0  # a hit is at most what the donor holds, and what a resumed request had
        if donor is not None:
            most = min(self.kv_len[donor], c["max_len"] - self.room, self.length.get(q, c["max_len"]))
        computed = rnd.randint(0, most // unit) * unit if most > 0 else 0
        self.num_computed[row] = computed  # it is scheduled this step, from the hit
        for g, grp in enumerate(c["groups"]):
            t = self.tables[g]
            if not grp.uses_slot_mapping:
                t[row, 0] = self.fresh()
                self.num_blocks[g, row] = 1
                continue
            n, lo = computed // self.vbs[g], first_held(grp, computed, self.vbs[g])
            dlo, dhi = self.held_range(donor, g) if donor is not None else (0, 0)
            ids = []
            for j in range(n):
                if j < lo:  # freed before the window: the null block, or an id the pool may hand out again
                    ids.append(c["null"] if c["null"] is not None and rnd.random() < 0.8 else self.stale())
                elif dlo <= j < dhi and t[donor, j] != c["null"] and rnd.random() < 0.8:
                    ids.append(self.hold(int(t[donor, j])))
                else:
                    ids.append(self.fresh())
            t[row, :n] = ids
            self.num_blocks[g, row] = n
        self.computed[q] = computed

    def stale(self) -> int:
        """An id a row keeps after it was freed (the pool may hand it out again)."""
        b = self.fresh()
        self.drop(b)
        return b

    def events(self, i: int) -> tuple[list, list, list, list]:
        """This step's finished, preempted, resumed and new requests, applied to the state."""
        rnd, c = self.rnd, self.c
        fin, pre, res, new = [], [], [], []
        for q in list(self.owner):
            x = rnd.random()
            if self.computed[q] > c["max_len"] - self.room or x < 0.12 and self.computed[q] >= self.length[q]:
                fin.append(q)
            elif x < 0.2 and q not in self.preempted:
                pre.append(q)
            elif q in self.preempted and x < 0.6:
                res.append(q)
        for q in fin + pre:
            row = self.owner[q]
            if q not in self.preempted:
                self.free_row(row)
            if q in fin or c["protocol"] == "v2":
                del self.owner[q]
                self.preempted.discard(q)
            else:
                self.preempted.add(q)
        donors = [r for q, r in self.owner.items() if q not in self.preempted]  # each scheduled in its life
        for q in res:
            self.preempted.discard(q)
            self.place(q, donors)
        used = set(self.owner.values())
        for row in range(c["R"]):
            if row not in used and rnd.random() < 0.6:
                q = f"q{self.n_new}"
                self.n_new += 1
                self.owner[q] = row
                new.append(q)
                self.place(q, donors)
        return fin, pre, res, new

    def schedule(self, new_or_resumed: set[str]) -> tuple[list[str], list[int]]:
        """The live requests scheduled this step (a running one may wait a step) and their token counts; their
        blocks grow to cover the step (now and then one more, held empty: vLLM's lookahead slots), a window's
        passed blocks are freed (their ids stay in the row)."""
        rnd, unit, max_len = self.rnd, self.c["unit"], self.c["max_len"]
        sched = [q for q in self.owner if q not in self.preempted and (q in new_or_resumed or rnd.random() < 0.9)]
        rnd.shuffle(sched)
        counts = [min(rnd.choice([1, 1, 3, 16, 40]) * unit, max_len - self.computed[q]) for q in sched]
        for q, n in zip(sched, counts):
            row, comp = self.owner[q], self.computed[q]
            old = {g: self.held_range(row, g) for g in range(len(self.c["groups"]))}
            self.num_computed[row] = comp
            self.kv_len[row] = comp + n
            self.length[q] = max(self.length.get(q, 0), comp + n)
            for g, grp in enumerate(self.c["groups"]):
                if not grp.uses_slot_mapping:
                    continue
                need = math.ceil((comp + n) / self.vbs[g]) + (rnd.random() < 0.1)  # lookahead: a block held empty
                while self.num_blocks[g, row] < need:
                    self.tables[g][row, self.num_blocks[g, row]] = self.fresh()
                    self.num_blocks[g, row] += 1
                lo = self.held_range(row, g)[0]
                self.release(row, g, min(old[g][0], lo), lo)
            self.computed[q] = comp + n
        return sched, counts

    def reference_row(self, c: dict) -> dict:
        """The step's values by brute force: live rows, their tokens; per group the distinct held ids, those held
        by several rows, and per rank the tokens stored in them (a block counted once, with the most written)."""
        live = [r for q, r in self.owner.items() if q not in self.preempted]
        row = {"live": len(live), "tokens": sum(self.kv_len[r] for r in live), "reserve_final": 0}
        for g, grp in enumerate(c["groups"]):
            holders: dict[int, list] = {}
            for r in live:
                lo, hi = self.held_range(r, g)
                for j in range(lo, hi):
                    b = int(self.tables[g][r, j])
                    if b != c["null"]:
                        holders.setdefault(b, []).append((r, j))
            row[f"g{g}.in_use"] = len(holders)
            row[f"g{g}.shared"] = sum(len(v) > 1 for v in holders.values())
            if not grp.uses_slot_mapping:
                continue
            span, cp, inter = self.vbs[g], c["cp"], c["interleave"]
            for rank in c["ranks"]:
                stored = {}  # row -> tokens this rank stores in each of the row's blocks, position by position
                for r in live:
                    n, kv = int(self.num_blocks[g, r]), self.kv_len[r]
                    if cp == 1:  # every position (huge runs have cp = 1)
                        stored[r] = [max(0, min(kv, (j + 1) * span) - j * span) for j in range(n)]
                        continue
                    p = np.arange(kv)
                    stored[r] = np.bincount(p[(p // inter) % cp == rank] // span, minlength=n).tolist()
                row[f"g{g}.held.r{rank}"] = sum(max(stored[r][j] for r, j in v) for v in holders.values())
        return row

    def run(self):
        """[(num_computed, tables, num_blocks, owner, preempted, step, batch, new_rows)], reference rows."""
        out, ref, c = [], [], self.c
        for i in range(c["steps"]):
            fin, pre, res, new = self.events(i)
            sched, counts = self.schedule(set(new) | set(res))
            for q in new:
                life = [i, i, 0]
                self.lives.append(life)
                self.life_of[self.owner[q]] = life
            for r in self.owner.values():  # a life reserves the KV it holds when it ends
                self.life_of[r][1], self.life_of[r][2] = i, self.kv_len.get(r, 0)
            so = NS(finished_req_ids=fin, preempted_req_ids=pre, scheduled_cached_reqs=NS(resumed_req_ids=res))
            batch = NS(rows=np.array([self.owner[q] for q in sched], np.int32),
                       num_scheduled_tokens=np.array(counts, np.int32))
            out.append((self.num_computed.copy(), [t.copy() for t in self.tables], self.num_blocks.copy(),
                        dict(self.owner), set(self.preempted), NS(scheduler_output=so), batch,
                        [self.owner[q] for q in new]))
            ref.append(self.reference_row(c))
            assert sum(ref[-1][f"g{g}.in_use"] for g in range(len(c["groups"]))) == self.allocated, c["seed"]
        for i, row in enumerate(ref):
            row["reserve_final"] = sum(x[2] for x in self.lives if x[0] <= i <= x[1])
        return out, ref


def tally(c: dict, steps: list, form: str, keep: bool, monkeypatch, small: bool):
    """Drive an Occupancy over the snapshots: (series, summary)."""
    with monkeypatch.context() as m:
        if form == "numpy":
            m.setattr(occupancy, "_kernels", lambda: None)
        if small:
            m.setattr(occupancy, "CHUNK", 2)
            m.setattr(occupancy, "PENDING", 3)
            m.setattr(steplog, "BLOCK", 2)
        G, R = len(c["groups"]), c["R"]
        st = NS(num_computed_tokens=np.zeros(R, np.int32), block_tables=[np.zeros_like(t) for t in steps[0][1]],
                num_blocks=np.zeros((G, R), np.int32), req_id_to_index={}, preempted=set(),
                kv_groups=[g for g, x in enumerate(c["groups"]) if x.uses_slot_mapping],
                max_num_blocks=[t.shape[1] for t in steps[0][1]])
        h = NS(null_block_id=c["null"], num_gpu_blocks=POOL, max_num_seqs=R, num_groups=G,
               max_model_len=c["max_len"], kv_cache_groups=c["groups"])
        layouts = [[GroupLayout.of(g, c["cp"], rank, c["interleave"]) for g in c["groups"]] for rank in c["ranks"]]
        occ = occupancy.Occupancy(NS(state=st, header=h, ranks=c["ranks"], rank_layouts=layouts), keep_series=keep)
        measure_from = c["record_from"] + c["measure_extra"]
        for i, (nc, tables, nb, owner, pre, step, batch, new_rows) in enumerate(steps):
            np.copyto(st.num_computed_tokens, nc)
            for dst, src in zip(st.block_tables, tables):
                np.copyto(dst, src)
            np.copyto(st.num_blocks, nb)
            st.req_id_to_index, st.preempted = owner, pre
            occ.add(i, step, batch, new_rows, i >= c["record_from"], i >= measure_from)
        return occ.finish(len(steps))


def expected_summary(c: dict, ref: list[dict]) -> dict:
    """The summary's figures from the reference rows: each ratio over the measured steps, NaN skipped."""
    measured = ref[c["record_from"] + c["measure_extra"]:]
    ratios: dict[str, list[float]] = {}
    for g, grp in enumerate(c["groups"]):
        if not grp.uses_slot_mapping:
            continue
        bs = grp.block_size
        ratios[f"g{g}"] = [sum(r[f"g{g}.held.r{k}"] for k in c["ranks"]) / (r[f"g{g}.in_use"] * bs * len(c["ranks"]))
                           for r in measured if r[f"g{g}.in_use"]]
        if len(c["ranks"]) > 1:
            for k in c["ranks"]:
                ratios[f"g{g}.r{k}"] = [r[f"g{g}.held.r{k}"] / (r[f"g{g}.in_use"] * bs) for r in measured
                                        if r[f"g{g}.in_use"]]
    ratios["contiguous_max_len"] = [r["tokens"] / (r["live"] * c["max_len"]) for r in measured if r["live"]]
    ratios["contiguous_final"] = [r["tokens"] / r["reserve_final"] for r in measured if r["reserve_final"] > 0]
    groups = {f"g{g}": {"max_in_use": max([0] + [r[f"g{g}.in_use"] for r in measured]),
                        "max_shared": max([0] + [r[f"g{g}.shared"] for r in measured])}
              for g in range(len(c["groups"]))}
    return {"ratios": ratios, "groups": groups}


def check_summary(got: dict, want: dict, seed: int) -> None:
    """Groups' maxima, steps, mean (summed one by one in step order) and minimum exact; p5 read from the
    histogram's lower bin edges: at most 1 / BINS under numpy's (values above 1 share the last bin)."""
    assert got["groups"] == want["groups"], f"seed {seed}"
    assert set(got["efficiency"]) == set(want["ratios"]), f"seed {seed}"
    for name, values in want["ratios"].items():
        s = got["efficiency"][name]
        assert s["steps"] == len(values), f"seed {seed} {name}"
        if not values:
            assert s["mean"] is None, f"seed {seed} {name}"
            continue
        total = 0.0
        for v in values:  # the mean is the values summed one by one in step order
            total += v
        assert (s["mean"], s["min"]) == (total / len(values), min(values)), f"seed {seed} {name}"
        p5 = float(np.percentile(values, 5))
        assert min(p5, 1.0) - 1 / BINS - 1e-12 <= s["p5"] <= p5 + 1e-12, f"seed {seed} {name}"


@pytest.mark.parametrize("form", ["kernels", "numpy"])
@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed_{s}" for s in SEEDS])
def test_random_runs_equal_the_reference(seed, form, monkeypatch):
    if form == "kernels":
        pytest.importorskip("numba")
        assert occupancy._kernels() is not None
    c = config(seed)
    steps, ref = Engine(c).run()
    kv_groups = [g for g, x in enumerate(c["groups"]) if x.uses_slot_mapping]
    cols = occupancy.columns(len(c["groups"]), c["ranks"], kv_groups)
    want_series = np.array([[r[k] for k in cols] for r in ref[c["record_from"]:]], np.int64).reshape(-1, len(cols))
    want = expected_summary(c, ref)
    summaries = []
    for keep in (True, False):
        for small in (False, True):
            series, summary = tally(c, steps, form, keep, monkeypatch, small)
            if keep:
                assert series.tolist() == want_series.tolist(), f"seed {seed} (small blocks: {small})"
                wide = want_series.size and (want_series.max() > 2**31 - 1)
                assert series.dtype == (np.int64 if wide else np.int32), f"seed {seed}"
            else:
                assert not len(series)
            check_summary(summary, want, seed)
            summaries.append(summary)
    assert all(s == summaries[0] for s in summaries), f"seed {seed}"  # to the bit, however handed on
