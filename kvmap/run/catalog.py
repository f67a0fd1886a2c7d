"""`kvmap traces`: the bundled traces (usable by name from any folder) with what each holds.

Rules: read-only and lenient: each trace is read through `Trace.steps` (the one decoding interface) to count
steps, distinct requests and scheduled tokens; a damaged trace is listed with its error, never a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmap.errors import KvmapError
from kvmap.files import bundled_traces
from kvmap.trace import Trace


SHORT = {"full_attention": "full", "sliding_window": "sliding", "chunked_local": "local"}


@dataclass(frozen=True, slots=True)
class TraceFacts:
    name: str  # what `kvmap replay NAME` takes
    path: Path
    protocol: str
    groups: str  # "full+sliding": the KV cache group kinds, short
    steps: int
    requests: int
    tokens: int
    size_bytes: int
    error: str | None = None


def trace_facts(name: str, path: Path) -> TraceFacts:
    size = path.stat().st_size
    try:
        t = Trace(path)
        reqs: set[str] = set()
        steps = tokens = 0
        for step in t.steps():
            reqs.update(step.new_req_ids)
            tokens += step.num_tokens
            steps += 1
    except KvmapError as e:
        return TraceFacts(name, path, "", "", 0, 0, 0, size, error=str(e))
    groups = "+".join(dict.fromkeys(SHORT.get(g.kind, g.kind) for g in t.header.kv_cache_groups))
    return TraceFacts(name, path, t.header.model_runner_protocol, groups, steps, len(reqs), tokens, size)


def catalog() -> list[TraceFacts]:
    return [trace_facts(name, path) for name, path in bundled_traces().items()]
