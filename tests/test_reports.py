"""Reports: a saved run re-renders to the same table, compares with itself at 1.00, and exports valid CSV and
Chrome trace-event JSON."""

from __future__ import annotations

import csv
import io
import json

from typer.testing import CliRunner

from kvmap.cli.app import app
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.render.report import to_chrome_trace, to_csv
from kvmap.run.result import ReplayResult
from kvmap.trace import Trace

from .conftest import TRACES

runner = CliRunner()
TRACE = TRACES / "preemption_v2.jsonl"


def test_report_prints_what_replay_printed(tmp_path):
    j = tmp_path / "run.json"
    res = runner.invoke(app, ["replay", str(TRACE), "--json", str(j), "--no-progress"])
    assert res.exit_code == 0
    again = runner.invoke(app, ["report", str(j)])
    assert again.exit_code == 0
    produced_by, host, *rest = again.stdout.splitlines(keepends=True)
    assert produced_by.startswith("produced by kvmap 0.") and host.startswith("host ")
    assert "".join(rest) == res.stdout


def test_compare_with_itself_is_one(tmp_path):
    j = tmp_path / "run.json"
    runner.invoke(app, ["replay", str(TRACE), "--json", str(j), "--no-progress"])
    out = tmp_path / "cmp.json"
    res = runner.invoke(app, ["compare", str(j), str(j), "--json", str(out)])
    assert res.exit_code == 0 and "1.00" in res.stdout
    d = json.loads(out.read_text())
    assert all(row["ratio_p50"] == 1.0 for row in d["phases"].values() if row["ratio_p50"] is not None)


def test_result_json_round_trip():
    r = replay(Trace(TRACE), ReplayConfig(nvtx=False))
    back = ReplayResult.from_json(json.loads(json.dumps(r.to_json())))
    assert (back.phase_ns == r.phase_ns).all() and back.phases == r.phases and (back.steps == r.steps).all()


def test_chrome_trace_is_valid_trace_event_json():
    r = replay(Trace(TRACE), ReplayConfig(nvtx=False))
    d = json.loads(json.dumps(to_chrome_trace(r)))
    events = d["traceEvents"]
    steps = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert len(steps) == r.steps_replayed == 107
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == {"step", *r.phases}
    for e in events:
        assert e["ph"] in ("X", "M") and e["pid"] == 1
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0 and isinstance(e["name"], str)
    # phases of one step lie inside that step's span, in order
    first = [e for e in events if e["ph"] == "X" and e["args"]["step"] == 0]
    span = next(e for e in first if e["tid"] == 0)
    inner = sorted((e for e in first if e["tid"] != 0), key=lambda e: e["ts"])
    assert [e["name"] for e in inner] == r.phases
    assert abs(inner[0]["ts"] - span["ts"]) < 1e-6
    assert inner[-1]["ts"] + inner[-1]["dur"] <= span["ts"] + span["dur"] + 1e-3


def test_csv_one_row_per_step_and_phase():
    r = replay(Trace(TRACE), ReplayConfig(nvtx=False))
    text = to_csv(r)
    assert text.startswith("# kvmap: not recorded\n")  # what produced it: comment lines (a run made in a test)
    rows = list(csv.DictReader(x for x in io.StringIO(text) if not x.startswith("#")))
    assert len(rows) == 107 * len(r.phases)
    assert {x["phase"] for x in rows} == set(r.phases)
    assert sum(int(x["warmup"]) for x in rows) == r.warmup * len(r.phases)


def test_report_rejects_a_file_that_is_not_a_run(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"hello": 1}')
    res = runner.invoke(app, ["report", str(p)])
    assert res.exit_code == 2 and "not a kvmap run" in res.stderr


def test_device_times_are_rendered_when_present():
    import numpy as np
    from rich.console import Console

    from kvmap.render.report import render_summary, summary_dict

    r = replay(Trace(TRACE), ReplayConfig(nvtx=False))
    r.device = "cuda:0"
    r.device_phase_ns = np.full_like(r.phase_ns, 2000)  # as CUDA events would give, 2 us a phase
    console = Console(record=True, width=120)
    render_summary(r, console)
    text = console.export_text()
    assert "device time per measured step" in text and "CUDA events on cuda:0" in text
    assert summary_dict(r)["device_phases_p50_us"]["prepare_inputs"] == 2.0


def test_percentiles_are_numpys_bit_for_bit():
    import numpy as np

    from kvmap.run.stats import median, percentiles

    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 10, 101, 1919):
        x = rng.integers(0, 10**7, n) / 1e3
        assert percentiles(x, (50, 90, 99)) == [float(v) for v in np.percentile(x, [50, 90, 99])]
        assert median(x) == float(np.median(x))


def test_requests_measured_are_the_requests_scheduled_in_the_measured_steps():
    """From step 0 the count is the new requests (no per-step id list is kept); a later window counts the ids
    its steps schedule. Both equal a plain count over the decoded steps."""
    path = TRACES / "long_mixed.jsonl.gz"
    decoded = list(Trace(path).steps())
    for start, stop in ((0, None), (0, 300), (500, 900), (1800, None)):
        r = replay(Trace(path), ReplayConfig(start=start, stop=stop, warmup=2, write_kv=False, nvtx=False))
        measured = set(r.measured_steps().tolist())
        want = {rid for s in decoded if s.step in measured for rid in s.scheduled_req_ids()}
        assert r.requests_measured == len(want), (start, stop)


def test_each_steps_phases_lie_inside_its_span():
    """The per-step clock reads, differenced once at the end: every phase time is positive, a step's phases
    add up to at most the time until the next step starts."""
    r = replay(Trace(TRACES / "chunked_prefill.jsonl"), ReplayConfig(nvtx=False))
    assert r.phase_ns.shape == (len(r.steps), len(r.phases)) and (r.phase_ns > 0).all()
    starts = r.step_start_ns
    assert (starts[1:] - starts[:-1] >= r.phase_ns[:-1].sum(axis=1)).all() and starts[0] >= 0


def test_report_and_compare_refuse_an_edited_run_in_one_line(tmp_path):
    """A saved run edited by hand: a --runs median that is not a number, or a window that ends before it starts,
    is one line naming the field (report and compare), not a TypeError traceback or a nonsense window."""
    good = tmp_path / "good.json"
    assert runner.invoke(app, ["replay", str(TRACE), "--no-progress", "-q", "--runs", "2", "--json",
                               str(good)]).exit_code == 0
    d = json.loads(good.read_text())
    for field, value, message in (("runs_p50_us", [{"read_step": "1"}], "run 0 has a median that is not a finite"),
                                  ("runs_p50_us", [{"step": None}], "run 0 has a median that is not a finite"),
                                  ("step_window", [5, 2], "[5, 2] is not [start, stop > start or null]")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**d, "result": {**d["result"], field: value}}))
        for args in (["report", str(bad)], ["compare", str(good), str(bad)]):
            res = runner.invoke(app, args)
            assert res.exit_code == 2 and res.stderr.startswith(f"kvmap: error: {bad}, field {field}: {message}"), \
                res.output
            assert res.stderr.count("\n") == 1
