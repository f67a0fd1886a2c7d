"""One output policy for every command that writes files (issue 29): no output over an input or another
output, one standard output, special files written in place (never renamed over), symbolic links kept, every
path checked before the work starts; `kvmap report` on damaged runs is one located line; an option error
names the option that was wrong.

Special files are our own: symbolic links and FIFOs in a temporary folder (one link points at the process's
own /proc/self/fd/1, as /dev/stdout does); the machine's /dev is never written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app

from .conftest import ROOT, TRACES, one_error

runner = CliRunner()
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "NVTX_DISABLE": "1"}
WORKED = TRACES / "worked_example.jsonl"


def invoke(*args: str):
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r


@pytest.fixture
def run_json(tmp_path):
    j = tmp_path / "run.json"
    assert invoke("replay", WORKED, "-q", "--no-progress", "--json", j).exit_code == 0
    return j


# ---------------------------------------------------------------------------------- inputs and outputs


@pytest.mark.parametrize("args", [
    ("report", "{r}", "--csv", "{r}"),
    ("report", "{r}", "--trace-out", "{d}/./run.json"),
    ("report", "{r}", "--csv", "{d}/link.json"),
    ("compare", "{r}", "{b}", "--json", "{r}"),
    ("compare", "{r}", "{b}", "--json", "{b}"),
    ("report", "{r}", "--csv", "{d}/x.csv", "--trace-out", "{d}/x.csv"),
], ids=lambda a: " ".join(a).replace("{", "").replace("}", ""))
def test_report_and_compare_never_overwrite_their_inputs(tmp_path, run_json, args):
    b = tmp_path / "b.json"
    shutil.copy(run_json, b)
    (tmp_path / "link.json").symlink_to(run_json)
    before = run_json.read_bytes(), b.read_bytes()
    line = one_error(invoke(*(a.format(r=run_json, b=b, d=tmp_path) for a in args)))
    assert "destroy the input" in line or "its own file" in line
    assert "option --" in line  # names the output; the message names the input or the other output
    assert (run_json.read_bytes(), b.read_bytes()) == before
    assert not (tmp_path / "x.csv").exists()


def test_report_puts_one_document_on_stdout(run_json):
    line = one_error(invoke("report", run_json, "--csv", "-", "--trace-out", "-"))
    assert "only one output can be '-'" in line and "--csv" in line and "--trace-out" in line


def _replay_to(stdout_file, *args) -> subprocess.CompletedProcess:
    with open(stdout_file, "w") as f:
        return subprocess.run([sys.executable, "-m", "kvmap", "replay", str(WORKED), "--no-progress", *args],
                              stdout=f, stderr=subprocess.PIPE, text=True, env=ENV, timeout=120)


@pytest.mark.parametrize("link_to", ["file", "/proc/self/fd/1"])
def test_an_output_that_is_standard_output_is_written_there_and_the_link_stays(tmp_path, link_to):
    """`kvmap replay T --json /dev/stdout > F`, with our own link: F holds the JSON, the link stays a link."""
    f = tmp_path / "F"
    link = tmp_path / "stdout-link"
    link.symlink_to(f if link_to == "file" else link_to)
    p = _replay_to(f, "--json", str(link))
    assert p.returncode == 0, p.stderr
    assert link.is_symlink() and os.readlink(link) == (str(f) if link_to == "file" else link_to)
    assert json.loads(f.read_text())["summary"]["steps_replayed"] == 4  # F is the JSON alone
    assert "steps" in p.stderr  # the summary went to stderr, as with `-`


def test_the_file_standard_error_writes_is_refused(tmp_path):
    """`--json F 2>>F`: renamed over, F took kvmap's messages with it (they went to the unlinked old file)."""
    f = tmp_path / "F"
    f.write_text("earlier\n")
    with open(f, "a") as err:
        p = subprocess.run([sys.executable, "-m", "kvmap", "replay", str(WORKED), "--no-progress", "-q", "--json",
                            str(f)], stdout=subprocess.DEVNULL, stderr=err, env=ENV, timeout=120)
    assert p.returncode == 2
    assert f.read_text() == f"earlier\nkvmap: error: {f}, option --json: is the file standard error writes to (2>); " \
                            "give the output its own file\n"


def test_proc_self_fd_is_written_in_place(tmp_path):
    f = tmp_path / "F"
    p = _replay_to(f, "--json", "/proc/self/fd/1")
    assert p.returncode == 0, p.stderr
    assert json.loads(f.read_text())["summary"]["steps_replayed"] == 4


def test_a_link_to_a_regular_file_stays_a_link(tmp_path):
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    assert invoke("replay", WORKED, "-q", "--no-progress", "--json", link).exit_code == 0
    assert link.is_symlink() and json.loads(target.read_text())["summary"]["steps_replayed"] == 4


def test_two_stdouts_by_other_names_are_refused(tmp_path):
    f = tmp_path / "F"
    (tmp_path / "l").symlink_to("/proc/self/fd/1")
    p = _replay_to(f, "--json", "-", "--csv", str(tmp_path / "l"))
    assert p.returncode == 2 and "only one output can be '-'" in p.stderr, p.stderr


