"""Every bundled trace: every host backend (and the example user backend) writes the same dump bytes as the
plain-Python reference on every step, and the KV cache reads back with 0 mismatches."""

from __future__ import annotations

import pytest

from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace

from kvmap.workers.mappings import dump_line

from .conftest import ROOT, bundled_traces

TRACES = bundled_traces()


def test_the_bundled_set_covers_the_hard_cases():
    names = {p.name.split(".")[0] for p in TRACES}
    assert {"worked_example", "chunked_prefill", "prefix_caching", "preemption_v1", "preemption_v2",
            "hybrid_sliding_window", "spec_decode", "long_mixed"} <= names
    # multi-rank (issue 14), recorded from vLLM 0.33's scheduler
    assert {"dcp2", "dcp4_interleave8", "kernel_block_split", "vllm51031", "dcp2_mamba"} <= names


EXAMPLE = str(ROOT / "scripts" / "example_backend.py") + ":V1StyleWorker"
_REFERENCE: dict = {}


def _dump(path, backend) -> list[str]:
    lines: list[str] = []
    replay(Trace(path), ReplayConfig(backend=backend, write_kv=False, nvtx=False),
           on_mappings=lambda d: lines.append(dump_line(d)))
    return lines


@pytest.mark.parametrize("backend", ["numpy", "numba", EXAMPLE], ids=["numpy", "numba", "example"])
@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_dump_bytes_equal_the_reference_every_step(path, backend):
    if backend == "numba":
        pytest.importorskip("numba")
    h = Trace(path).header
    if backend == EXAMPLE and (h.decode_context_parallel_size > 1 or h.has_kernel_split):
        pytest.skip("the example backend is single-rank V1 code (no DCP slot rule, no kernel block rows)")
    got = _dump(path, backend)
    if path not in _REFERENCE:
        _REFERENCE[path] = _dump(path, "reference")
    want = _REFERENCE[path]
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g == w, f"{backend} differs at {g[:40]}"


@pytest.mark.parametrize("path", [p for p in TRACES if "long" not in p.name], ids=lambda p: p.name)
def test_vectorized_block_appends_equal_the_row_writes(path, monkeypatch):
    """Steps where many rows grow take one vectorized scatter instead of a slice write per row: force it."""
    import kvmap.workers.state

    monkeypatch.setattr(kvmap.workers.state, "ROW_WRITES_MAX", -1)
    got, want = [], []
    replay(Trace(path), ReplayConfig(backend="numpy", write_kv=False, nvtx=False), on_mappings=got.append)
    replay(Trace(path), ReplayConfig(backend="reference", write_kv=False, nvtx=False), on_mappings=want.append)
    assert got == want


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_verify_kv_finds_no_mismatch(path):
    r = replay(Trace(path), ReplayConfig(verify_kv=True, nvtx=False))
    assert r.kv_checked > 0
    assert r.kv_mismatches == 0, r.kv_examples[:3]
