"""`kvmap profile` under a real Nsight Systems: every phase's NVTX range is in the report, once per captured
step. Skips where nsys is absent (CI fetches it with scripts/get_nsys.sh)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvmap.run import profile as P
from kvmap.cli.app import app
from kvmap.run.result import PHASES

from .conftest import ROOT, TRACES

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
        if phase in ("kv_verify", "h2d", "broadcast", "cross_rank", "prepare_forward"):
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


@pytest.mark.parametrize("nsys, message", [
    ("/nonexistent/nsys", "option --nsys: /nonexistent/nsys does not exist. Get it with scripts/get_nsys.sh"),
    ("/bin/true", "option --nsys: /bin/true profile failed: it exited 0 but wrote no report: is /bin/true Nsight "
                  "Systems?"),
    ("/bin/false", "option --nsys: /bin/false profile failed: it exited 1 without a word"),
])
def test_a_wrong_nsys_is_named(tmp_path, nsys, message):
    """--nsys naming nothing, or a program that is not Nsight Systems: one line naming the path and what went
    wrong (was `field nsys: nsys not found` and `nsys profile failed: ` with nothing after it); nothing written."""
    if not Path(nsys).exists() and nsys.startswith("/bin/"):
        pytest.skip(f"{nsys} is not on this machine")
    res = runner.invoke(app, ["profile", "worked_example", "-o", str(tmp_path / "p"), "--nsys", nsys])
    assert res.exit_code == 2 and res.stderr.startswith(f"kvmap: error: {message}"), res.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("via_env", [False, True])
def test_an_nsys_that_is_not_an_executable_file_is_one_line(tmp_path, monkeypatch, via_env):
    """--nsys or $KVMAP_NSYS naming a folder (the unpacked .tools/nsys, not its bin/nsys) or a plain file is one
    line and exit 2; it was a PermissionError traceback from starting it. Nothing is written."""
    (tmp_path / "nsys").mkdir()
    for bad in (tmp_path / "nsys", TRACES / "worked_example.jsonl"):
        monkeypatch.setenv("KVMAP_NSYS", str(bad)) if via_env else monkeypatch.delenv("KVMAP_NSYS", raising=False)
        args = ["profile", "worked_example", "-o", str(tmp_path / "p")] + ([] if via_env else ["--nsys", str(bad)])
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and res.exception is None or isinstance(res.exception, SystemExit), res.output
        (line,) = res.stderr.splitlines()
        assert f"{bad} is not an executable file" in line
        assert line.startswith("kvmap: error: $KVMAP_NSYS: " if via_env else "kvmap: error: option --nsys: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nsys"]


@pytest.mark.parametrize("force", [[], ["--force-overwrite"]])
def test_the_sqlite_nsys_stats_exports_is_an_output_too(tmp_path, monkeypatch, force):
    """`nsys stats` exports OUTPUT.sqlite beside the report: a trace of that name was overwritten, and an existing
    one replaced without --force-overwrite; both refused before nsys runs."""
    monkeypatch.setattr(P, "find_nsys", lambda explicit=None: None)
    trace = tmp_path / "p.sqlite"
    trace.write_bytes((TRACES / "worked_example.jsonl").read_bytes())
    res = runner.invoke(app, ["profile", str(trace), "-o", str(tmp_path / "p"), *force])
    assert res.exit_code == 2 and f"{trace}, option --output: is the input" in res.stderr, res.stderr
    other = tmp_path / "q.sqlite"
    other.write_text("kept")
    res = runner.invoke(app, ["profile", str(TRACES / "worked_example.jsonl"), "-o", str(tmp_path / "q")])
    assert res.exit_code == 2 and f"{other}, option --output: the report exists" in res.stderr, res.stderr
    assert trace.read_bytes() == (TRACES / "worked_example.jsonl").read_bytes() and other.read_text() == "kept"


def test_the_report_is_staged_and_renamed_only_when_whole(tmp_path):
    """nsys writes a report when it is stopped (Ctrl-C, SIGTERM): it landed under the final name, cut short."""
    rep = tmp_path / "p.nsys-rep"
    with pytest.raises(KeyboardInterrupt):
        with P.staged(rep) as base:
            base.with_suffix(".nsys-rep").write_text("cut short")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []
    with P.staged(rep) as base:
        assert base.parent.parent == tmp_path  # beside: renamed, never copied
        base.with_suffix(".nsys-rep").write_text("whole")
        base.with_suffix(".sqlite").write_text("export")
    assert sorted(os.listdir(tmp_path)) == ["p.nsys-rep", "p.sqlite"] and rep.read_text() == "whole"


FAKE_NSYS = """#!{python}
import subprocess, sys, time
from pathlib import Path
a = sys.argv[1:]
if a[0] == "profile":  # run the replay, then write the report, as nsys does
    out = Path(a[a.index("-o") + 1])
    rc = subprocess.call(a[a.index("-f") + 2:])
    out.with_name(out.name + ".nsys-rep").write_text("report")
    sys.exit(rc)
