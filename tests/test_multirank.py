"""Multi-rank workers (issue 14): every backend computes every DCP rank's slots, dcp_local_seq_lens and the
kernel block rows exactly as the reference does; each rank's KV shard reads back clean; `--rank R` is the
rank's slice of the all-rank dump; state groups have no slots; TP shards the heads; a planted vllm#51031-style
mistake is caught; dumps of single-rank traces keep their old keys."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvmap.layout import PAD_SLOT_ID
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace
from kvmap.workers.mappings import dump_line

from .backends.vllm51031_backend import VirtualBlockFromKernelSize  # the planted mistake, shared with validate
from .conftest import TRACES
from .multirank_helpers import make_dcp_trace

MULTI = ["dcp2", "dcp4_interleave8", "kernel_block_split", "vllm51031", "dcp2_mamba"]


def _dump(path, backend="reference", **kw) -> list[str]:
    lines: list[str] = []
    replay(Trace(path), ReplayConfig(backend=backend, write_kv=False, nvtx=False, **kw),
           on_mappings=lambda d: lines.append(dump_line(d)))
    return lines


_REF: dict = {}


def _ref(path):
    if path not in _REF:
        _REF[path] = _dump(path)
    return _REF[path]


@pytest.fixture(scope="module")
def handmade(tmp_path_factory):
    """DCP traces built by hand from single-rank ones (tests/multirank_helpers.py)."""
    d = tmp_path_factory.mktemp("dcp")
    return [make_dcp_trace(TRACES / "chunked_prefill.jsonl", d / "cp2_i4.jsonl", 2, 4),
            make_dcp_trace(TRACES / "spec_decode.jsonl", d / "cp4_i2_k4.jsonl", 4, 2, kernel_block_size=4),
            make_dcp_trace(TRACES / "worked_example.jsonl", d / "we_cp2.jsonl", 2, 8, tp=4)]


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
@pytest.mark.parametrize("name", MULTI)
def test_backends_equal_the_reference_on_every_rank(name, backend):
    pytest.importorskip({"numba": "numba", "torch": "torch"}.get(backend, "numpy"))
    path = TRACES / f"{name}.jsonl"
    got, want = _dump(path, backend), _ref(path)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g == w


@pytest.mark.parametrize("name", MULTI)
def test_triton_equals_the_reference_on_every_rank(name):
    pytest.importorskip("triton")
    path = TRACES / f"{name}.jsonl"
    stop = 12  # the interpreter is slow: the first steps (prefill chunks, decodes, block crossings)
    got: list[str] = []
    r = replay(Trace(path), ReplayConfig(backend="triton", stop=stop, verify_kv=True, nvtx=False),
               on_mappings=lambda d: got.append(dump_line(d)))
    assert got == _ref(path)[:stop]
    assert r.kv_checked > 0 and r.kv_mismatches == 0


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_handmade_dcp_traces(handmade, backend):
    pytest.importorskip("numba" if backend == "numba" else "numpy")
    for p in handmade:
        assert _dump(p, backend) == _dump(p)
        r = replay(Trace(p), ReplayConfig(backend=backend, verify_kv=True, nvtx=False))
        assert r.kv_mismatches == 0 and r.kv_checked > 0


@pytest.mark.parametrize("backend", ["reference", "numpy", "numba", "torch"])
@pytest.mark.parametrize("name", MULTI)
def test_every_rank_reads_back_clean(name, backend):
    pytest.importorskip({"numba": "numba", "torch": "torch"}.get(backend, "numpy"))
    r = replay(Trace(TRACES / f"{name}.jsonl"), ReplayConfig(backend=backend, verify_kv=True, nvtx=False))
    assert r.kv_checked > 0 and r.kv_mismatches == 0, r.kv_examples[:2]
    h = Trace(TRACES / f"{name}.jsonl").header
    if h.decode_context_parallel_size > 1:
        assert r.ranks == list(range(h.decode_context_parallel_size))
        assert all(c > 0 for c in r.rank_kv_checked) and sum(r.rank_kv_checked) == r.kv_checked
        assert sum(r.rank_kv_mismatches) == 0
        assert sum(r.rank_tokens) == r.tokens_scheduled  # every token written on exactly one rank


def test_rank_figures_cover_the_measured_steps():
    """A window after step 0: the per-rank local tokens add up to the tokens of the measured steps only (as every
    count of the summary), not to those of the warm-up steps before them."""
    r = replay(Trace(TRACES / "dcp2.jsonl"), ReplayConfig(backend="numpy", start=10, stop=20, nvtx=False))
    measured = r.num_tokens[r.warmup:]
    assert len(measured) == 20 - 10 and sum(r.rank_tokens) == int(measured.sum()) < r.tokens_scheduled


def test_dump_layout_for_ranks():
    """docs/trace-format.md: slot_mapping [cp][groups][tokens], dcp_local_seq_lens [cp][reqs], kernel rows."""
    recs = [json.loads(x) for x in _ref(TRACES / "vllm51031.jsonl")]
    for d in recs:
        T, B = len(d["positions"]), len(d["req_ids"])
        assert np.array(d["slot_mapping"]).shape == (2, 1, T)
        assert np.array(d["dcp_local_seq_lens"]).reshape(2, B).sum(axis=0).tolist() == d["seq_lens"]
        s = np.array(d["slot_mapping"])
        if T:
            assert ((s != PAD_SLOT_ID).sum(axis=0) == 1).all()
        for row, krow in zip(d["block_tables"][0], d["kernel_block_tables"][0]):
            assert krow == [b * 4 + j for b in row for j in range(4)]
    one = json.loads(_ref(TRACES / "worked_example.jsonl")[1])
    assert list(one) == ["step", "req_ids", "idx_mapping", "query_start_loc", "seq_lens", "positions",
                         "input_ids", "block_tables", "slot_mapping"]  # single-rank dumps unchanged


def test_state_group_has_no_slots_and_keeps_its_rows():
    recs = [json.loads(x) for x in _ref(TRACES / "dcp2_mamba.jsonl")]
    assert any(len(d["block_tables"][1]) for d in recs)
    for d in recs:
        for r in range(2):
            assert set(d["slot_mapping"][r][1]) <= {PAD_SLOT_ID}
        assert all(len(row) == 1 for row in d["block_tables"][1])  # one state block per request


@pytest.mark.parametrize("backend", ["reference", "numpy", "numba"])
def test_one_rank_is_a_slice_of_all_ranks(backend):
    pytest.importorskip("numba" if backend == "numba" else "numpy")
    path = TRACES / "dcp4_interleave8.jsonl"
    every = [json.loads(x) for x in _ref(path)]
    for r in (0, 3):
        one = [json.loads(x) for x in _dump(path, backend, ranks=[r])]
        for a, b in zip(one, every):
            assert a["dcp_ranks"] == [r]
            assert a["slot_mapping"] == [b["slot_mapping"][r]]
            assert a["dcp_local_seq_lens"] == [b["dcp_local_seq_lens"][r]]
        res = replay(Trace(path), ReplayConfig(backend=backend, ranks=[r], verify_kv=True, nvtx=False))
        assert res.ranks == [r] and res.kv_mismatches == 0


def test_tp_shards_the_heads():
    from kvmap.kv.cache import KVGeometry

    assert KVGeometry(8, 64).tp_shard(4).num_kv_heads == 2
    assert KVGeometry(1, 64).tp_shard(2).num_kv_heads == 1  # replicated when tp > heads
    r = replay(Trace(TRACES / "dcp4_interleave8.jsonl"), ReplayConfig(backend="numpy", kv_geometry=KVGeometry(8, 16),
                                                                      nvtx=False))
    assert r.kv_geometry["num_kv_heads"] == 8 and r.tp_size == 4
    assert r.rank_kv_bytes[0] * 4 == r.kv_bytes  # 4 DCP shards, each with 8 // 4 heads
    assert r.rank_kv_bytes[0] == 10 * 16 * 2 * 2 * 16 * 2  # blocks * block_size * K,V * heads * head * bytes


def test_planted_vllm51031_mistake_is_caught():
    path = TRACES / "vllm51031.jsonl"
    t = Trace(path)
    w = VirtualBlockFromKernelSize(t.header)
    got: list[str] = []
    r = replay(t, ReplayConfig(verify_kv=True, nvtx=False), worker=w, on_mappings=lambda d: got.append(dump_line(d)))
    want = _ref(path)
    first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    assert json.loads(got[first])["step"] == json.loads(want[first])["step"]
    assert r.kv_mismatches > 0 and {e["rank"] for e in r.kv_examples} <= {0, 1}


def test_summary_shows_per_rank_figures():
    from io import StringIO

    from rich.console import Console

    from kvmap.render.report import render_summary, summary_dict

    r = replay(Trace(TRACES / "dcp2.jsonl"), ReplayConfig(backend="numpy", verify_kv=True, nvtx=False))
    buf = StringIO()
    render_summary(r, Console(file=buf, width=120))
    text = buf.getvalue()
    assert "per DCP rank" in text and "DCP 2 (interleave 1), TP 2" in text
    per = summary_dict(r)["ranks"]["per_rank"]
    assert [x["rank"] for x in per] == [0, 1] and sum(x["local_tokens"] for x in per) == r.tokens_scheduled
    assert "ranks" not in summary_dict(replay(Trace(TRACES / "worked_example.jsonl"), ReplayConfig(nvtx=False)))


def test_explain_shows_the_chain_on_every_rank():
    from kvmap.explain.build import explain

    d = explain(Trace(TRACES / "vllm51031.jsonl"), 5, "a", 0)
    g = d["token"]["groups"][0]
    assert (g["logical_block"], g["offset"], g["block"], g["rank"]) == (1, 75, 2, 0)  # position 203
    r0, r1 = g["ranks"]
    assert r0["holds"] and r0["slot"] == 2 * 64 + 43 and r0["kernel_block"] == 10
    assert not r1["holds"] and r1["slot"] == PAD_SLOT_ID
    assert r0["dcp_local_seq_len"] + r1["dcp_local_seq_len"] == 204
    assert any("virtual block 203 // (64 * 2) = 1" in x for x in g["links"])
    m = explain(Trace(TRACES / "dcp2_mamba.jsonl"), 6, "a", 0)["token"]["groups"][1]
    assert m["slot"] == PAD_SLOT_ID and all(not r["holds"] for r in m["ranks"])


def test_cli_rank_and_nproc_options(tmp_path):
    from typer.testing import CliRunner

    from kvmap.cli.app import app

    runner = CliRunner()
    path = str(TRACES / "dcp2.jsonl")
    res = runner.invoke(app, ["replay", path, "--rank", "1", "--no-progress", "--verify-kv",
                              "--dump-mappings", str(tmp_path / "r1.jsonl")])
    assert res.exit_code == 0, res.output
    assert "rank 1 of 2 in this process" in res.output and "0 mismatches" in res.output
    first = json.loads((tmp_path / "r1.jsonl").read_text().splitlines()[0])
    assert first["dcp_ranks"] == [1] and len(first["slot_mapping"]) == 1
    bad = runner.invoke(app, ["replay", path, "--rank", "2", "-q"])
    assert bad.exit_code == 2 and "--rank" in bad.output


@pytest.mark.parametrize("backend", ["numpy", "numba", "reference"])
def test_a_corrupted_shard_is_named_by_rank(backend):
    pytest.importorskip("numba" if backend == "numba" else "numpy")
    from kvmap.kv.cache import KVCheckResult, KVGeometry
    from kvmap.workers.registry import make_worker

    t = Trace(TRACES / "dcp2.jsonl")
    w = make_worker(backend, t.header)
    kv = w.make_kv_cache(KVGeometry())
    check = KVCheckResult()
    planted = False
    for s in t.steps():
        w.run_step(s)
        w.write_kv(kv)
        mine = [int(x) for x in np.asarray(w.mappings().rank_slot_mapping)[1, 0] if x >= 0]
        if s.step >= 6 and mine and not planted:  # flip one bit of a slot rank 1 holds
            kv.shards[1].bits[0][0, mine[0], 0] ^= 1
            planted = True
        w.verify_kv(kv, check)
        w.append_sampled()
        if check.mismatches:
            break
    assert check.mismatches >= 1 and {e.rank for e in check.examples} == {1}
    assert check.rank_mismatches.get(0, 0) == 0 and check.rank_mismatches[1] >= 1
