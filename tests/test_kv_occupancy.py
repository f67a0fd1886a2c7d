"""The KV occupancy series (run/occupancy.py) against an obviously correct reference: plain Python sets and dicts
over the worker's state after every step, a block counted once with the most tokens any holder wrote into it, each
request life's final length (the KV it holds when it ends) known only then; and the memory-efficiency summary
against its formula."""

from __future__ import annotations

import numpy as np
import pytest

from kvmap.run.config import ReplayConfig
from dataclasses import replace

from kvmap.run.kvsummary import BINS
from kvmap.run.kvstats import efficiency_series, free_blocks, memory_dict
from kvmap.run.replay import replay
from kvmap.trace import Trace
from kvmap.workers.host import NumpyWorker

from .conftest import TRACES

TRACES_CHECKED = ["worked_example.jsonl", "prefix_caching.jsonl", "preemption_v1.jsonl", "preemption_v2.jsonl",
                  "hybrid_sliding_window.jsonl", "dcp2.jsonl", "dcp4_interleave8.jsonl", "spec_decode.jsonl",
                  "dcp2_mamba.jsonl", "kernel_block_split.jsonl", "chunked_local.jsonl"]


def _rank_of(p: int, cp: int, interleave: int) -> int:
    return (p // interleave) % cp


def reference(path):
    """Per step: {live, tokens, reserve_final, g{G}.in_use, g{G}.shared, g{G}.held.r{R}} by brute force."""
    t = Trace(path)
    h = t.header
    w = NumpyWorker(h)
    st = w.state
    kv_len: dict[str, int] = {}
    computed: dict[str, int] = {}
    lives: list[list] = []  # [first step, last step, longest]
    life_of: dict[str, list] = {}
    rows = []
    for s in t.steps():
        w.run_step(s)
        for r in s.new_req_ids:
            life_of[r] = [s.step, s.step, 0]
            lives.append(life_of[r])
        b = w.batch
        for r, n in zip(b.req_ids, b.num_scheduled_tokens.tolist()):
            computed[r] = int(st.num_computed_tokens[st.req_id_to_index[r]])
            kv_len[r] = computed[r] + n
        owners = [r for r in st.req_id_to_index]
        live = [r for r in owners if r not in st.preempted]
        for r in owners:
            life_of[r][1] = s.step
        for r in owners:  # a life reserves the KV it holds when it ends
            life_of[r][2] = kv_len[r]
        row = {"live": len(live), "tokens": sum(kv_len[r] for r in live)}
        for g, grp in enumerate(h.kv_cache_groups):
            holders: dict[int, list] = {}
            span = w.rank_layouts[0][g].virtual_block_size
            for r in live:
                i = st.req_id_to_index[r]
                first = 0  # vLLM frees the blocks wholly before the window (the worker keeps their ids)
                if grp.kind == "sliding_window":
                    first = max(0, computed[r] - grp.sliding_window + 1) // span
                elif grp.kind == "chunked_local":
                    first = computed[r] // grp.attention_chunk_size * grp.attention_chunk_size // span
                for j, blk in enumerate(st.block_tables[g][i, : st.num_blocks[g, i]].tolist()):
                    if blk != h.null_block_id and j >= first:
                        holders.setdefault(blk, []).append((r, j))
            row[f"g{g}.in_use"] = len(holders)
            row[f"g{g}.shared"] = sum(len(v) > 1 for v in holders.values())
            if not grp.uses_slot_mapping:
                continue
            for k, rank in enumerate(w.ranks):
                lay = w.rank_layouts[k][g]
                span = lay.virtual_block_size
                row[f"g{g}.held.r{rank}"] = sum(
                    max(sum(1 for p in range(j * span, min(kv_len[r], (j + 1) * span))
                            if lay.cp_size == 1 or _rank_of(p, lay.cp_size, lay.interleave) == rank)
                        for r, j in v) for v in holders.values())
        rows.append(row)
        w.append_sampled()
    for row_i, row in enumerate(rows):
        row["reserve_final"] = sum(x[2] for x in lives if x[0] <= row_i <= x[1])
    return rows


@pytest.mark.parametrize("form", ["kernels", "numpy"])
@pytest.mark.parametrize("name", TRACES_CHECKED)
def test_occupancy_equals_the_reference(name, form, monkeypatch):
    """Both forms of the per-step values: the compiled kernels (occupancy_kernels.py) and the numpy form used
    where numba cannot load."""
    from kvmap.run import occupancy

    if form == "numpy":
        monkeypatch.setattr(occupancy, "_kernels", lambda: None)
    else:
        pytest.importorskip("numba")
        assert occupancy._kernels() is not None
    r = replay(Trace(TRACES / name), ReplayConfig(nvtx=False, backend="numpy", write_kv=False, warmup=0))
    ref = reference(TRACES / name)
    assert len(r.kv_series) == len(ref)
    for i, row in enumerate(ref):
        got = dict(zip(r.kv_columns, r.kv_series[i].tolist()))
        assert got == row, f"step {i}"


def test_memory_summary_is_the_formula():
    r = replay(Trace(TRACES / "prefix_caching.jsonl"), ReplayConfig(nvtx=False, write_kv=False))
    cols = dict(zip(r.kv_columns, r.kv_series.T))
    held, in_use = cols["g0.held.r0"], cols["g0.in_use"]
    eff = efficiency_series(r)["g0"]
    ok = in_use > 0
    assert np.allclose(eff[ok], held[ok] / (in_use[ok] * 16))
    m = memory_dict(r)["efficiency"]["g0"]
    measured = eff[r.warmup:][ok[r.warmup:]]
    assert m["min"] == pytest.approx(float(measured.min())) and m["mean"] == pytest.approx(float(measured.mean()))
    assert m["steps"] == len(measured)
    assert np.percentile(measured, 5) - 1 / BINS <= m["p5"] <= np.percentile(measured, 5) + 1 / BINS
    assert (free_blocks(r) == r.engine["num_gpu_blocks"] - 1 - in_use).all()


@pytest.mark.parametrize("name", ["long_mixed.jsonl.gz", "dcp2.jsonl", "hybrid_sliding_window.jsonl"])
def test_the_summary_is_the_same_without_the_series(name):
    """A replay that keeps no series (the CLI without --json or --html) has the same memory figures; every
    summary's mean and minimum equal the series'."""
    config = ReplayConfig(nvtx=False, write_kv=False)
    with_series = replay(Trace(TRACES / name), config)
    without = replay(Trace(TRACES / name), replace(config, series=False))
    assert without.kv_memory == with_series.kv_memory and not without.kv_series.size and not without.mix_series.size
    for k, v in efficiency_series(with_series).items():
        x = v[with_series.warmup:]
        x = x[~np.isnan(x)]
        got = with_series.kv_memory["efficiency"][k]
        assert got["min"] == pytest.approx(float(x.min())) and got["mean"] == pytest.approx(float(x.mean())), k


@pytest.mark.parametrize("name", ["spec_decode.jsonl", "async_spec_decode.jsonl", "preemption_v1.jsonl",
                                  "chunked_prefill.jsonl", "long_mixed.jsonl.gz"])
def test_composition_equals_the_workers_batch(name):
    """Prefill, decode and draft tokens per step (run/composition.py, from the step) against the worker's batch:
    a request computing one token besides its drafts decodes."""
    r = replay(Trace(TRACES / name), ReplayConfig(nvtx=False, backend="numpy", write_kv=False, warmup=0))
    w = NumpyWorker(Trace(TRACES / name).header)
    for i, s in enumerate(Trace(TRACES / name).steps()):
        w.run_step(s)
        b = w.batch
        plain = (b.num_scheduled_tokens - b.num_draft_tokens).tolist()
        want = [sum(n for n in plain if n != 1), plain.count(1), int(b.num_draft_tokens.sum())]
        assert r.mix_series[i, :3].tolist() == want, i
        w.append_sampled()


@pytest.mark.parametrize("name", ["long_mixed.jsonl.gz", "preemption_v1.jsonl", "hybrid_sliding_window.jsonl"])
def test_final_steps_dropped_as_the_run_goes_give_the_same_summary(name, monkeypatch):
    """Without the series a long run sums each step's contiguous_final into the summary once every life the step
    saw has ended, and drops it (occupancy.CHUNK made small here so that it happens): the figures equal those
    of the run that keeps every step."""
    from kvmap.run import occupancy

    config = ReplayConfig(nvtx=False, write_kv=False)
    kept = replay(Trace(TRACES / name), config)
    monkeypatch.setattr(occupancy, "CHUNK", 4)
    flushed = replay(Trace(TRACES / name), replace(config, series=False))
    monkeypatch.setattr(occupancy, "PENDING", 3)  # the steps' values handed on three at a time
    handed = replay(Trace(TRACES / name), replace(config, series=False))
    for k, want in kept.kv_memory["efficiency"].items():
        for got in (flushed.kv_memory["efficiency"][k], handed.kv_memory["efficiency"][k]):
            assert got == want, k  # the mean too, to the bit: the values are summed in step order
    assert handed.kv_memory == kept.kv_memory


@pytest.mark.parametrize("name", ["long_mixed.jsonl.gz", "dcp4_interleave8.jsonl", "chunked_local.jsonl"])
def test_every_mean_is_the_sum_in_step_order(name):
    """Each efficiency's mean is its measured steps' values summed one by one in step order, over their count:
    the same float however the run handed them on."""
    r = replay(Trace(TRACES / name), ReplayConfig(nvtx=False, write_kv=False))
    for k, v in efficiency_series(r).items():
        total, n = 0.0, 0
        for x in v[r.warmup:].tolist():
            if x == x:
                total, n = total + x, n + 1
        assert r.kv_memory["efficiency"][k]["mean"] == total / n, k
