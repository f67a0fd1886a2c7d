"""Progress on long work: `validate --deep` draws a bar per pass, and `replay --verify-kv` its bar, on standard
error, early, only at a terminal (a pseudo-terminal here); nothing of it in a pipe or on standard output."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import threading
import time

from .conftest import ROOT, TRACES

TRACE = str(TRACES / "chunked_prefill.jsonl")


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NVTX_DISABLE": "1", "TERM": "xterm", "COLUMNS": "100"}
    for k in ("TTY_COMPATIBLE", "FORCE_COLOR", "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "JUPYTER_LINES"):
        env.pop(k, None)
    return env


def _at_terminal(args: list[str]) -> tuple[float | None, float, str, str]:
    """Run kvmap with standard error on a pseudo-terminal: (seconds to its first byte there, or None; seconds to
    the exit; what the terminal got; standard output)."""
    master, slave = pty.openpty()
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "kvmap", *args], stdout=subprocess.PIPE, stderr=slave,
                            stdin=subprocess.DEVNULL, env=_env())
    os.close(slave)
    got: list[bytes] = []
    first: list[float] = []

    def read() -> None:
        while True:
            try:
                b = os.read(master, 4096)
            except OSError:  # the terminal closed: every writer exited
                return
            if not b:
                return
            if not first:
                first.append(time.monotonic() - start)
            got.append(b)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    stdout = proc.communicate(timeout=300)[0].decode()
    total = time.monotonic() - start
    t.join(10)
    os.close(master)
    return (first[0] if first else None), total, b"".join(got).decode(errors="replace"), stdout


def test_validate_deep_shows_each_pass_on_the_terminal_only():
    first, total, terminal, stdout = _at_terminal(["validate", TRACE, "--deep"])
    assert "reference" in terminal and "numpy vs the reference" in terminal, terminal
    assert first is not None and first < total
    assert "vs the reference" not in stdout and "valid" in stdout
    piped = subprocess.run([sys.executable, "-m", "kvmap", "validate", TRACE, "--deep"], capture_output=True,
                           text=True, env=_env(), timeout=300)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    assert piped.stdout == stdout


def test_replay_verify_kv_bar_is_early_and_on_stderr():
    first, total, terminal, stdout = _at_terminal(["replay", TRACE, "--verify-kv", "--kv-heads", "8",
                                                   "--head-size", "128"])
    assert first is not None and first < total, (first, total)
    assert "replaying" in terminal or "kernels" in terminal or "starting" in terminal, terminal
    assert "\x1b" not in stdout and "phase" in stdout


def test_nproc_start_up_is_shown_on_the_terminal_only():
    """`--nproc` spends seconds starting torchrun and its ranks before any step: a spinner says so, at once."""
    trace = str(TRACES / "dcp2.jsonl")
    first, total, terminal, stdout = _at_terminal(["replay", trace, "--nproc", "2", "-q"])
    assert "starting 2 ranks under torchrun" in terminal, terminal
    assert first is not None and first < total
    piped = subprocess.run([sys.executable, "-m", "kvmap", "replay", trace, "--nproc", "2", "-q"],
                           capture_output=True, text=True, env=_env(), timeout=300)
    assert piped.returncode == 0 and "torchrun" not in piped.stderr, piped.stderr
