"""What produced a run: the kvmap version, the date, the command line and the host, as plain data for a saved
run (`replay --json`), the CSV's comment header and `kvmap report`.

Rules: taken once, when the run is finished (`provenance()`), never inside a timed region; the date is UTC in
ISO 8601 to the second (`2026-12-02T12:55:24Z`); the host names the machine, CPU model and Python, and the
versions of torch and numpy only when the process had already imported them (asking would import torch).
A run saved before these were recorded has `{}`: every reader says "not recorded" for it.
"""

from __future__ import annotations

import platform
import shlex
import sys
from datetime import datetime, timezone

from kvmap.aot import cpu_model

__all__ = ["csv_header", "provenance", "provenance_lines"]


def provenance(argv: list[str] | None = None) -> dict:
    """{kvmap, date, argv, host: {machine, cpu, python, numpy?, torch?}} of this process, now."""
    from kvmap import __version__

    host = {"machine": platform.machine(), "cpu": cpu_model(), "python": platform.python_version()}
    for module in ("numpy", "torch"):
        mod = sys.modules.get(module)
        if mod is not None:
            host[module] = str(getattr(mod, "__version__", "unknown"))
    return {"kvmap": __version__, "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "argv": list(sys.argv if argv is None else argv), "host": host}


def command_text(p: dict) -> str:
    """The command line as a shell would take it back, `kvmap` for the program (whatever launched it)."""
    argv = p.get("argv") or []
    return shlex.join(["kvmap", *argv[1:]]) if argv else "not recorded"


def host_text(p: dict) -> str:
    h = p.get("host") or {}
    parts = [h.get("machine", "?"), h.get("cpu", "?"), f"Python {h.get('python', '?')}"]
    parts += [f"{m} {h[m]}" for m in ("numpy", "torch") if m in h]
    return ", ".join(parts)


def provenance_lines(p: dict) -> list[tuple[str, str]]:
    """(key, text) lines for a summary: what produced the run, or that it was not recorded."""
    if not p:
        return [("produced by", "not recorded (the run was saved before kvmap recorded what produced it)")]
    return [("produced by", f"kvmap {p.get('kvmap', '?')} on {p.get('date', '?')}: {command_text(p)}"),
            ("host", host_text(p))]


def csv_header(p: dict) -> str:
    """Comment lines (`# key: value`) that open the CSV: pandas (`comment="#"`), R (`comment.char="#"`),
    DuckDB (`comment='#'`) and numpy's loadtxt skip them; Python's csv module needs them skipped first."""
    lines = [("kvmap", p.get("kvmap", "not recorded")), ("date", p.get("date", "not recorded")),
             ("command", command_text(p)), ("host", host_text(p) if p else "not recorded")]
    return "".join(f"# {k}: {' '.join(str(v).split())}\n" for k, v in lines)
