"""Runs that say what produced them, repeated runs with mean +- sigma, compare's ratio with its uncertainty,
selectable percentiles, and a profile report that is not overwritten silently."""

from __future__ import annotations

import json
import math
import re

import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app
from kvmap.run.compare import verdict
from kvmap.run.runs import MeanSigma, mean_sigma, ratio

from .conftest import TRACES, one_error

runner = CliRunner()
TRACE = TRACES / "preemption_v2.jsonl"  # 107 steps
WORKED = TRACES / "worked_example.jsonl"


def invoke(*args):
    res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "80"})
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res


def _saved(tmp_path, name: str, *args) -> dict:
    j = tmp_path / name
    assert invoke("replay", TRACE, "-q", "--no-progress", "--json", j, *args).exit_code == 0
    return json.loads(j.read_text())


# ------------------------------------------------------------------ provenance


def test_a_saved_run_records_version_date_command_and_host(tmp_path):
    import numpy

    from kvmap import __version__

    p = _saved(tmp_path, "run.json")["result"]["provenance"]
    assert p["kvmap"] == __version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", p["date"])  # UTC, ISO 8601
    assert isinstance(p["argv"], list) and p["argv"]
    assert {"machine", "cpu", "python"} <= set(p["host"]) and p["host"]["numpy"] == numpy.__version__


def test_csv_opens_with_comment_lines_then_the_same_rows(tmp_path):
    c = tmp_path / "run.csv"
    assert invoke("replay", WORKED, "-q", "--no-progress", "--csv", c).exit_code == 0
    lines = c.read_text().splitlines()
    assert [x.split(": ")[0] for x in lines[:4]] == ["# kvmap", "# date", "# command", "# host"]
    assert lines[2].startswith("# command: kvmap")  # then the arguments (here pytest's: CliRunner keeps sys.argv)
    assert lines[4] == "step,warmup,num_reqs,num_tokens,phase,ns"
    assert not any(x.startswith("#") for x in lines[5:])


def test_report_shows_what_produced_the_run(tmp_path):
    _saved(tmp_path, "run.json")
    out = invoke("report", tmp_path / "run.json").stdout.splitlines()
    assert out[0].startswith("produced by kvmap ") and re.search(r" on \d{4}-\d\d-\d\dT", out[0])
    assert out[1].startswith("host ") and "Python " in out[1]


def test_a_run_saved_before_provenance_still_loads_and_says_so(tmp_path):
    d = _saved(tmp_path, "run.json")
    for key in ("provenance", "percentiles", "runs_p50_us"):  # what older kvmaps did not write
        del d["result"][key]
    d["result"]["a_key_from_the_future"] = 1  # unknown keys are ignored
    old = tmp_path / "old.json"
    old.write_text(json.dumps(d))
    res = invoke("report", old, "--csv", tmp_path / "old.csv")
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0] == ("produced by not recorded (the run was saved before kvmap recorded what "
                                          "produced it)")
    assert "p50" in res.stdout and "p99" in res.stdout  # the default percentiles
    assert (tmp_path / "old.csv").read_text().startswith("# kvmap: not recorded\n")
    assert invoke("compare", old, old).exit_code == 0


# ------------------------------------------------------------------ --runs


def test_mean_sigma_is_the_sample_standard_deviation():
    x = mean_sigma([10.0, 12.0, 14.0])
    assert (x.mean, x.min, x.max, x.n) == (12.0, 10.0, 14.0, 3)
    assert x.sigma == pytest.approx(math.sqrt(((10 - 12) ** 2 + 0 + (14 - 12) ** 2) / (3 - 1)))  # 2.0
    assert mean_sigma([5.0]).sigma == 0.0


def test_ratio_carries_hyperfines_uncertainty():
    a, b = MeanSigma(10.0, 1.0, 9, 11, 5), MeanSigma(20.0, 4.0, 16, 24, 5)
    q, sigma = ratio(a, b)
    assert q == 20 / 10 and sigma == pytest.approx(2 * math.sqrt((1 / 10) ** 2 + (4 / 20) ** 2))
    assert ratio(MeanSigma(0.0, 0.0, 0, 0, 1), b) is None


def test_verdict_names_the_faster_run_and_a_single_run():
    a, b = MeanSigma(24.6, 0.5, 24, 25, 5), MeanSigma(20.0, 0.4, 19, 21, 5)  # 24.6 / 20 = 1.23
    # sigma: 1.23 * sqrt((0.5 / 24.6) ** 2 + (0.4 / 20) ** 2) = 0.035
    assert verdict(a, b) == "B is 1.23 +- 0.04 times faster than A (median step time, mean +- sigma over 5 and 5 runs)"
    one = MeanSigma(20.0, 0.0, 20, 20, 1)
    assert verdict(one, a).startswith("A is 1.23 times faster than B (median step time; A is a single run, so ")


