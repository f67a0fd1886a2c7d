"""Start-up stays light: `kvmap --help` and `kvmap validate` import neither torch (~2 s) nor numba, and a host
replay (KV cache in numpy memory) never imports torch."""

from __future__ import annotations

import subprocess
import sys

from .conftest import TRACES

PROBE = """
import sys
from kvmap.cli.app import app
try:
    app(sys.argv[1:], standalone_mode=False)
except SystemExit:
    pass
print(sorted(m for m in ("torch", "numba", "triton") if m in sys.modules))
"""


def heavy_modules(*args: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_help_imports_nothing_heavy():
    assert heavy_modules("--help") == "[]"


def test_validate_imports_nothing_heavy():
    assert heavy_modules("validate", str(TRACES / "worked_example.jsonl")) == "[]"


def test_host_replay_imports_no_torch():
    assert heavy_modules("replay", str(TRACES / "worked_example.jsonl"), "--no-progress", "--verify-kv") == \
        "['numba']"
    assert heavy_modules("replay", str(TRACES / "worked_example.jsonl"), "--no-progress", "-b", "numpy") == "[]"


def test_torch_backend_does_import_torch():  # the probe can see an import
    assert "torch" in heavy_modules("replay", str(TRACES / "worked_example.jsonl"), "--no-progress", "-b", "torch")
