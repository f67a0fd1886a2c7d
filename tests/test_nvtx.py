"""nvtx and nsys (issue 16, item 7): a recording-less nvtx (>= 0.2.12 under Debian's nsys) is never an error,
says so once, and `kvmap profile` ends with one line naming the fix; every nsys call runs under a timeout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "NVTX_DISABLE": "1"}


def test_a_recording_less_nvtx_is_no_error(monkeypatch, capsys):
    import types

    from kvmap.run import markers

    class DummyDomain:  # nvtx >= 0.2.12 without a listening tool: no `handle`
        def get_event_attributes(self, *a):
            return None

    fake = types.ModuleType("nvtx")
    fake.get_domain = lambda name: DummyDomain()
    fake._lib = types.SimpleNamespace(push_range=None, pop_range=None, mark=None)
    monkeypatch.setitem(sys.modules, "nvtx", fake)
    monkeypatch.setitem(sys.modules, "nvtx._lib", fake._lib)
    monkeypatch.delenv("NVTX_DISABLE", raising=False)
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/nonexistent/libinjection.so")
    markers._said.clear()
    for _ in range(3):
        m = markers.Markers(["read_step"])
        assert not m.enabled
        m.push_step(0), m.push("read_step"), m.pop(), m.pop()
    assert capsys.readouterr().err.count("recording-less") == 1


@pytest.fixture(scope="module")
def newer_nvtx(tmp_path_factory) -> str:
    """A directory with nvtx 0.2.16 installed, or skip (offline, no wheel)."""
    target = os.environ.get("KVMAP_TEST_NEW_NVTX") or str(tmp_path_factory.mktemp("nvtx16"))
    if not (os.path.isdir(os.path.join(target, "nvtx"))):
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target,
                                   "nvtx==0.2.16"], capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            pytest.skip("nvtx 0.2.16 could not be fetched in time")
        if proc.returncode != 0:
            pytest.skip(f"nvtx 0.2.16 not available: {proc.stderr.strip()[-200:]}")
    return target


def test_a_newer_nvtx_replays_without_a_traceback(newer_nvtx):
    target = newer_nvtx
    env = {**ENV, "PYTHONPATH": os.pathsep.join([target, str(ROOT)]), "NVTX_INJECTION64_PATH": "/nonexistent.so"}
    env.pop("NVTX_DISABLE")
    check = subprocess.run([sys.executable, "-c", "import nvtx, importlib.metadata as m; "
                            "print(m.version('nvtx'), type(nvtx.get_domain('kvmap')).__name__)"],
                           capture_output=True, text=True, env=env)
    assert check.stdout.startswith("0.2.16"), check
    proc = subprocess.run([sys.executable, "-m", "kvmap", "replay", "--no-progress", "--verify-kv"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "time per measured step" in proc.stdout
    if "DummyDomain" in check.stdout:
        assert proc.stderr.count("recording-less") == 1


def test_profile_with_a_newer_nvtx_is_one_clear_line(request, tmp_path):
    from kvmap.run import profile as P

    if P.find_nsys() is None:
        pytest.skip("nsys not found (scripts/get_nsys.sh fetches it)")
    target = request.getfixturevalue("newer_nvtx")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([target, str(ROOT)])}
    env.pop("NVTX_DISABLE")
    proc = subprocess.run([sys.executable, "-m", "kvmap", "profile", "chunked_prefill", "--steps", "4:10", "-o",
                           str(tmp_path / "p")], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode == 0:
        pytest.skip("this nsys records nvtx 0.2.16's ranges")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "pip install nvtx==0.2.11" in proc.stderr and "Traceback" not in proc.stderr


def test_nsys_runs_under_a_timeout():
    from kvmap.errors import KvmapError
    from kvmap.run import profile as P

    with pytest.raises(KvmapError) as e:
        P._run([sys.executable, "-c", "import time; time.sleep(30)"], 1, "nsys profile")
    assert "within 1 s" in str(e.value) and "--timeout" in str(e.value) and "--builtin" in str(e.value)


def test_no_nvtx_calls_without_a_tool(monkeypatch):
    """NVTX finds a tool through NVTX_INJECTION64_PATH, which the tool sets for the process it launches: without
    it nothing can record, so the markers make no calls; with it they do (where the nvtx can record)."""
    import nvtx

    from kvmap.run import markers

    monkeypatch.delenv("NVTX_DISABLE", raising=False)
    for k in ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH"):
        monkeypatch.delenv(k, raising=False)
    assert markers.tool_attached() is None and not markers.Markers(["read_step"]).enabled
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/nonexistent/libinjection.so")
    markers._said.clear()
    m = markers.Markers(["read_step"])
    assert m.enabled == (not markers.recording_less(nvtx.get_domain(markers.DOMAIN)))
    assert not markers.Markers(["read_step"], enabled=False).enabled  # --no-nvtx