if a[0] == "stats":  # export the .sqlite beside the report, then stop in the middle
    Path(a[-1]).with_suffix(".sqlite").write_text("half an export")
    print("ready", flush=True)
    time.sleep(60)
"""


def test_sigterm_during_nsys_stats_leaves_no_report(tmp_path):
    """Stopped during `nsys stats`, the report and a half-written .sqlite stayed under their final names."""
    fake = tmp_path / "bin" / "nsys"
    fake.parent.mkdir()
    fake.write_text(FAKE_NSYS.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NVTX_DISABLE": "1"}
    p = subprocess.Popen([sys.executable, "-m", "kvmap", "profile", str(TRACES / "worked_example.jsonl"), "--nsys",
                          str(fake), "-o", str(out / "p")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(out.glob(".kvmap-profile-*/report.sqlite")) + \
            list(out.glob("p.sqlite")):
        time.sleep(0.1)  # until the fake `nsys stats` has written its half export
    time.sleep(0.5)
    p.terminate()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and "Traceback" not in err, err
    assert os.listdir(out) == []


def test_builtin_writes_a_perfetto_trace(tmp_path):
    res = runner.invoke(app, ["profile", str(TRACES / "worked_example.jsonl"), "--builtin", "-o", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "p.trace.json").exists()


LOCAL_NSYS = ROOT / ".tools" / "nsys" / "bin" / "nsys"


def readme_profiling_block() -> str:
    """The commands of the README's profiling section (its bash block), exactly as a reader copies them."""
    section = (ROOT / "README.md").read_text().split("\n## Profiling with Nsight Systems\n", 1)[1].split("\n## ")[0]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.mark.skipif(not LOCAL_NSYS.exists(), reason="no .tools/nsys (CI runs scripts/get_nsys.sh first)")
def test_the_readmes_profiling_block_works_verbatim(tmp_path):
    """The README's three lines (fetch nsys, pin the nvtx it records, profile), run as a user runs them in a
    checkout: in a folder that holds the checkout's scripts/, traces/ and .tools/, with this environment's
    `pip` and `kvmap` first on PATH. kvmap's NVTX ranges are in the report: one step range per captured step
    and each phase inside."""
    block = readme_profiling_block()
    assert "scripts/get_nsys.sh" in block and "nvtx==0.2.11" in block and "kvmap profile" in block
    for name in ("scripts", "traces", ".tools"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=1200)
    assert res.returncode == 0, res.stdout + res.stderr
    ranges = {r.name: r for r in P.nvtx_ranges(str(LOCAL_NSYS), tmp_path / "kvmap-profile.nsys-rep")}
    captured = 600 - 500  # --steps 500:600
    assert ranges["execute_model"].instances == captured
    for phase in PHASES:
        if phase not in ("kv_verify", "h2d", "broadcast", "cross_rank", "prepare_forward"):  # off here
            assert ranges[phase].instances == captured, phase
    assert "execute_model" in res.stdout and "read_step" in res.stdout  # the table kvmap prints
