"""User backends: loaded by `--backend module:Class`, `file.py:Class` or a `kvmap.backends` entry point, timed by
the replay loop, and checked by `validate --deep --backend` (a conformance check that names the first wrong step,
request, token and group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from typer.testing import CliRunner

from kvmap.cli.app import app
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace

from .conftest import ROOT, TRACES

runner = CliRunner()
EXAMPLE = f"{ROOT / 'scripts' / 'example_backend.py'}:V1StyleWorker"
FAULTY = f"{ROOT / 'tests' / 'backends' / 'faulty_backend.py'}:OffByOneWorker"


def test_example_backend_replays_a_bundled_trace_from_a_file():
    res = runner.invoke(app, ["replay", str(TRACES / "long_mixed.jsonl.gz"), "--backend", EXAMPLE, "--verify-kv",
                              "--no-progress", "--steps", "0:300"])
    assert res.exit_code == 0, res.output
    assert "v1_style" in res.output


def test_backend_by_module_name(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    r = replay(Trace(TRACES / "prefix_caching.jsonl"), ReplayConfig(backend="example_backend:V1StyleWorker",
                                                                    verify_kv=True, nvtx=False))
    assert r.backend == "v1_style" and r.kv_checked > 0 and r.kv_mismatches == 0


def test_entry_point_backend(tmp_path):
    """An installed package registers `mine` under the kvmap.backends group (a dist-info on the path)."""
    dist = tmp_path / "mine_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mine-backend\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvmap.backends]\nmine = example_backend:V1StyleWorker\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "scripts"), str(ROOT)])}
    out = subprocess.run([sys.executable, "-m", "kvmap", "replay", "--backend", "mine", "--no-progress", "--json",
                          str(tmp_path / "r.json")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "r.json").read_text())["result"]["backend"] == "v1_style"


def test_validate_deep_names_the_first_wrong_step_request_and_token():
    path = TRACES / "chunked_prefill.jsonl"
    # where the bug first shows: the first scheduled position p > 0 with p % 16 == 0, in the reference's dumps
    first = None
    ref: list[dict] = []
    replay(Trace(path), ReplayConfig(backend="reference", write_kv=False, nvtx=False), on_mappings=ref.append)
    for d in ref:
        for b, r in enumerate(d["req_ids"]):
            lo, hi = d["query_start_loc"][b], d["query_start_loc"][b + 1]
            hits = [t for t in range(lo, hi) if d["positions"][t] > 0 and d["positions"][t] % 16 == 0]
            if hits:
                first = (d["step"], r, hits[0] - lo, d["positions"][hits[0]])
                break
        if first:
            break
    assert first is not None
    res = runner.invoke(app, ["validate", str(path), "--deep", "--backend", FAULTY, "--json", "-"])
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    p = next(p for p in report["problems"] if p["kind"] == "conformance")
    step, req, token, position = first
    assert (p["step"], p["req_id"], p["field"], p["group"]) == (step, req, "slot_mapping", 0)
    assert f"(token {token} of the request)" in p["message"]
    assert f"position {position} -> block {position} // 16 = {position // 16}" in p["message"]  # explain's chain
    assert any(p["kind"] == "kv_mismatch" for p in report["problems"])


def test_a_correct_backend_passes_the_conformance_check():
    res = runner.invoke(app, ["validate", str(TRACES / "hybrid_sliding_window.jsonl"), "--deep", "--backend",
                              EXAMPLE, "--backend", "numpy"])
    assert res.exit_code == 0, res.output
    assert "0 differ from the reference" in res.output


def test_bad_backends_are_one_clear_line():
    for spec, says in [(f"{ROOT / 'tests' / 'backends' / 'faulty_backend.py'}:NotAWorker", "is not a subclass"),
                       ("no_such_module_xyz:Cls", "cannot import 'no_such_module_xyz'"),
                       ("nonsense", "unknown backend 'nonsense'"),
                       (f"{ROOT / 'tests' / 'backends' / 'faulty_backend.py'}:Missing", "has no attribute")]:
        res = runner.invoke(app, ["replay", "--backend", spec, "--no-progress"])
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert says in res.stderr and "option --backend" in res.stderr, res.stderr


def test_backends_compose_owners_two_levels_below_the_worker_at_most():
    """Issue 24: backends compose owners (state, buffers, a language's array functions, a device mirror) instead of
    inheriting a chain; the old triton worker was 4 levels below `Worker` (Triton -> Torch -> Numpy -> Host)."""
    from kvmap.workers.contract import Worker
    from kvmap.workers.registry import BUILTIN, _load_class

    def depth(cls: type) -> int:
        return 0 if cls is Worker else 1 + max(depth(b) for b in cls.__bases__ if issubclass(b, Worker))

    targets = [b.target for b in BUILTIN.values() if b.name != "triton"] + [EXAMPLE]
    if os.environ.get("TRITON_INTERPRET"):
        targets.append(BUILTIN["triton"].target)
    assert {t: depth(_load_class(t)) for t in targets} == {t: 1 if "reference" in t else 2 for t in targets}


def test_example_backend_is_array_functions_that_return_their_results():
    """The user backend fills none of kvmap's buffers: what its phases return is what the worker dumps."""
    from kvmap.workers.registry import make_worker

    trace = Trace(TRACES / "worked_example.jsonl")
    w, ref = make_worker(EXAMPLE, trace.header), make_worker("numpy", trace.header)
    for step in trace.steps():
        w.run_step(step)
        ref.run_step(step)
        assert w.mappings_dict() == ref.mappings_dict()
        w.append_sampled()
        ref.append_sampled()
    buf = w.buffers  # kvmap's own input buffers: never written by the user backend
    assert not buf.num_blocks.any() and not buf.positions.any() and (buf.slot_mapping == -1).all()
