"""Model Runner V2's sliding-window nulling of the gathered block table (layout.GroupLayout.null_history_blocks):
the scalar spec by its arithmetic, then every backend against the spec, bit for bit, on the bundled hybrid
trace (whose steps go past the window) and on fuzzed batches; the slot mapping still reads the un-nulled rows;
V1 and DCP > 1 null nothing. vLLM's own kernel is the oracle in tests/test_against_vllm_window.py."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from kvmap.layout import GroupLayout, null_history_groups
from kvmap.trace import KVCacheGroup, Trace, TraceHeader
from kvmap.workers.registry import make_worker

from .conftest import TRACES, read_lines, write_lines

HYBRID = TRACES / "hybrid_sliding_window.jsonl"
BACKENDS = ["numpy", "numba", "torch", "reference"]
TRITON_STEPS = 24  # Triton under the interpreter: the first steps (nulling starts at step 2)


def sw(block_size=16, window=32, extra=0, kernel_block_size=None) -> GroupLayout:
    return GroupLayout(block_size, "sliding_window", sliding_window=window, extra_retained_tokens=extra,
                       kernel_block_size=kernel_block_size)


# ------------------------------------------------------------------------------------------- the spec


def test_the_spec_by_its_arithmetic():
    lay = sw()
    assert lay.num_retained_tokens == 32 - 1
    assert lay.null_history_blocks(100) == (100 - (32 - 1)) // 16 == 4  # vLLM's probe: [0, 0, 0, 0, 15, 16, 17]
    assert lay.null_history_blocks(31 + 16 - 1) == 0  # positions 0..15 are still within reach
    assert lay.null_history_blocks(31 + 16) == 1
    assert lay.null_history_blocks(0) == 0 and lay.null_history_blocks(31) == 0
    assert sw(extra=3).num_retained_tokens == 32 - 1 + 3
    assert sw(extra=3).null_history_blocks(100) == (100 - (32 - 1 + 3)) // 16 == 4
    assert sw(extra=3).null_history_blocks(31 + 3 + 16) == 1 and sw(extra=3).null_history_blocks(31 + 16) == 0
    assert sw(block_size=64, kernel_block_size=16).null_history_blocks(1000) == (1000 - 31) // 64  # manager blocks
    assert sw(window=1).num_retained_tokens == 0 and sw(window=1).null_history_blocks(1000) == 0  # R = 0: off
    assert GroupLayout(16).null_history_blocks(1000) == 0  # full attention keeps every entry
    assert GroupLayout(16, "chunked_local", attention_chunk_size=64).null_history_blocks(1000) == 0


@pytest.mark.parametrize("bs, window, extra", [(16, 32, 0), (16, 8, 0), (16, 1, 0), (4, 32, 5), (64, 100, 2),
                                               (16, 4096, 0), (3, 7, 1)])
def test_the_numpy_form_is_the_spec_and_nothing_read_is_nulled(bs, window, extra):
    lay = sw(bs, window, extra)
    nc = np.arange(0, 5000, dtype=np.int32)
    got = lay.null_history_lens(nc, out=np.zeros(len(nc), dtype=np.int64))
    assert got.tolist() == [lay.null_history_blocks(int(n)) for n in nc]
    # a nulled entry holds positions below n0 * bs <= nc - R <= readable_start: the window rule never reads it
    assert (got * bs <= lay.readable_lo(nc.astype(np.int64))).all()


# ------------------------------------------------------------------------------------- the hybrid trace


def expected(worker, lay_by_group, m, nulled: bool) -> list[list[list[int]]]:
    """[G][B] the gathered rows by the spec: the persistent rows with their first null_history_blocks entries 0."""
    st = worker.state
    out = []
    for g, lay in enumerate(lay_by_group):
        rows = []
        for b in range(m.num_reqs):
            row = st.block_tables[g][int(m.idx_mapping[b]), : int(st.num_blocks[g, int(m.idx_mapping[b])])].tolist()
            n0 = lay.null_history_blocks(int(m.num_computed_tokens[b])) if nulled else 0
            rows.append([0] * n0 + row[n0:])
        out.append(rows)
    return out


def replay_against_spec(backends: list[str], order: str, stop: int | None = None, header=None):
    """Replay the hybrid trace with a numpy worker (the persistent rows) and `backends` in lockstep; every step,
    each backend's dumped block_tables must be the spec's. Returns (request-steps past the window, entries that
    the rule changed)."""
    trace = Trace(HYBRID)
    h = header or trace.header
    base = make_worker("numpy", h, "cpu", "v1" if order == "v1" else "mrv2")
    workers = [make_worker(b, h, "cpu", "v1" if order == "v1" else "mrv2") for b in backends]
    lays = [GroupLayout.of(g) for g in h.kv_cache_groups]
    nulled = order == "mrv2" and h.decode_context_parallel_size == 1
    past = changed = 0
    for s in trace.steps(0, stop):
        base.run_step(s)
        m = base.mappings()
        want = expected(base, lays, m, nulled)
        for w in workers:
            w.run_step(s)
            d = w.mappings_dict()
            assert d["block_tables"] == want, (w.name, s.step)
            for g, lay in enumerate(lays):  # slots read the un-nulled rows: the layout's slot rule over them
                st = base.state
                pos = d["positions"]
                rows = np.repeat(m.idx_mapping, m.num_scheduled_tokens)
                assert d["slot_mapping"][g] == [lay.slot(st.block_tables[g][r], p) for r, p in zip(rows, pos)]
            w.append_sampled()
        for g, lay in enumerate(lays):
            for b in range(m.num_reqs):
                row = base.state.block_tables[g][int(m.idx_mapping[b])]
                n0 = lay.null_history_blocks(int(m.num_computed_tokens[b]))
                past += n0 > 0 and lay.kind == "sliding_window"
                changed += int((row[:n0] != 0).sum()) if lay.kind == "sliding_window" else 0
        base.append_sampled()
    return past, changed


def test_every_backend_is_the_spec_on_the_hybrid_trace():
    past, changed = replay_against_spec(BACKENDS, "mrv2")
    # the trace goes past the window: requests with num_computed_tokens > R + block_size = 31 + 16, whose rows
    # held real block ids where the forward-pass table has 0 (counted over the whole trace)
    assert past >= 50 and changed >= 100, (past, changed)


def test_triton_is_the_spec_on_the_hybrid_trace():
    pytest.importorskip("triton")
    past, changed = replay_against_spec(["triton"], "mrv2", stop=TRITON_STEPS)
    assert past > 0 and changed > 0


def test_v1_nulls_nothing():
    replay_against_spec(["numpy", "numba", "reference"], "v1")


def test_the_header_key_extra_retained_tokens_widens_the_reach(tmp_path):
    lines = read_lines(HYBRID)
    lines[0]["kv_cache_groups"][1]["extra_retained_tokens"] = 40
    lines[0]["kv_cache_groups"][0]["extra_retained_tokens"] = 7  # full attention: ignored (vLLM's is SWA-only)
    h = Trace(write_lines(tmp_path / "t.jsonl", lines)).header
    assert [g.extra_retained_tokens for g in h.kv_cache_groups] == [0, 40]
    assert GroupLayout.of(h.kv_cache_groups[1]).num_retained_tokens == 32 - 1 + 40
    past, changed = replay_against_spec(["numpy", "numba", "reference"], "mrv2", header=h)
    assert past > 0 and changed < replay_against_spec(["numpy"], "mrv2")[1]  # fewer entries nulled


@pytest.mark.parametrize("value, fragment", [(-1, "must be >= 0, got -1"), ("3", "expected an integer")])
def test_a_bad_extra_retained_tokens_is_one_located_line(tmp_path, value, fragment):
    from typer.testing import CliRunner

    from kvmap.cli.app import app

    lines = read_lines(HYBRID)
    lines[0]["kv_cache_groups"][1]["extra_retained_tokens"] = value
    path = write_lines(tmp_path / "bad.jsonl", lines)
    r = CliRunner().invoke(app, ["replay", str(path), "--quiet", "--no-progress"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert f"{path}:1, field kv_cache_groups[1].extra_retained_tokens: {fragment}" in r.output, r.output


def test_dcp_nulls_nothing():
    h = Trace(HYBRID).header
    h2 = dataclasses.replace(h, decode_context_parallel_size=2)
    assert null_history_groups(h) == (1,) and null_history_groups(h2) == ()
    assert make_worker("numba", h).null_groups == (1,) and make_worker("numba", h2).null_groups == ()


# ------------------------------------------------------------------------------------------- fuzzing


def fuzz_header(rng: random.Random, kernel_split: bool) -> TraceHeader:
    bs = rng.choice([4, 16, 32]) if not kernel_split else 32
    groups = (KVCacheGroup(0, "full_attention", bs),
              KVCacheGroup(1, "sliding_window", bs, sliding_window=rng.choice([1, 5, 16, 33, 64, 200]),
                           kernel_block_size=16 if kernel_split else None,
                           extra_retained_tokens=rng.choice([0, 0, 1, 3, 40])),
              KVCacheGroup(2, "sliding_window", 8, sliding_window=rng.choice([8, 24])))
    return TraceHeader(model_runner_protocol="v2", block_size=bs, num_gpu_blocks=4096, kv_cache_groups=groups,
                       max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=512)


def fuzz_cases(seed: int, n: int, kernel_split: bool):
    """(header, num_computed_tokens per row, batches, the seed of the state's token and block ids)."""
    rng = random.Random(seed)
    h = fuzz_header(rng, kernel_split)
    R = h.max_num_seqs
    nc = [rng.randrange(0, 480) for _ in range(R)]
    batches = []
    for _ in range(n):
        B = rng.randint(1, R)
        rows = rng.sample(range(R), B)
        counts = [rng.randint(1, min(32, 512 - nc[r])) for r in rows]
        batches.append((rows, counts))
    return h, nc, batches, rng.randrange(1 << 30)


def fill_state(w, nc: list[int], seed: int) -> None:
    st = w.state
    rng = np.random.default_rng(seed)
    st.num_computed_tokens[: len(nc)] = nc
    st.token_ids[:] = rng.integers(0, 32000, size=st.token_ids.shape, dtype=np.int32)
    for g, table in enumerate(st.block_tables):
        table[:] = rng.integers(1, 4096, size=table.shape, dtype=np.int32)
        span = w.header.kv_cache_groups[g].block_size
        st.num_blocks[g, : len(nc)] = [min(-(-(n + 32) // span), table.shape[1]) for n in nc]
    if w.has_h2d:
        w.upload_state()


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kernel_split", [False, True])
def test_fuzzed_batches_every_backend_is_the_spec(seed, kernel_split):
    h, nc, batches, state_seed = fuzz_cases(seed, 6, kernel_split)
    backends = ["numpy", "numba", "torch"] + (["triton"] if seed < 3 else [])
    lays = [GroupLayout.of(g) for g in h.kv_cache_groups]
    for name in backends:
        w = make_worker(name, h)
        fill_state(w, nc, state_seed)
        st = w.state
        for rows, counts in batches:
            w.schedule(rows, counts, [str(r) for r in rows])
            w.mapping_phases()
            m = w.mappings()
            for g, lay in enumerate(lays):
                for b in range(m.num_reqs):
                    r, n = int(m.idx_mapping[b]), int(m.num_computed_tokens[b])
                    row = st.block_tables[g][r, : int(st.num_blocks[g, r])].tolist()
                    n0 = lay.null_history_blocks(n)
                    want = [0] * n0 + row[n0:]
                    assert m.block_tables[g][b, : len(row)].tolist() == want, (name, g, b)
                    if m.kernel_block_tables is not None:
                        k = lay.kernel_blocks_per_block
                        assert m.kernel_block_tables[g][b, : len(row) * k].tolist() == lay.kernel_row(want)
                    t0, t1 = int(m.query_start_loc[b]), int(m.query_start_loc[b + 1])  # slots: un-nulled rows
                    assert m.slot_mapping[g, t0:t1].tolist() == [lay.slot(st.block_tables[g][r], n + i)
                                                                 for i in range(t1 - t0)]
