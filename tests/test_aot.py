"""The kernels compiled ahead of time (kvmap.aot): used when built from the sources on disk, never when stale,
bit for bit the JIT's mappings and KV bits, and checked against their signatures under test."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from kvmap import aot
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace

from .conftest import TRACES

BUILT = aot.twins_on_disk()
needs_twins = pytest.mark.skipif(not BUILT, reason="the ahead-of-time kernels are not built (KVMAP_NO_AOT?)")


@pytest.fixture
def fresh(monkeypatch):
    """An empty load cache for the test (restored after), so `aot.load` decides again."""
    monkeypatch.setattr(aot, "_LOADED", {})
    return monkeypatch


def test_every_export_names_a_kernel_of_its_module():
    for module in aot.KERNEL_MODULES:
        spec = aot._spec(module)
        jit = importlib.import_module(module)
        assert spec["AOT_SOURCES"] and spec["AOT_EXPORTS"]
        for name, (kernel, sig) in spec["AOT_EXPORTS"].items():
            assert hasattr(jit, kernel), (module, name)
            ret, args = aot._split_args(sig)
            # the signature declares as many arguments as the kernel takes
            assert len(args) == jit.__dict__[kernel].py_func.__code__.co_argcount, (name, sig)


@needs_twins
def test_twins_load_when_built_from_these_sources(fresh):
    for module in aot.KERNEL_MODULES:
        k = aot.load(module)
        assert k.kind == "ahead-of-time"
        twin = importlib.import_module(aot.twin_name(module))
        assert twin.source_hash() == aot.source_hash(aot._spec(module)["AOT_SOURCES"])


@needs_twins
def test_a_stale_twin_is_not_used(fresh):
    """An edited kernel source (here: a different hash) sends the load to the JIT, which compiles the edit."""
    fresh.setattr(aot, "source_hash", lambda sources: 12345)
    assert aot.load("kvmap.workers.kernels_cpu").kind == "jit"


@needs_twins
def test_a_twin_built_for_another_cpu_is_not_used(fresh):
    """Compiled for the build machine's CPU: on a CPU with other features it would be an illegal instruction."""
    fresh.setattr(aot, "cpu_hash", lambda: aot.zlib.crc32(b"another cpu"))
    assert aot.load("kvmap.kv.kernels").kind == "jit"


def test_the_cpu_fingerprint_names_this_machine():
    import platform

    assert aot.cpu_fingerprint().startswith(platform.machine()) and aot.cpu_hash() == aot.cpu_hash()


def test_kvmap_aot_0_forces_the_jit(fresh):
    fresh.setenv("KVMAP_AOT", "0")
    assert aot.load("kvmap.kv.kernels").kind == "jit"


@needs_twins
def test_a_wrong_dtype_is_a_type_error_under_test_not_a_crash(fresh):
    fresh.setenv("KVMAP_CHECK_KERNELS", "1")
    k = aot.load("kvmap.workers.kernels_cpu")
    dst = np.zeros(4, np.int32)
    with pytest.raises(TypeError, match=r"scatter: argument 2 is int64\[1d, C\], the signature says i4\[::1\]"):
        k.scatter(dst, np.array([1], np.int32), np.array([7], np.int64))
    with pytest.raises(TypeError, match="argument 0 is int32\\[1d, strided\\]"):
        k.scatter(np.zeros(8, np.int32)[::2], np.array([1], np.int32), np.array([7], np.int32))
    k.scatter(dst, np.array([1, 3], np.int32), np.array([7, 9], np.int32))
    assert dst.tolist() == [0, 7, 0, 9]


def test_variant_picks_the_export_for_the_dtype(fresh):
    k = aot.load("kvmap.kv.kernels")
    if k.kind == "jit":
        assert k.variant("kv_write", np.uint16) is k.kv_write
    else:
        assert k.variant("kv_write", np.uint16) is k.kv_write_u2 and k.variant("kv_write", "uint8") is k.kv_write_u1


@needs_twins
@pytest.mark.parametrize("name", ["worked_example.jsonl", "chunked_prefill.jsonl", "spec_decode.jsonl",
                                  "hybrid_sliding_window.jsonl", "dcp4_interleave8.jsonl", "async_spec_decode.jsonl"])
def test_ahead_of_time_equals_the_jit_bit_for_bit(fresh, name):
    """Every mapping of every step the same from the twin as from the JIT, and every KV slot read back holding
    its canary in both (--verify-kv: the bits are the spec's)."""
    def run(env: str):
        fresh.setattr(aot, "_LOADED", {})
        fresh.setenv("KVMAP_AOT", env)
        dumps: list[dict] = []
        r = replay(Trace(TRACES / name), ReplayConfig(backend="numba", verify_kv=True, nvtx=False),
                   on_mappings=dumps.append)
        assert r.backend_detail.startswith("kernels compiled ahead" if env == "1" else "kernels under numba")
        assert r.kv_checked > 0 and r.kv_mismatches == 0
        return dumps

    assert run("1") == run("0")


def test_the_one_line_sources_read_is_the_declaration():
    for module in aot.KERNEL_MODULES:
        assert aot._sources(module) == aot._spec(module)["AOT_SOURCES"]


def test_no_kernels_and_no_numba_is_one_located_message(tmp_path):
    """The twin turned off and numba unimportable: one line naming --backend and the way out, exit 2."""
    import os
    import subprocess
    import sys

    (tmp_path / "numba.py").write_text('raise ImportError("numba is hidden for this test")\n')
    env = {**os.environ, "KVMAP_AOT": "0", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(aot.ROOT.parent)])}
    out = subprocess.run([sys.executable, "-m", "kvmap", "replay", "--backend", "numba", "--no-progress"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        "kvmap: error: option --backend: the compiled kernels (kvmap.workers._kernels_cpu_aot) are turned off "
        "(KVMAP_AOT=0) and numba cannot load (numba is hidden for this test): pip install numba, rebuild with "
        "`python -m kvmap.aot`, or use --backend numpy")
