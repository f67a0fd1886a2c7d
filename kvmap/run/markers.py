"""NVTX ranges for Nsight Systems: one `kvmap` domain, a range per step and a nested range per phase.

Rules (NVTX best practices): one domain for the library; event attributes built once per phase (registered
strings, fixed colours), never formatted per call; numbers travel as payloads, not in messages, so that
messages stay registered strings: the step index is the step range's payload, and the step's number of
requests and tokens are the payloads of two marks, `num_reqs` and `num_tokens`, inside it (the Python nvtx
API carries one payload per event). The step range is called `execute_model`, like the worker
method vLLM's per-step range wraps, so kvmap and vLLM timelines line up. `--no-nvtx` or the `NVTX_DISABLE`
environment variable turn every call into nothing, and so does the absence of a tool: a tool that records
NVTX (nsys, Nsight Compute) is found through `NVTX_INJECTION64_PATH`, which it sets for the process it
launches and which NVTX reads once, at the process's first NVTX call. Without it nothing can record the
ranges, and their twenty calls a step cost 3% of a replay (measured on the long trace).

Which nvtx records under which Nsight Systems (measured; README, "Profiling with Nsight Systems"): nvtx
0.2.10-0.2.11 under Debian's 2022.4 and 2023.4 alike; nvtx 0.2.12 and later ask the tool for `nvtxDomainIsEnabled`,
which those builds do not answer, so `get_domain` hands back a `DummyDomain` (no `handle`) and nothing is recorded.
A newer nvtx is never an error: Markers detects the recording-less domain, runs without ranges, and, when a tool is
attached (`NVTX_INJECTION64_PATH` set, so ranges were wanted), says so once on stderr."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

DOMAIN = "kvmap"
STEP_RANGE = "execute_model"
CAPTURE_RANGE = "kvmap_capture"  # wraps the --steps window; `nsys profile --capture-range=nvtx` keys on it
WORKS_WITH = "nvtx 0.2.10-0.2.11 records under Nsight Systems 2022.4 and 2023.4 (pip install nvtx==0.2.11)"
_said: set[str] = set()


def _say_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        print(f"kvmap: warning: {text}", file=sys.stderr)


def nvtx_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvtx")
    except PackageNotFoundError:  # pragma: no cover - a vendored nvtx
        return "?"


def tool_attached() -> str | None:
    """The NVTX tool this process was launched with (its injection library), or None."""
    return os.environ.get("NVTX_INJECTION64_PATH") or os.environ.get("NVTX_INJECTION32_PATH")


def recording_less(domain: object) -> bool:
    """True for a domain that cannot record (nvtx >= 0.2.12's `DummyDomain`, which has no `handle`)."""
    return not hasattr(domain, "handle") or type(domain).__name__ == "DummyDomain"


_COLORS = ("blue", "green", "orange", "purple", "red", "yellow", "cyan", "darkgreen", "rapids")  # nvtx built-ins


class Markers:
    """push/pop NVTX ranges with prebuilt attributes; a no-op object when disabled."""

    def __init__(self, phases: Sequence[str], enabled: bool = True) -> None:
        self.enabled = enabled and not os.environ.get("NVTX_DISABLE") and bool(tool_attached())
        self._phase_attrs: dict[str, object] = {}
        if not self.enabled:
            return
        try:
            import nvtx
            from nvtx import _lib
        except ImportError:  # pragma: no cover - nvtx is a dependency
            self.enabled = False
            return
        self._domain = nvtx.get_domain(DOMAIN)
        if recording_less(self._domain):
            self.enabled = False
            _say_once(f"nvtx {nvtx_version()} gives a recording-less domain under this "
                      f"tool, so there are no NVTX ranges in this run; {WORKS_WITH}")
            return
        self._handle = self._domain.handle
        self._push = _lib.push_range
        self._pop = _lib.pop_range
        self._mark = _lib.mark
        for i, name in enumerate(phases):
            self._phase_attrs[name] = self._domain.get_event_attributes(name, _COLORS[i % len(_COLORS)], None, None)

    def push_capture(self) -> None:
        if self.enabled:
            self._push(self._domain.get_event_attributes(CAPTURE_RANGE, "white", None, None), self._handle)

    def push_step(self, step: int) -> None:
        if self.enabled:
            self._push(self._domain.get_event_attributes(STEP_RANGE, "white", None, step), self._handle)

    def mark_counts(self, num_reqs: int, num_tokens: int) -> None:
        if self.enabled:
            attrs = self._domain.get_event_attributes
            self._mark(attrs("num_reqs", "white", None, num_reqs), self._handle)
            self._mark(attrs("num_tokens", "white", None, num_tokens), self._handle)

    def push(self, phase: str) -> None:
        if self.enabled:
            self._push(self._phase_attrs[phase], self._handle)

    def pop(self) -> None:
        if self.enabled:
            self._pop(self._handle)
