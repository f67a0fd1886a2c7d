"""A regular install (`pip install .`, not editable) ships the bundled traces inside the package, where
kvmap/files.py `bundled_traces_dir` finds them: the wheel built from a copy of this tree holds every trace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from .conftest import ROOT, TRACES

SKIP = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".pytest_cache",
                              ".hypothesis", "out", ".whl", ".tools")


def test_the_wheel_holds_the_bundled_traces(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)  # the build writes build/ and egg-info: never in this tree
    env = {**os.environ, "KVMAP_NO_AOT": "1", "PIP_NO_INDEX": "1"}
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path / "wheels")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "wheels").glob("kvmap-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"kvmap/traces/{p.name}" for p in TRACES.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz"))}
    assert len(want) > 10 and want <= names, sorted(want - names)
    assert "kvmap/traces/workloads/long_mixed.yaml" in names and "kvmap/traces/README.md" in names
    assert not any(n.startswith("traces/") for n in names)
    # the pictures' files: the vendored uPlot and the page's script and style (render/html, pyproject package-data)
    assert {f"kvmap/render/html/{f}" for f in ("report.js", "page.css", "vendor/uPlot.iife.min.js",
                                               "vendor/uPlot.min.css", "vendor/LICENSE.uPlot")} <= names


def test_an_installed_copy_finds_its_traces(tmp_path):
    """The package alone, no checkout beside it: the names resolve to the copy inside it."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "kvmap", site / "kvmap", ignore=SKIP)
    shutil.copytree(TRACES, site / "kvmap" / "traces")
    code = "from kvmap.files import resolve_trace; print(resolve_trace('long_mixed'))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(site / "kvmap" / "traces" / "long_mixed.jsonl.gz")
