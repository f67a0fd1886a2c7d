"""The benchmark's baselines compute what kvmap computes: scripts/bench.py checks every output identical before
it times anything; this runs those checks (tiny sizes, no timing asserted) so the baseline cannot drift."""

from __future__ import annotations

import gzip
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


def test_replay_with_the_forward_phase():
    pytest.importorskip("numba")
    out = bench.bench_forward(TRACES / "spec_decode.jsonl", runs=1, backends=["numba"], json_out=None)
    assert all(ph["prepare_forward"] > 0 for ph in out["phases"].values())


bench_process = pytest.importorskip("bench_process")


@pytest.mark.parametrize("name", ["worked_example.jsonl", "chunked_prefill.jsonl", "prefix_caching.jsonl",
                                  "spec_decode.jsonl", "hybrid_sliding_window.jsonl", "preemption_v1.jsonl",
                                  "preemption_v2.jsonl"])
def test_process_baseline_maps_what_kvmap_maps(tmp_path, name):
    """The whole-process baseline replayer (a script of its own) schedules the same tokens into the same slots
    as kvmap: its token count and slot checksum equal those of kvmap's mappings (any batch order)."""
    import json
    import subprocess

    from kvmap.run.config import ReplayConfig
    from kvmap.run.replay import replay
    from kvmap.trace import Trace

    script = tmp_path / "baseline.py"
    script.write_text(bench_process.BASELINE)
    out = subprocess.run([sys.executable, str(script), str(TRACES / name)], capture_output=True, text=True,
                         check=True).stdout
    records = []
    replay(Trace(TRACES / name), ReplayConfig(backend="numpy", write_kv=False, nvtx=False), on_mappings=records.append)
    tokens = sum(len(r["positions"]) for r in records)
    checksum = sum(sum(map(sum, r["slot_mapping"])) if r["slot_mapping"] and isinstance(r["slot_mapping"][0], list)
                   else sum(r["slot_mapping"]) for r in records)
    assert out.strip() == f"baseline: {len(records)} steps, {tokens} tokens, slot checksum {checksum}", json.dumps(
        records[0])[:200]


def test_decode_only_reference_decodes_every_line(tmp_path):
    """bench_process's `(decode only)` bound reads and decodes every line of the trace, the header included,
    gzip or plain."""
    import subprocess

    script = tmp_path / "decode_only.py"
    script.write_text(bench_process.DECODE_ONLY)
    for name in ("worked_example.jsonl", "long_mixed.jsonl.gz"):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(TRACES / name, "rb") as f:
            lines = sum(1 for _ in f)
        out = subprocess.run([sys.executable, str(script), str(TRACES / name)], capture_output=True, text=True,
                             check=True).stdout
        assert out.strip() == f"{lines} lines decoded"
