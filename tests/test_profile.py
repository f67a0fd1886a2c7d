"""`kvmap profile` under a real Nsight Systems: every phase's NVTX range is in the report, once per captured
step. Skips where nsys is absent (CI fetches it with scripts/get_nsys.sh)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvmap.run import profile as P
from kvmap.cli.app import app
from kvmap.run.result import PHASES

from .conftest import TRACES

runner = CliRunner()
NSYS = P.find_nsys()


def _nvtx_records() -> bool:
    """nvtx >= 0.2.12 records nothing under Debian's Nsight Systems 2022.4/2023.4 (CI pins 0.2.11, .ci/run)."""
    from kvmap.run.markers import nvtx_version

    parts = [int(x) for x in nvtx_version().split(".")[:3] if x.isdigit()]
    return tuple(parts) < (0, 2, 12)


@pytest.mark.skipif(NSYS is None, reason="nsys not found (scripts/get_nsys.sh fetches it)")
@pytest.mark.skipif(not _nvtx_records(), reason="this nvtx records nothing under Debian's nsys; pin nvtx==0.2.11")
def test_profile_records_every_phase_once_per_step(tmp_path):
    out = tmp_path / "prof"
    res = runner.invoke(app, ["profile", str(TRACES / "chunked_prefill.jsonl"), "--steps", "4:20", "--warmup", "2",
                              "-o", str(out)])
    assert res.exit_code == 0, res.output
    ranges = {r.name: r for r in P.nvtx_ranges(NSYS, out.with_name("prof.nsys-rep"))}
    captured = 20 - 4  # the window; its 2 warm-up steps (2, 3) are replayed just before the capture starts
    assert ranges["execute_model"].instances == captured
    for phase in PHASES:
        # off: no --verify-kv, a host worker copies nothing, one process neither broadcasts nor checks ranks
        if phase in ("kv_verify", "h2d", "broadcast", "cross_rank"):
            assert phase not in ranges
            continue
        assert ranges[phase].instances == captured, phase
    assert "missing" not in res.stdout
    # the numbers travel as payloads: the step index on each step range, requests and tokens on two marks
    import json
    import sqlite3

    db = sqlite3.connect(out.with_name("prof.sqlite"))
    rows = db.execute("select coalesce(e.text, s.value), e.int64Value from NVTX_EVENTS e "
                      "left join StringIds s on e.textId = s.id where e.eventType in (34, 59) "
                      "order by e.start").fetchall()
    steps = [v for name, v in rows if name == "execute_model"]
    assert steps == list(range(4, 20))
    lines = [json.loads(x) for x in (TRACES / "chunked_prefill.jsonl").read_text().splitlines()[1:]]
    tokens = [v for name, v in rows if name == "num_tokens"]
    assert tokens == [lines[k]["scheduler_output"]["total_num_scheduled_tokens"] for k in range(4, 20)]
    reqs = [v for name, v in rows if name == "num_reqs"]
    assert reqs == [len(lines[k]["scheduler_output"]["num_scheduled_tokens"]) for k in range(4, 20)]
    assert "steps 4..19 captured; steps 0..3 replayed first" in " ".join(res.stdout.split())


def test_missing_nsys_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "find_nsys", lambda explicit=None: None)
    res = runner.invoke(app, ["profile", str(TRACES / "worked_example.jsonl"), "-o", str(tmp_path / "p")])
    assert res.exit_code == 2
    assert "scripts/get_nsys.sh" in res.stderr and "--builtin" in res.stderr


def test_builtin_writes_a_perfetto_trace(tmp_path):
    res = runner.invoke(app, ["profile", str(TRACES / "worked_example.jsonl"), "--builtin", "-o", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "p.trace.json").exists()