def test_runs_repeat_the_replay_and_report_mean_sigma(tmp_path):
    d = _saved(tmp_path, "runs.json", "--runs", "3")
    runs = d["summary"]["runs"]
    assert runs["count"] == 3 and len(runs["p50_us"]) == 3 and d["result"]["runs_p50_us"] == runs["p50_us"]
    phases = d["result"]["phases"]
    assert all(list(run) == [*phases, "mappings", "step"] for run in runs["p50_us"])
    step = [run["step"] for run in runs["p50_us"]]
    assert runs["phases"]["step"]["mean_us"] == pytest.approx(sum(step) / 3)
    assert runs["phases"]["step"]["min_us"] == min(step) and runs["phases"]["step"]["max_us"] == max(step)
    assert d["result"]["steps_replayed"] == 107  # the last run's record, not three runs' worth
    res = invoke("report", tmp_path / "runs.json")
    assert "median per measured step over 3 runs" in res.stdout
    assert re.search(r"^step +\d+\.\d+ us \+- \d+\.\d+ ", res.stdout, re.M), res.stdout
    table = res.stdout.split("median per measured step over 3 runs")[1].split("sigma: sample standard")[0]
    assert all(len(x) <= 80 for x in table.splitlines())


def test_compare_gives_the_ratio_with_its_uncertainty(tmp_path):
    _saved(tmp_path, "a.json", "--runs", "3")
    _saved(tmp_path, "b.json", "--runs", "2", "-b", "numpy")
    res = invoke("compare", tmp_path / "a.json", tmp_path / "b.json", "--json", tmp_path / "c.json")
    assert res.exit_code == 0, res.output
    assert re.search(r"^step: [AB] is \d+\.\d\d \+- \d+\.\d\d times faster than [AB] \(median step time, mean \+- "
                     r"sigma over 3 and 2 runs\)$", res.stdout, re.M), res.stdout
    assert re.search(r"^step .* \d+\.\d\d \+- \d+\.\d\d ", res.stdout, re.M)
    c = json.loads((tmp_path / "c.json").read_text())
    assert (c["a"]["runs"], c["b"]["runs"]) == (3, 2)
    q, sigma = c["phases"]["step"]["ratio_runs"]
    (ma, sa), (mb, sb) = c["phases"]["step"]["a_runs_p50_us"], c["phases"]["step"]["b_runs_p50_us"]
    assert q == pytest.approx(mb / ma) and sigma == pytest.approx(q * math.hypot(sa / ma, sb / mb))
    _saved(tmp_path, "one.json")
    res = invoke("compare", tmp_path / "a.json", tmp_path / "one.json")
    assert "B is a single run, so the ratio's uncertainty is unknown: replay with --runs N" in res.stdout


def test_runs_refuses_nproc():
    assert "--runs" in one_error(invoke("replay", WORKED, "--runs", "2", "--nproc", "1"))


# ------------------------------------------------------------------ --percentiles


def test_percentiles_choose_the_columns_and_the_json_keys(tmp_path):
    from kvmap.run.stats import percentiles

    j = tmp_path / "run.json"
    res = invoke("replay", TRACE, "--no-progress", "--json", j, "--percentiles", "50,99.9")
    assert res.exit_code == 0, res.output
    header = next(x for x in res.stdout.splitlines() if x.startswith("phase"))
    assert header.split() == ["phase", "mean", "p50", "p99.9", "min", "max", "total", "ms", "share"]
    d = json.loads(j.read_text())
    assert list(d["summary"]["phases"]["step"]) == ["mean_us", "p50_us", "p99.9_us", "min_us", "max_us",
                                                    "total_ms", "share"]
    import numpy as np

    steps = np.asarray(d["result"]["phase_ns"]).reshape(-1, len(d["result"]["phases"]))[d["result"]["warmup"]:]
    assert d["summary"]["phases"]["step"]["p99.9_us"] == percentiles(steps.sum(axis=1) / 1e3, [99.9])[0]
    assert "p99.9" in invoke("report", j).stdout  # the saved run keeps its columns
    assert "p75" in invoke("report", j, "--percentiles", "75").stdout


def test_close_percentiles_keep_their_own_names(tmp_path):
    """Every digit is kept: 99.99999 is not rounded to p100 beside p100 (one JSON key would be lost)."""
    j = tmp_path / "run.json"
    res = invoke("replay", WORKED, "--no-progress", "-q", "--json", j, "--percentiles", "99.99999,100,0.5")
    assert res.exit_code == 0, res.output
    keys = list(json.loads(j.read_text())["summary"]["phases"]["step"])
    assert keys[1:4] == ["p99.99999_us", "p100_us", "p0.5_us"]


def test_default_percentiles_are_todays(tmp_path):
    d = _saved(tmp_path, "run.json")
    assert list(d["summary"]["phases"]["step"])[1:4] == ["p50_us", "p90_us", "p99_us"]


@pytest.mark.parametrize("spec", ["50,x", "101", "50,50", "", "1,2,3,4,5,6", "-1"])
def test_bad_percentiles_are_one_line_naming_the_option(spec):
    assert "--percentiles" in one_error(invoke("replay", WORKED, "--percentiles", spec))


# ------------------------------------------------------------------ profile


@pytest.mark.parametrize("builtin", [False, True])
def test_profile_refuses_an_existing_report(tmp_path, builtin):
    report = tmp_path / ("p.trace.json" if builtin else "p.nsys-rep")
    report.write_text("keep me")
    args = ("profile", WORKED, "-o", tmp_path / "p", *(["--builtin"] if builtin else []))
    line = one_error(invoke(*args))
    assert "--force-overwrite" in line and str(report) in line
    assert report.read_text() == "keep me"
    if builtin:
        assert invoke(*args, "--force-overwrite").exit_code == 0
        assert json.loads(report.read_text())["traceEvents"]
