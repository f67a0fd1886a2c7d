"""Shared fixtures. Tests run offline on CPU in seconds; GPU-only tests skip themselves without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "traces"


def bundled_traces() -> list[Path]:
    return sorted(p for p in TRACES.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))


@pytest.fixture
def worked_example() -> Path:
    return TRACES / "worked_example.jsonl"


def read_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path
