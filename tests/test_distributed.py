"""A real multi-process replay on torch.distributed (gloo, CPU): 2 and 4 processes give the same dump as the
one-process emulation, every rank's KV shard reads back clean, the broadcast is timed, and a broken
cross-rank invariant is named at its step, request and rank."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace
from kvmap.workers.mappings import dump_line

from .conftest import ROOT, TRACES

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
    r = launch(path, nproc, backend="numpy", verify_kv=True, dump_mappings=dump, stop=stop, warmup=0, timeout=240)
    elapsed = time.perf_counter() - t0
    assert dump.read_bytes() == _emulated(path, stop=stop)
    assert r.world_size == nproc and r.ranks == list(range(nproc))
    assert r.kv_checked > 0 and r.kv_mismatches == 0
    assert all(c > 0 for c in r.rank_kv_checked)
    assert "broadcast" in r.phases and "cross_rank" in r.phases
    assert r.phase_ns[:, r.phases.index("broadcast")].min() > 0
    assert len(r.rank_broadcast_p50_ns) == nproc and min(r.rank_broadcast_p50_ns) > 0
    print(f"{nproc} gloo processes, {name}: {elapsed:.1f} s")
    # the summary's figures are the one-process run's: every rank's KV memory and bytes, counts over the window
    one = replay(Trace(path), ReplayConfig(backend="numpy", verify_kv=True, nvtx=False, stop=stop, warmup=0))
    for key in ("kv_memory", "kv_bytes", "rank_kv_bytes", "rank_tokens", "rank_max_local_seq_len",
                "rank_kv_checked", "kv_checked", "kv_columns"):
        assert getattr(r, key) == getattr(one, key), key
    assert (r.kv_series == one.kv_series).all()


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


# ---------------------------------------------------------------------------------- one unit (issue 29)

SLOW = ("import time\n"
        "from kvmap.workers.host import NumpyWorker\n"
        "class Slow(NumpyWorker):\n"
        "    name = 'slow'\n"
        "    def compute_slot_mappings(self):\n"
        "        time.sleep(0.25)\n"  # 34 steps: about 8 s, so that the signal lands mid-run
        "        super().compute_slot_mappings()\n")


def _ours(marker: str) -> list[int]:
    """Live processes (torchrun and its ranks) whose command line names `marker` (a path of this test)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
                with open(f"/proc/{d}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                continue
            if marker in cmd and "kvmap" in cmd and not zombie:
                pids.append(int(d))
    return pids


def _default_sigint() -> None:
    """The child takes SIGINT as a terminal would deliver it, even when this test runs where it is ignored (a
    background job of a non-interactive shell inherits SIGINT ignored, and so would kvmap)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _size(path) -> int:
    """A file's size, 0 once it is gone (a staging file renamed or removed between listing and stat)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _start_slow_run(tmp_path, *extra):
    trace = tmp_path / "dcp2.jsonl"
    shutil.copy(TRACES / "dcp2.jsonl", trace)
    (tmp_path / "slow.py").write_text(SLOW)
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "NVTX_DISABLE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvmap", "replay", str(trace), "--nproc", "2", "--backend",
                             f"{tmp_path / 'slow.py'}:Slow", "--no-progress", "-q", "--dump-mappings", str(out),
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    deadline = time.monotonic() + 60
    staged = []
    while time.monotonic() < deadline and proc.poll() is None:  # until rank 0 writes the staged dump
        staged = [p for p in tmp_path.iterdir() if p.name.startswith((".kvmap-", out.name)) and _size(p)]
        if staged and len(_ours(str(trace))) >= 3:  # torchrun and two ranks
            break
        time.sleep(0.1)
    assert proc.poll() is None and staged, "the run ended (or never started) before the signal"
    time.sleep(0.5)
    return proc, trace, out


def _reap(marker: str, proc) -> None:
    """Whatever a failed test left running: the ranks and torchrun (by `marker`), and the parent `proc`."""
    for pid in _ours(marker):
        os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()


def _gone(marker: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while _ours(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _ours(marker)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_ranks_die_with_the_parent_and_leave_no_output(tmp_path, sig):
    proc, trace, out = _start_slow_run(tmp_path)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 128 + sig and "Traceback" not in err, err
        assert _gone(str(trace), within=5), "ranks outlived the parent"
    finally:
        _reap(str(trace), proc)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".kvmap-")] == []


def test_ranks_die_when_the_parent_is_killed(tmp_path):
    proc, trace, out = _start_slow_run(tmp_path)
    try:
        proc.kill()  # no handler runs: the kernel's PR_SET_PDEATHSIG links take torchrun, then the ranks
        proc.wait(timeout=10)
        assert _gone(str(trace), within=15), "ranks outlived the parent"
    finally:
        for pid in _ours(str(trace)):
            os.kill(pid, signal.SIGKILL)
    assert not out.exists()  # the staged dump never reaches its name


def test_dash_and_a_missing_folder_with_nproc(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "NVTX_DISABLE": "1"}
    args = [sys.executable, "-m", "kvmap", "replay", str(TRACES / "dcp2.jsonl"), "--backend", "numpy",
            "--no-progress", "-q"]
    p = subprocess.run(args + ["--nproc", "2", "--dump-mappings", "-"], capture_output=True, env=env,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == _emulated(TRACES / "dcp2.jsonl") and not (tmp_path / "-").exists()
    missing = tmp_path / "no" / "d.jsonl"
    t0 = time.monotonic()
    p = subprocess.run(args + ["--nproc", "2", "--dump-mappings", str(missing)], capture_output=True, text=True,
                       env=env, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and str(missing) in lines[0], p.stderr
    assert "torchrun" not in p.stderr and time.monotonic() - t0 < 10


def test_batch_order_reaches_the_ranks(tmp_path):
    from kvmap.run.distributed import launch

    dump = tmp_path / "v1.jsonl"
    launch(TRACES / "dcp2.jsonl", 2, backend="numpy", write_kv=False, dump_mappings=dump, batch_order="v1",
           timeout=240)
    assert dump.read_bytes() == _emulated(TRACES / "dcp2.jsonl", batch_order="v1")


def test_a_rank_failure_is_one_located_line(tmp_path):
    """Line 5 broken: the parent prints rank 0's located message once, not torchrun's failure table."""
    lines = (TRACES / "dcp2.jsonl").read_text().splitlines(keepends=True)
    bad = tmp_path / "bad5.jsonl"
    bad.write_text("".join(lines[:4]) + '{"step": 4, "broken\n' + "".join(lines[5:12]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "NVTX_DISABLE": "1"}
    p = subprocess.run([sys.executable, "-m", "kvmap", "replay", str(bad), "--backend", "numpy", "--no-progress",
                        "-q", "--nproc", "2"], capture_output=True, text=True, env=env, timeout=120)
    out = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(out) == 1, p.stderr
    assert out[0].startswith(f"kvmap: error: rank 0: {bad}:5, step 3: "), out[0]
    assert "torchrun" not in p.stderr and "Traceback" not in p.stderr


def _pids(marker: str, launcher: bool) -> list[int]:
    """Our live torchrun (`launcher`) or rank processes."""
    def cmd(pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    return [p for p in _ours(marker) if (b"torch.distributed.run" in cmd(p)) == launcher]


@pytest.mark.parametrize("victim", ["rank", "torchrun"])
def test_a_killed_rank_or_torchrun_is_one_line_naming_it(tmp_path, victim):
    """A rank the OOM killer takes (SIGKILL): one line naming the rank, its pid and the signal, not torchrun's
    failure table; the other rank is stopped and no output is left."""
    proc, trace, out = _start_slow_run(tmp_path)
    try:
        ranks = _pids(str(trace), launcher=False)
        pid = max(ranks) if victim == "rank" else _pids(str(trace), launcher=True)[0]
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert _gone(str(trace), within=10), "ranks outlived the failure"
    finally:
        _reap(str(trace), proc)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, err
    if victim == "rank":
        assert re.fullmatch(rf"kvmap: error: option --nproc: rank [01] \(pid {pid}\) failed, killed by signal 9 "
                            r"\(SIGKILL\); the other ranks were stopped", lines[0]), lines[0]
    else:
        assert lines[0] == "kvmap: error: option --nproc: torchrun, which runs the ranks, was killed by signal 9 " \
                           "(SIGKILL)", lines[0]
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".kvmap-")] == []


@pytest.mark.parametrize("gpus,want", [(None, "option --device: cuda is not available here"),
                                       (1, "option --nproc: 2 ranks on cuda need a GPU each; 1 visible")])
def test_nproc_on_cuda_without_the_gpus_is_refused_before_starting(monkeypatch, gpus, want):
    """Each rank failed on its own after seconds (NCCL not built in, no cuda:1), reported by torchrun."""
    from typer.testing import CliRunner

    from kvmap.cli.app import app
    from kvmap.run import distributed

    monkeypatch.setattr(distributed, "_run_torchrun", lambda *a: pytest.fail("torchrun started"))
    if gpus is not None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    elif torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    r = CliRunner().invoke(app, ["replay", str(TRACES / "dcp2.jsonl"), "-q", "--no-progress", "--nproc", "2",
                                 "--device", "cuda"])
    assert r.exit_code == 2 and want in r.output, r.output


def test_nproc_beyond_the_memory_left_is_refused_before_starting(monkeypatch):
    """Each rank is a process with its worker and KV shard: 64 ranks in 4 GiB are refused at once, naming
    --nproc, the estimate and what is available; 2 ranks fit."""
    from kvmap.errors import KvmapError
    from kvmap.run import distributed
    from kvmap.trace import header

    monkeypatch.setattr(header, "available_memory", lambda: (4 * 2**30, "memory available (MemAvailable)"))
    monkeypatch.setattr(distributed, "_run_torchrun", lambda *a: pytest.fail("torchrun started"))
    with pytest.raises(KvmapError) as e:
        distributed.launch(TRACES / "dcp2.jsonl", 64, backend="numpy")
    msg = str(e.value)
    assert msg.startswith("option --nproc: 64 ranks need about ") and "GiB per rank" in msg, msg
    assert "4.0 GiB is the memory available (MemAvailable)" in msg, msg
    distributed.check_ranks_fit(TRACES / "dcp2.jsonl", 2, None)  # no error


@pytest.mark.parametrize("version", [2, 1])
def test_a_containers_cgroup_limit_bounds_the_memory_left(tmp_path, monkeypatch, version):
    """MemAvailable is the host's inside a container, so the --nproc and header checks did not see a cgroup
    memory limit. The limit less what is charged (page cache that can be dropped not counted) bounds it."""
    from kvmap.errors import KvmapError
    from kvmap.run import distributed
    from kvmap.trace import header

    folder = tmp_path if version == 2 else tmp_path / "memory"
    folder.mkdir(exist_ok=True)
    names = ("memory.max", "memory.current", "inactive_file") if version == 2 else \
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    (folder / names[0]).write_text(f"{4 * 2**30}\n")
    (folder / names[1]).write_text(f"{3 * 2**30}\n")  # 3 GiB charged, 1 GiB of it page cache that can go
    (folder / "memory.stat").write_text(f"anon 1\n{names[2]} {2**30}\n")
    monkeypatch.setattr(header, "CGROUP", str(tmp_path))
    monkeypatch.setattr(header, "_proc_kib", lambda path, key: 64 * 2**30 if key == "MemAvailable" else None)
    assert header.available_memory() == (4 * 2**30 - 3 * 2**30 + 2**30,
                                         "memory left under the container's cgroup limit of 4.0 GiB")
    monkeypatch.setattr(distributed, "_run_torchrun", lambda *a: pytest.fail("torchrun started"))
    with pytest.raises(KvmapError) as e:
        distributed.launch(TRACES / "dcp2.jsonl", 64, backend="numpy")
    assert "2.0 GiB is the memory left under the container's cgroup limit of 4.0 GiB" in str(e.value), e.value
    (folder / names[0]).write_text("max\n" if version == 2 else f"{2**63 - 4096}\n")  # no limit
    assert header.available_memory()[0] == 64 * 2**30