def test_a_fifo_is_written_in_place(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    r = invoke("replay", WORKED, "-q", "--no-progress", "--json", fifo)
    reader.join(timeout=60)
    assert r.exit_code == 0, r.output
    assert fifo.is_fifo() and json.loads(got[0])["summary"]["steps_replayed"] == 4


# ---------------------------------------------------------------------------------- checked before the work


def _no_work(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the work started before the outputs were checked")

    import kvmap.run.replay
    import kvmap.validate

    monkeypatch.setattr(kvmap.run.replay, "replay", refuse)
    monkeypatch.setattr(kvmap.validate, "validate", refuse)


@pytest.mark.parametrize("args", [
    ("replay", str(WORKED), "-q", "--json", "{d}/missing/run.json"),
    ("replay", str(WORKED), "-q", "--csv", "{d}/missing/run.csv"),
    ("replay", str(WORKED), "-q", "--dump-mappings", "{d}"),
    ("validate", str(WORKED), "--json", "{d}/missing/v.json"),
    ("profile", str(WORKED), "--builtin", "-o", "{d}/missing/p"),
    ("report", "{r}", "--trace-out", "{d}/missing/t.json"),
    ("compare", "{r}", "{r}", "--json", "{d}/missing/c.json"),
    ("record", "{r}", "-o", "{d}/missing/t.jsonl"),
    ("record", "{r}", "-o", "{r}"),
], ids=lambda a: " ".join(a[:1] + a[2:]).replace("{", "").replace("}", ""))
def test_bad_output_paths_fail_before_the_work(tmp_path, run_json, monkeypatch, args):
    _no_work(monkeypatch)
    line = one_error(invoke(*(a.format(d=tmp_path, r=run_json) for a in args)))
    assert "missing" in line or "directory" in line or "destroy the input" in line, line


@pytest.mark.parametrize("case,why", [("long", "File name too long"), ("loop", "Too many levels of symbolic links"),
                                      ("through a file", "Not a directory")])
def test_names_the_system_refuses_fail_before_the_work(tmp_path, run_json, monkeypatch, case, why):
    """A name too long was a traceback (pathlib's stat); a loop of links was replaced by a regular file."""
    _no_work(monkeypatch)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    out = {"long": tmp_path / ("x" * 300), "loop": tmp_path / "a", "through a file": run_json / "x.json"}[case]
    for args in (("replay", WORKED, "-q", "--json", out), ("validate", WORKED, "--json", out),
                 ("report", run_json, "--csv", out), ("compare", run_json, run_json, "--json", out)):
        line = one_error(invoke(*args))
        assert f"{out}, option --" in line and f"cannot write: {why}" in line, line
    assert (tmp_path / "a").is_symlink() and os.readlink(tmp_path / "a") == str(tmp_path / "b")


@pytest.mark.parametrize("name", ["-", "stdout-link", "fifo"])
def test_profile_output_is_a_file_name_never_a_special_file_with_a_suffix(tmp_path, monkeypatch, name):
    """`-o` is a report name that `.trace.json` / `.nsys-rep` is added to: `-o -` once wrote `./-.trace.json`
    and `-o /dev/stdout` a regular file `/dev/stdout.trace.json` beside the machine's own /dev/stdout."""
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "stdout-link").symlink_to("/proc/self/fd/1")
    before = sorted(os.listdir(tmp_path))
    _no_work(monkeypatch)
    for builtin in (["--builtin"], []):
        line = one_error(invoke("profile", WORKED, *builtin, "-o", name))
        assert "option --output: profile writes a report file: give a file name" in line, line
    assert sorted(os.listdir(tmp_path)) == before


# ---------------------------------------------------------------------------------- damaged saved runs


def _damaged(d: dict, case: str):
    if case == "no phases":
        d.pop("phases")
    elif case == "null step_window":
        d["step_window"] = None
    elif case == "string warmup":
        d["warmup"] = "3"
    elif case == "group without kind":
        d["groups"] = [{}]
    elif case == "no phase names":
        d["phases"] = []
    return d


@pytest.mark.parametrize("case", ["directory", "deep array", "5000-digit warmup", "no phases", "null step_window",
                                  "string warmup", "group without kind", "no phase names"])
def test_report_on_a_damaged_run_is_one_located_line(tmp_path, run_json, case):
    bad = tmp_path / "bad.json"
    if case == "directory":
        bad = tmp_path
    elif case == "deep array":
        bad.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "5000-digit warmup":  # past Python's int-from-string limit: a ValueError, not a JSONDecodeError
        bad.write_text(run_json.read_text().replace('"warmup": 0', '"warmup": ' + "9" * 5000, 1))
    else:
        bad.write_text(json.dumps(_damaged(json.loads(run_json.read_text())["result"], case)))
    line = one_error(invoke("report", bad))
    assert str(bad) in line
    if case not in ("directory", "deep array", "5000-digit warmup"):
        assert "field " in line
    assert one_error(invoke("compare", run_json, bad)) == line


# ---------------------------------------------------------------------------------- option errors


@pytest.mark.parametrize("args,option", [
    (["--batch-order", "v3"], "--batch-order"),
    (["--batch-order", "v3", "--nproc", "2"], "--batch-order"),
    (["--reorder-threshold", "4"], "--reorder-threshold"),
])
def test_an_option_error_names_the_option_that_was_wrong(args, option):
    line = one_error(invoke("replay", TRACES / "dcp2.jsonl", "-q", "--no-progress", *args))
    assert f"option {option}:" in line, line
