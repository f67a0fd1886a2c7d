"""What a user sees (issue 16): one definition of measured steps behind every number, honest windows, compare
that refuses unlike work, '-' as stdout, the umask, broken pipes, --version, one-line usage errors, output
that fits 80 columns, safe printing of names, bundled traces by name (nvtx and nsys: test_nvtx.py)."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app
from kvmap.run.result import PHASES

from .conftest import ROOT, TRACES, read_lines, write_lines

runner = CliRunner()
TRACE = TRACES / "preemption_v2.jsonl"  # 107 steps
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "NVTX_DISABLE": "1"}


def _tokens(path, steps) -> int:
    lines = read_lines(path)[1:]
    return sum(lines[k]["scheduler_output"]["total_num_scheduled_tokens"] for k in steps)


def _run_json(tmp_path, *args, name="run.json") -> dict:
    j = tmp_path / name
    res = runner.invoke(app, ["replay", str(TRACE), "--no-progress", "-q", "--json", str(j), *args])
    assert res.exit_code == 0, res.output
    return json.loads(j.read_text())


# --------------------------------------------------------------------------- 1. measured steps


def test_every_number_is_over_the_same_measured_steps(tmp_path):
    j, c = tmp_path / "run.json", tmp_path / "run.csv"
    res = runner.invoke(app, ["replay", str(TRACE), "--steps", "20:60", "--warmup", "3", "--no-progress",
                              "--json", str(j), "--csv", str(c)])
    assert res.exit_code == 0, res.output
    s = json.loads(j.read_text())["summary"]
    assert s["steps_measured"] == 40 and s["measured_steps"] == [20, 59]
    assert s["warmup"] == 3 and s["warmup_steps"] == [17, 19] and s["warmup_before_window"]
    assert s["steps_replayed"] == 60
    tokens = _tokens(TRACE, range(20, 60))
    assert s["tokens_scheduled"] == tokens
    assert s["mean_tokens_per_step"] == pytest.approx(tokens / 40)
    assert s["steps_per_s"] == pytest.approx(40 / s["time_s"])
    assert s["tokens_per_s"] == pytest.approx(tokens / s["time_s"])
    assert s["phases"]["step"]["total_ms"] == pytest.approx(s["time_s"] * 1e3)
    rows = list(csv.DictReader(x for x in io.StringIO(c.read_text()) if not x.startswith("#")))
    measured = [r for r in rows if r["warmup"] == "0"]
    assert sorted({int(r["step"]) for r in measured}) == list(range(20, 60))
    assert sum(int(r["num_tokens"]) for r in measured if r["phase"] == "read_step") == tokens
    assert sum(int(r["ns"]) for r in measured) / 1e9 == pytest.approx(s["time_s"])
    assert {int(r["step"]) for r in rows if r["warmup"] == "1"} == {17, 18, 19}
    # the printed summary says the same, and `report` prints exactly it
    assert f"{tokens} scheduled in the measured steps" in res.stdout
    assert "40 measured (20..59" in res.stdout and "warm-up 17..19" in res.stdout
    assert "just before the window" in res.stdout
    again = runner.invoke(app, ["report", str(j)])
    assert again.exit_code == 0 and again.stdout.split("\n", 2)[2] == res.stdout  # after what produced it


def test_a_window_from_zero_is_measured_whole_after_a_throwaway_warmup(tmp_path):
    res = runner.invoke(app, ["replay", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "4 measured (0..3)" in res.stdout
    assert "warm-up 0..1 replayed first by a throwaway worker, untimed" in res.stdout
    for args in ([], ["--warmup", "0"]):
        s = _run_json(tmp_path, *args)["summary"]
        assert s["measured_steps"] == [0, 106] and s["warmup_steps"] is None and s["steps_measured"] == 107
        assert s["prewarm_steps"] == (2 if not args else 0)
        assert s["tokens_scheduled"] == _tokens(TRACE, range(107))


def test_a_given_worker_takes_its_warmup_from_the_window():
    from kvmap.run.config import ReplayConfig
    from kvmap.run.replay import replay
    from kvmap.trace import Trace
    from kvmap.workers.registry import make_worker

    t = Trace(TRACE)
    r = replay(t, ReplayConfig(warmup=3, nvtx=False), worker=make_worker("numpy", t.header, "cpu"))
    assert r.prewarm_steps == 0 and list(r.warmup_steps()) == [0, 1, 2] and r.measured_steps()[0] == 3


@pytest.mark.parametrize("args, option", [
    (["--steps", "5000:6000"], "option --steps"),
    (["--steps", "4:"], "option --steps"),
    (["--warmup", "10"], "option --warmup"),
    (["--warmup", "5"], "option --warmup"),
    (["--steps", "1:3"], "option --warmup"),  # 2 warm-up steps cannot come before step 1
])
def test_a_window_that_measures_nothing_is_a_located_error(args, option):
    res = runner.invoke(app, ["replay", str(TRACES / "worked_example.jsonl"), "--no-progress", *args])
    assert res.exit_code == 2, res.output
    assert res.stdout == ""  # no table of zeros
    assert res.stderr.count("\n") == 1 and option in res.stderr and "Traceback" not in res.stderr


def test_a_window_past_the_end_is_measured_and_said(tmp_path):
    s = _run_json(tmp_path, "--steps", "100:5000")["summary"]
    assert s["measured_steps"] == [100, 106]
    assert any("runs past the trace's end (107 steps)" in w for w in s["warnings"])


def test_profile_builtin_measures_the_same_window(tmp_path):
    from kvmap.run.result import warmup_window

    assert warmup_window(4, 20, 2) == (2, 4) and warmup_window(0, 20, 2) == (0, 0)
    assert warmup_window(0, 20, 2, prewarm=False) == (0, 2)
    res = runner.invoke(app, ["profile", str(TRACE), "--builtin", "--steps", "10:20", "-o", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "p.trace.json").read_text())
    steps = sorted({e["args"]["step"] for e in d["traceEvents"] if e["ph"] == "X"})
    assert steps == list(range(8, 20))  # 2 warm-up steps just before the window, then the window
    res = runner.invoke(app, ["profile", str(TRACE), "--steps", "1:20", "-o", str(tmp_path / "q")])
    assert res.exit_code == 2 and "option --warmup" in res.stderr
    res = runner.invoke(app, ["profile", str(TRACE), "--builtin", "--steps", "0:5", "-o", str(tmp_path / "z")])
    d = json.loads((tmp_path / "z.trace.json").read_text())
    assert sorted({e["args"]["step"] for e in d["traceEvents"] if e["ph"] == "X"}) == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------- 2. compare


def test_compare_refuses_unlike_work_and_carries_warnings(tmp_path):
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    k = tmp_path / "k.json"
    for path, args in ((a, ["--steps", "10:15"]), (b, ["--steps", "20:25"]), (k, ["--steps", "10:15",
                                                                                   "--kv-heads", "8"])):
        assert runner.invoke(app, ["replay", str(TRACE), "-q", "--no-progress", "--json", str(path),
                                   *args]).exit_code == 0
    res = runner.invoke(app, ["compare", str(a), str(b)])
    assert res.exit_code == 2 and "measured steps: 10..14" in res.stderr and "--allow-different" in res.stderr
    res = runner.invoke(app, ["compare", str(a), str(k)])
    assert res.exit_code == 2 and "KV cache" in res.stderr
    res = runner.invoke(app, ["compare", str(a), str(b), "--allow-different", "--json", str(tmp_path / "c.json")])
    assert res.exit_code == 0, res.output
    assert "warning: the runs did different work: measured steps" in res.stdout
    assert "warning: A: only 5 measured steps" in res.stdout and "warning: B: only 5 measured steps" in res.stdout
    d = json.loads((tmp_path / "c.json").read_text())
    assert not d["same_work"] and d["differences"] and d["a"]["warnings"]
    same = runner.invoke(app, ["compare", str(a), str(a)])
    assert same.exit_code == 0 and "different work" not in same.stdout


# --------------------------------------------------------------------------- 3. outputs


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_outputs_respect_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        res = runner.invoke(app, ["replay", str(TRACES / "worked_example.jsonl"), "-q", "--no-progress",
                                  "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"),
                                  "--dump-mappings", str(tmp_path / "m.jsonl")])
    finally:
        os.umask(old)
    assert res.exit_code == 0, res.output
    for name in ("r.json", "r.csv", "m.jsonl"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
    assert not list(tmp_path.glob(".kvmap-*"))


def test_dash_is_stdout_for_every_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ex = str(TRACES / "worked_example.jsonl")
    res = runner.invoke(app, ["replay", ex, "--no-progress", "--json", "-"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["summary"]["steps_measured"] == 4
    assert "time per measured step" in res.stderr  # the summary moves to stderr
    res = runner.invoke(app, ["replay", ex, "--no-progress", "-q", "--csv", "-"])
    comments = [x for x in res.stdout.splitlines() if x.startswith("# ")]
    assert [x.split(":")[0] for x in comments] == ["# kvmap", "# date", "# command", "# host"]
    assert res.stdout.split("\n", 4)[4].startswith("step,warmup,num_reqs,num_tokens,phase,ns\n")
    res = runner.invoke(app, ["replay", ex, "--no-progress", "-q", "--dump-mappings", "-"])
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    res = runner.invoke(app, ["validate", ex, "--json", "-"])
    assert json.loads(res.stdout)["valid"] is True
    res = runner.invoke(app, ["replay", ex, "--json", "-", "--csv", "-"])
    assert res.exit_code == 2 and "only one output can be '-'" in res.stderr
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("cmd", [["replay", "long_mixed", "--steps", "0:300", "-q", "--no-progress",
                                  "--dump-mappings", "-"],
                                 ["validate", "BIG", "--json", "-"]])
def test_a_broken_pipe_ends_quietly_with_141(tmp_path, cmd):
    if "BIG" in cmd:  # a report longer than a pipe's buffer (64 KiB): every line has a problem
        import gzip

        lines = [json.loads(x) for x in gzip.open(TRACES / "long_mixed.jsonl.gz", "rt")]
        for x in lines[1:]:
            x["scheduler_output"]["total_num_scheduled_tokens"] += 1
        cmd = [c if c != "BIG" else str(write_lines(tmp_path / "bad.jsonl", lines)) for c in cmd]
    p = subprocess.Popen([sys.executable, "-m", "kvmap", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=ENV, cwd=tmp_path)
    p.stdout.readline()
    p.stdout.close()  # as `| head -1` does
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err


@pytest.mark.parametrize("cmd", [["traces"], ["explain"], ["validate", "worked_example"], ["--help"], ["-h"],
                                 ["replay", "--help"], ["validate", "-h"], []])
def test_a_reader_gone_before_any_output_is_141_too(cmd):
    """Short outputs (a table, one line, the help, the help that no command prints): the reader closes before
    kvmap writes, so the first write meets the closed pipe. Rich's own consoles would exit 1 there."""
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.argv[0] = 'kvmap'; from kvmap.cli import main; "
                          "main()", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, cwd=ROOT)
    p.stdout.close()  # before kvmap has started: `kvmap ... | true`
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert err == ""


