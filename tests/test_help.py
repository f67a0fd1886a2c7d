"""Help that reads at 80 columns (issue 30): no entry cut off with an ellipsis, options in panels, `-h` as
`--help` on the root and every command, examples in every command's help, and shell completion of TRACE with
the bundled traces' names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app, command_name
from kvmap.cli.options import complete_trace
from kvmap.files import bundled_traces

from .conftest import ROOT

runner = CliRunner()
COMMANDS = [command_name(c) for c in app.registered_commands]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def kvmap(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The entry point as a user runs it (the root's `--help` and `-h` are drawn without typer)."""
    code = "import sys; sys.argv[0] = 'kvmap'; from kvmap.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**ENV, **env}, cwd=ROOT)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_at_80_columns_cuts_no_entry(cmd):
    res = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "80"}, prog_name="kvmap")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert all(len(x) <= 80 for x in lines), res.stdout
    entries = [x for x in lines if x.startswith("│")]  # everything inside a panel
    assert entries and not [x for x in entries if "…" in x or "..." in x], res.stdout
    assert "Examples:" in res.stdout and f"kvmap {cmd}" in res.stdout.split("Examples:")[1]


def test_replay_groups_its_options_in_panels():
    res = runner.invoke(app, ["replay", "--help"], env={"COLUMNS": "80"}, prog_name="kvmap")
    panels = [x.split("─ ")[1].split(" ─")[0] for x in res.stdout.splitlines() if x.startswith("╭─ ")]
    assert panels == ["Arguments", "Options", "Backend", "Window", "Forward pass", "KV cache", "Outputs", "Multi-rank"]
    assert "<int" not in res.stdout and "<str>" not in res.stdout  # short value names: N, TEXT, FILE


def test_dash_h_is_dash_dash_help_everywhere():
    for args in [[]] + [[c] for c in COMMANDS]:
        long_ = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "80"}, prog_name="kvmap")
        short = runner.invoke(app, [*args, "-h"], env={"COLUMNS": "80"}, prog_name="kvmap")
        assert short.exit_code == long_.exit_code == 0 and short.stdout == long_.stdout, args
    fast_long, fast_short = kvmap("--help", COLUMNS="80"), kvmap("-h", COLUMNS="80")
    assert fast_short.returncode == 0 and fast_short.stdout == fast_long.stdout
    assert "-h, --help" in fast_short.stdout and "--install-completion" in fast_short.stdout


def test_trace_completes_bundled_names_and_trace_files(tmp_path, monkeypatch):
    assert complete_trace("long") == ["long_mixed"]
    assert set(complete_trace("")) >= set(bundled_traces())
    (tmp_path / "runs").mkdir()
    for name in ("a.jsonl", "b.jsonl.gz", "notes.txt"):
        (tmp_path / "runs" / name).write_text("")
    monkeypatch.chdir(tmp_path)
    assert complete_trace("ru") == ["runs/"]
    assert complete_trace("runs/") == ["runs/a.jsonl", "runs/b.jsonl.gz"]
    assert complete_trace("nowhere/x") == []


def test_the_shell_asks_and_gets_bundled_names():
    res = kvmap(_KVMAP_COMPLETE="complete_bash", COMP_WORDS="kvmap replay spec", COMP_CWORD="2")
    assert res.returncode == 0 and res.stdout.split() == ["spec_decode"], res.stdout + res.stderr
    res = kvmap(_KVMAP_COMPLETE="complete_bash", COMP_WORDS="kvmap validate dcp2", COMP_CWORD="2")
    assert res.stdout.split() == ["dcp2", "dcp2_mamba"]
