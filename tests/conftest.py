"""Shared fixtures. Tests run offline on CPU in seconds; GPU-only tests skip themselves without CUDA."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

# Triton kernels run on CPU tensors under the interpreter when there is no GPU; the variable must be set
# before kvmap.workers.triton_worker is imported (perf-facts.md, section 2). An empty CUDA_VISIBLE_DEVICES, set
# before vLLM is first imported, keeps vLLM's own Triton kernels enabled on such a machine (vllm-on-cpu.md).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

# The kernels compiled ahead of time (kvmap.aot) trust their arguments' dtypes; under test every call is checked
# against its declared signature, so a buffer of the wrong dtype fails a test instead of reading wrong memory.
os.environ.setdefault("KVMAP_CHECK_KERNELS", "1")

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "traces"


def load_script(name: str):
    """scripts/NAME.py as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _all_traces() -> list[Path]:
    return sorted(p for p in TRACES.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))


def _is_dcp(p: Path) -> bool:
    if p.name.endswith(".gz"):
        return False
    with p.open() as f:
        return json.loads(f.readline()).get("decode_context_parallel_size", 1) > 1


def bundled_traces() -> list[Path]:
    """Every bundled trace, single- and multi-rank."""
    return _all_traces()


def single_rank_traces() -> list[Path]:
    """The bundled traces without decode context parallelism (for checks that are single-rank by nature)."""
    return [p for p in _all_traces() if not _is_dcp(p)]


def multi_rank_traces() -> list[Path]:
    """The bundled DCP traces (decode_context_parallel_size > 1)."""
    return [p for p in _all_traces() if _is_dcp(p)]


@pytest.fixture
def worked_example() -> Path:
    return TRACES / "worked_example.jsonl"


def read_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def one_error(result) -> str:
    """A CliRunner result that failed with exit 2 and exactly one `kvmap: error:` line; returns that line."""
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("kvmap: error:"), result.output
    return lines[0]
