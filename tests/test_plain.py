"""The summary drawn without Rich for a file or a pipe (kvmap/run/plain.py) is Rich's drawing byte for byte, at
every width, for every kind of summary; where it cannot be, Rich draws it; and a piped replay never imports Rich."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from rich.console import Console

from kvmap.run.plain import PIPED_WIDTH, TableSpec, draw_table, plain_width
from kvmap.run.replay import replay
from kvmap.run.report import render_summary
from kvmap.trace import Trace

from .conftest import ROOT, TRACES

WIDTHS = (200, 120, 100, 99, 80, 70, 64, 40)


class PipeConsole:
    """What the CLI's console is for a pipe (cli/app.py `LazyConsole`): plain lines, or its Rich console."""

    def __init__(self, width: int) -> None:
        self.buf = io.StringIO()
        self.width_ = width
        self.rich = Console(file=self.buf, width=width)
        self.plain = 0  # summaries drawn without Rich

    def plain_width(self) -> int:
        return self.width_

    def write_lines(self, lines: list[str]) -> None:
        self.plain += 1
        self.buf.write("".join(line + "\n" for line in lines))

    def __getattr__(self, name):
        return getattr(self.rich, name)


def _both(result, width: int) -> tuple[str, str, bool]:
    rich = io.StringIO()
    render_summary(result, Console(file=rich, width=width))
    pipe = PipeConsole(width)
    render_summary(result, pipe)
    return pipe.buf.getvalue(), rich.getvalue(), bool(pipe.plain)


@pytest.fixture(scope="module")
def results():
    worked = Trace(TRACES / "worked_example.jsonl")
    runs = {
        "worked_example": replay(worked),
        "verify": replay(worked, verify_kv=True),
        "window": replay(Trace(TRACES / "chunked_prefill.jsonl"), start=3, stop=9, warmup=1),
        "long": replay(Trace(TRACES / "long_mixed.jsonl.gz"), stop=300),
        "dcp": replay(Trace(TRACES / "dcp2.jsonl")),  # per-rank tables: Rich draws
    }
    bad = replay(worked, verify_kv=True)  # located KV mismatches: red lines below the table
    bad.kv_mismatches = 2
    bad.kv_examples = [{"step": 1, "req_id": "r\x1b[0", "group": 0, "position": 12 * 16 + 15, "slot": 7, "rank": 0,
                        "expected_token": 5, "found": 6}] * 2
    runs["mismatches"] = bad
    return runs


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", ["worked_example", "verify", "window", "long", "dcp", "mismatches"])
def test_the_plain_summary_is_richs_byte_for_byte(results, name, width):
    plain, rich, drawn_plainly = _both(results[name], width)
    assert plain == rich
    if width >= 80:  # the one-group summaries fit from 80 columns (narrower, it depends on the figures)
        assert drawn_plainly == (name != "dcp"), (name, width)
    elif width == 40:
        assert not drawn_plainly  # no phase table fits: Rich folds it


def test_a_table_rich_would_wrap_is_left_to_rich():
    spec = TableSpec("a title", "a caption")
    spec.add_column("key", no_wrap=True)
    spec.add_column("value", "right")
    spec.add_row("prepare_inputs", "12.5")
    assert draw_table(spec, 80) is not None
    assert draw_table(spec, len("prepare_inputs") + len("value") + 1) is None  # does not fit
    long_title = TableSpec("t" * 40)
    long_title.add_column("k")
    long_title.add_row("v")
    assert draw_table(long_title, 120) is None  # the title would wrap inside the table's width
    for odd in ("naïve", "a\tb", "宽"):
        spec = TableSpec("t")
        spec.add_column("k")
        spec.add_row(odd)
        assert draw_table(spec, 120) is None  # Rich measures and wraps these itself


def test_plain_width_is_where_rich_draws_plainly(monkeypatch):
    class Stream:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    for k in ("COLUMNS", "TTY_COMPATIBLE", "FORCE_COLOR", "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "JUPYTER_LINES"):
        monkeypatch.delenv(k, raising=False)
    assert plain_width(Stream(False)) == PIPED_WIDTH
    assert plain_width(Stream(True)) is None
    assert plain_width(object()) is None  # no isatty: Rich decides
    monkeypatch.setenv("COLUMNS", "90")
    assert plain_width(Stream(False)) == 90
    monkeypatch.setenv("COLUMNS", "wide")
    assert plain_width(Stream(False)) == PIPED_WIDTH
    for k, v in (("FORCE_COLOR", "1"), ("FORCE_COLOR", ""), ("TTY_COMPATIBLE", "0"), ("TTY_INTERACTIVE", "1")):
        monkeypatch.setenv(k, v)
        assert plain_width(Stream(False)) is None, k
        monkeypatch.delenv(k)


def _kvmap(*args: str, **env: str) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(ROOT), "NVTX_DISABLE": "1", **env}
    for k in ("COLUMNS", "TTY_COMPATIBLE", "FORCE_COLOR", "TTY_INTERACTIVE"):
        if k not in env:
            e.pop(k, None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=e, timeout=120)


def test_a_piped_replay_imports_no_rich_and_reports_as_rich_draws(tmp_path):
    run = tmp_path / "run.json"
    proc = _kvmap("-X", "importtime", "-m", "kvmap", "replay", "--no-progress", "--json", str(run))
    assert proc.returncode == 0, proc.stderr
    assert "time per measured step" in proc.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")]
    assert imported and not [m for m in imported if m.split(".")[0] == "rich"]
    # the same saved run re-rendered: without Rich (a pipe) and by Rich (TTY_COMPATIBLE=0: still no terminal)
    plain = _kvmap("-m", "kvmap", "report", str(run))
    rich = _kvmap("-m", "kvmap", "report", str(run), TTY_COMPATIBLE="0")
    assert plain.returncode == rich.returncode == 0, (plain.stderr, rich.stderr)
    assert plain.stdout == rich.stdout and "time per measured step" in plain.stdout
    narrow = _kvmap("-m", "kvmap", "report", str(run), COLUMNS="72")
    assert narrow.stdout == _kvmap("-m", "kvmap", "report", str(run), COLUMNS="72", TTY_COMPATIBLE="0").stdout


def test_an_unwritable_output_is_one_line_not_a_traceback():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NVTX_DISABLE": "1"}
    for k in ("COLUMNS", "TTY_COMPATIBLE", "FORCE_COLOR", "TTY_INTERACTIVE"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "kvmap", "replay", "--no-progress"]
    if os.path.exists("/dev/full"):  # a full disk, under the piped summary, Rich's output and `-` as FILE
        for args in ([], ["-q", "--json", "-"], ["-q", "--dump-mappings", "-"]):
            with open("/dev/full", "w") as full:
                proc = subprocess.run(cmd + args, stdout=full, stderr=subprocess.PIPE, text=True, env=env,
                                      timeout=120)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr)
            assert proc.stderr.strip() == "kvmap: error: cannot write the output: No space left on device", args
        with open("/dev/full", "w") as full:
            proc = subprocess.run([sys.executable, "-m", "kvmap", "validate", str(TRACES / "worked_example.jsonl")],
                                  stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "No space left" in proc.stderr
    # standard output closed before kvmap starts (`>&-`): nothing to write to, and no traceback on the way out
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, timeout=120,
                          preexec_fn=lambda: os.close(1))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
