"""The benchmark's baselines compute what kvmap computes: scripts/bench.py checks every output identical before
it times anything; this runs those checks (tiny sizes, no timing asserted) so the baseline cannot drift."""

from __future__ import annotations

import sys

import pytest

from .conftest import ROOT, TRACES

sys.path.insert(0, str(ROOT / "scripts"))
bench = pytest.importorskip("bench")


def test_synthetic_baseline_equals_kvmap():
    pytest.importorskip("numba")
    rows = bench.bench_synthetic(reps=2, sizes=[8, 64], backends=["numba", "numpy"])
    assert [r["batch_size"] for r in rows] == [8, 64]
    assert all(r["kvmap_numba"]["n"] == 2 for r in rows)


@pytest.mark.parametrize("name", ["chunked_prefill.jsonl", "hybrid_sliding_window.jsonl", "spec_decode.jsonl"])
def test_replay_baseline_worker_equals_kvmap(name):
    pytest.importorskip("numba")
    out = bench.bench_replay(TRACES / name, runs=1, backends=["numba", "numpy"])
    assert set(out["phases"]) == {"v1_baseline", "numba", "numpy"}