# --------------------------------------------------------------------------- 4. command line


def test_version_flags_and_one_line_usage_errors():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.strip().startswith("kvmap 0.")
    help_ = runner.invoke(app, ["replay", "--help"], env={"COLUMNS": "200"})
    assert "--verify-kv" in help_.stdout and "<bool>" not in help_.stdout
    for args, says in ((["replay", "--bogus"], "No such option: --bogus"),
                       (["replay", "--warmup", "x"], "option --warmup"),
                       (["replay", "--steps", "9"], "option --steps"),
                       (["validate"], "Missing argument"),
                       (["nosuchcommand"], "No such command")):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert res.stderr.count("\n") == 1 and says in res.stderr, (args, res.stderr)
        assert "╭" not in res.stderr and "field --" not in res.stderr


def test_options_that_exclude_each_other_are_one_usage_error():
    res = runner.invoke(app, ["replay", "--no-kv", "--verify-kv", "--no-progress"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.output
    assert "--no-kv and --verify-kv exclude each other" in res.stderr and res.stdout == ""


def test_a_problem_without_a_line_is_named_without_one():
    """`validate --deep` problems are found by replaying, not on a line: `file: step 3, ...`, never `file:None:`."""
    from rich.console import Console

    from kvmap.render.validate import render_validation
    from kvmap.validate.problems import Problem, ValidationReport

    console = Console(file=io.StringIO(), width=200)
    report = ValidationReport("t.jsonl", steps=4, problems=[Problem("conformance", "numpy differs", None, 3, "a")])
    render_validation(report, console)
    first = [x for x in console.file.getvalue().splitlines() if x.startswith("first:")]
    assert first == ["first: t.jsonl: step 3, request 'a': numpy differs"]


def test_option_is_the_word_for_an_option():
    from kvmap.errors import KvmapError, format_location

    assert format_location(field="--steps") == "option --steps"
    assert format_location(field="num_computed_tokens") == "field num_computed_tokens"
    assert str(KvmapError("bad", field="-o")) == "option -o: bad"


# --------------------------------------------------------------------------- 5. width


def _fits(text: str, width: int = 80) -> list[str]:
    lines = text.splitlines()
    messages = ("warning:", "first:", "by kind:", "step ", "use a name", "idx_mapping", "query_start_loc",
                "seq_lens", "info:", "  blocks ", "steps ", "trace ", "tokens ", "throughput ", "requests ",
                "KV ", "forward:")  # messages and the summary's lines: never wrapped when piped, so grep finds them
    # whole
    tables = [x for x in lines if not x.startswith(messages) and " problem(s) in " not in x]
    assert all(len(x.rstrip()) <= width for x in tables), text
    return lines


def test_replay_at_80_columns_keeps_phase_names_whole():
    res = runner.invoke(app, ["replay", "--verify-kv", "--no-progress"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = _fits(res.stdout)
    optional = ("h2d", "broadcast", "cross_rank", "prepare_forward")
    for phase in [p for p in PHASES if p not in optional] + ["mappings", "step"]:
        assert any(x.split()[:1] == [phase] for x in lines), phase
    assert "…" not in res.stdout
    warning = [x for x in lines if x.startswith("warning: only")]  # one line, however narrow
    assert warning == ["warning: only 4 measured steps: statistics are rough; replay a longer trace or window"]


def test_piped_width_honours_columns():
    for columns, width in (("60", 60), ("100", 100), (None, 120)):  # piped without COLUMNS: 120
        res = runner.invoke(app, ["replay", "--no-progress"], env={"COLUMNS": columns})
        table = [x for x in res.stdout.splitlines() if x.startswith(("┃", "│", "read_step", "phase"))]
        assert table and max(len(x.rstrip()) for x in table) <= width, (columns, res.stdout)
        assert ("┏" in res.stdout) == (width >= 100), columns


def test_explain_at_80_columns_keeps_headers_and_ids_whole():
    res = runner.invoke(app, ["explain", "long_mixed", "--step", "300"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = _fits(res.stdout)
    header = next(x for x in lines if x.lstrip().startswith("sched "))
    assert header.split() == ["sched", "req_id", "tokens", "origin", "batch", "row", "computed", "flat", "seq_len"]
    d = json.loads(runner.invoke(app, ["explain", "long_mixed", "--step", "300", "--json"]).stdout)
    for r in d["scheduler_order"]:
        assert any(f" {r['req_id']} " in x and r["origin"] in x for x in lines), r
    assert "…" not in res.stdout


def test_validate_at_80_columns_keeps_kinds_whole(tmp_path):
    lines = read_lines(TRACES / "worked_example.jsonl")
    lines[2]["scheduler_output"]["scheduled_cached_reqs"]["num_computed_tokens"] = [35, 16]
    bad = write_lines(tmp_path / "bad.jsonl", lines)
    res = runner.invoke(app, ["validate", str(bad)], env={"COLUMNS": "80"})
    assert res.exit_code == 1
    out = _fits(res.stdout)
    report = json.loads(runner.invoke(app, ["validate", str(bad), "--json", "-"]).stdout)
    for p in report["problems"]:
        assert any(p["kind"] in x.split() for x in out), p["kind"]
    assert "scheduled_cached_reqs." in res.stdout and "num_computed_tokens" in res.stdout
    assert "…" not in res.stdout


# --------------------------------------------------------------------------- safe printing


def test_names_are_never_markup_and_control_characters_are_escaped(tmp_path):
    lines = read_lines(TRACES / "worked_example.jsonl")
    text = json.dumps(lines).replace('"B"', json.dumps("[bold]B\x1b"))
    weird = write_lines(tmp_path / "[red]t[bold].jsonl", json.loads(text))
    res = runner.invoke(app, ["replay", str(weird), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "[red]t[bold].jsonl" in res.stdout
    res = runner.invoke(app, ["explain", str(weird), "--step", "1", "--req", "[bold]B\x1b", "--token", "0"])
    assert res.exit_code == 0, res.output
    assert "[bold]B\\x1b" in res.stdout and "\x1b" not in res.stdout
    res = runner.invoke(app, ["explain", str(weird), "--step", "1", "--req", "[i]nope\x07"])
    assert res.exit_code == 2 and "\x07" not in res.stderr and "[i]nope" in res.stderr


# --------------------------------------------------------------------------- 8. bundled traces


def test_bundled_traces_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["traces"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    _fits(res.stdout)
    row = next(x.split() for x in res.stdout.splitlines() if x.startswith("long_mixed"))
    assert row[1:4] == ["1919", "300", "278,131"]
    res = runner.invoke(app, ["replay", "long_mixed", "--steps", "10:20", "-q", "--no-progress"])
    assert res.exit_code == 0, res.output


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


def test_quiet_kv_failure_says_why_it_exits_1(tmp_path):
    """`-q --verify-kv` on a trace whose KV reads back wrong (step 1 gives A block 12, which B holds): exit 1 with
    one stderr line naming the count and the first mismatch; without -q the summary lists them."""
    lines = read_lines(TRACES / "worked_example.jsonl")
    lines[2]["scheduler_output"]["scheduled_cached_reqs"]["new_block_ids"] = [None, [[12]]]
    path = write_lines(tmp_path / "double.jsonl", lines)
    res = runner.invoke(app, ["replay", str(path), "-q", "--verify-kv", "--no-progress"])
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr.startswith("kvmap: the KV read-back found ") and res.stderr.count("\n") == 1
    assert "first: step 1, request 'B', group 0" in res.stderr
    loud = runner.invoke(app, ["replay", str(path), "--verify-kv", "--no-progress"], env={"COLUMNS": "200"})
    assert loud.exit_code == 1 and "KV mismatch step 1, request 'B'" in loud.stdout


@pytest.mark.parametrize("header_only, args, message", [
    (False, ["--steps", "9:12"],
     "{path}, option --steps: the window 9:12 is outside the trace: the trace has 4 steps (0..3)"),
    (False, ["--warmup", "9"], "option --warmup: 9 warm-up steps, but the trace has only 4; lower --warmup"),
    (True, [], "{path}: the trace has no steps (a header and nothing after it): nothing to replay"),
])
def test_an_empty_window_names_the_option_given(tmp_path, header_only, args, message):
    """A window with nothing to measure: one line naming the option that emptied it, and none when the trace
    itself has no steps (a header alone: no --steps was given, so none is blamed)."""
    path = TRACES / "worked_example.jsonl"
    if header_only:
        path = tmp_path / "header.jsonl"
        path.write_text((TRACES / "worked_example.jsonl").read_text().splitlines(keepends=True)[0])
    res = runner.invoke(app, ["replay", str(path), "-q", "--no-progress", *args])
    assert res.exit_code == 2 and res.stderr == f"kvmap: error: {message.format(path=path)}\n"


def test_a_kv_cache_too_big_from_the_options_blames_the_options():
    """The bundled header is fine; 100000 heads x 100000 from the options make the pool too big: the one line
    names the options and the geometry, not the header's num_gpu_blocks."""
    res = runner.invoke(app, ["replay", "worked_example", "-q", "--no-progress", "--kv-heads", "100000",
                              "--head-size", "100000"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("kvmap: error: option --kv-heads/--head-size: replaying this header needs ")
    assert "with 100000 KV heads x 100000 x bfloat16 per slot from --kv-heads, --head-size and --kv-dtype" in res.stderr
