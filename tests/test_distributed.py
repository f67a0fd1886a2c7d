"""A real multi-process replay on torch.distributed (gloo, CPU): 2 and 4 processes give the same dump as the
one-process emulation, every rank's KV shard reads back clean, the broadcast is timed, and a broken
cross-rank invariant is named at its step, request and rank."""

from __future__ import annotations

import time

import pytest

from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace
from kvmap.workers.mappings import dump_line

from .conftest import TRACES

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


def _emulated(path, **kw) -> bytes:
    lines: list[str] = []
    replay(Trace(path), ReplayConfig(backend="numpy", write_kv=False, nvtx=False, **kw),
           on_mappings=lambda d: lines.append(dump_line(d)))
    return "".join(lines).encode()


@pytest.mark.parametrize("name,nproc,stop", [("dcp2", 2, None), ("dcp4_interleave8", 4, 40)])
def test_gloo_processes_equal_the_emulation(tmp_path, name, nproc, stop):
    from kvmap.run.distributed import launch

    path = TRACES / f"{name}.jsonl"
    dump = tmp_path / "dist.jsonl"
    t0 = time.perf_counter()
    r = launch(path, nproc, backend="numpy", verify_kv=True, dump_mappings=dump, stop=stop, timeout=240)
    elapsed = time.perf_counter() - t0
    assert dump.read_bytes() == _emulated(path, stop=stop)
    assert r.world_size == nproc and r.ranks == list(range(nproc))
    assert r.kv_checked > 0 and r.kv_mismatches == 0
    assert all(c > 0 for c in r.rank_kv_checked)
    assert "broadcast" in r.phases and "cross_rank" in r.phases
    assert r.phase_ns[:, r.phases.index("broadcast")].min() > 0
    assert len(r.rank_broadcast_p50_ns) == nproc and min(r.rank_broadcast_p50_ns) > 0
    print(f"{nproc} gloo processes, {name}: {elapsed:.1f} s")


def test_broken_invariant_is_named(tmp_path):
    """A worker whose rank 1 also claims rank 0's tokens: the collective check names step, request, rank."""
    from kvmap.errors import KvmapError
    from kvmap.run.distributed import launch

    # every rank replays the same broadcast steps, so the fault is planted in the worker
    plug = tmp_path / "badrank.py"
    plug.write_text(
        "from kvmap.workers.host import NumpyWorker\n"
        "class Bad(NumpyWorker):\n"
        "    name = 'bad'\n"
        "    def compute_slot_mappings(self):\n"
        "        super().compute_slot_mappings()\n"
        "        if self.ranks == (1,) and self.current_step == 3:\n"
        "            T = self.batch.num_tokens\n"
        "            s = self.buffers.rank_slot_mapping[0, 0, :T]\n"
        "            s[:] = (s < 0) * 5 - (s >= 0)\n")  # rank 1 claims rank 0's tokens and drops its own
    with pytest.raises(KvmapError) as e:
        launch(TRACES / "dcp2.jsonl", 2, backend=f"{plug}:Bad", timeout=240)
    msg = str(e.value)
    assert ("local on 2 DCP ranks" in msg or "local on 0 DCP ranks" in msg) and "step 3" in msg, msg
    assert "request" in msg and "rank" in msg
