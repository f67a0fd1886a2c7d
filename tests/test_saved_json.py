"""A saved run written piece by piece (jsontext.py, files.write_json): the very bytes `json.dumps(doc, indent=1)`
and a newline make of the whole document as lists, for every array a run fills, in chunks of any size; and
`kvmap report` reads the streamed file back."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest
from typer.testing import CliRunner

from kvmap import jsontext
from kvmap.cli.app import app
from kvmap.files import write_json
from kvmap.render import report
from kvmap.render.report import summary_dict, to_chrome_trace
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.run.result import PHASES, ReplayResult
from kvmap.trace import Trace

from .conftest import TRACES

runner = CliRunner()


def _whole(doc: object) -> bytes:
    """What `json.dump(doc, f, indent=1)` and a newline wrote before streaming: the reference."""
    return (json.dumps(doc, indent=1) + "\n").encode()


def _written(tmp_path, doc: object) -> bytes:
    out = tmp_path / "out.json"
    write_json(out, doc)
    return out.read_bytes()


def _runs() -> dict[str, ReplayResult]:
    """Runs that fill every per-step array between them (series on: kv_series, mix_series; warm-up steps replayed
    first and recorded before the window; the KV check; several DCP ranks; device times by hand) and one with no
    steps at all."""
    runs = {
        "worked_example": replay(Trace(TRACES / "worked_example.jsonl"), ReplayConfig(nvtx=False)),
        "preemption_v1 3 prewarmed": replay(Trace(TRACES / "preemption_v1.jsonl"),
                                                ReplayConfig(nvtx=False, warmup=3, verify_kv=True)),
        "long_mixed 100:400 warmup 5": replay(Trace(TRACES / "long_mixed.jsonl.gz"),
                                              ReplayConfig(nvtx=False, start=100, stop=400, warmup=5)),
        "dcp2 both ranks": replay(Trace(TRACES / "dcp2.jsonl"), ReplayConfig(nvtx=False)),
    }
    dev = replay(Trace(TRACES / "spec_decode.jsonl"), ReplayConfig(nvtx=False))
    dev.device = "cuda:0"
    dev.device_phase_ns = np.arange(dev.phase_ns.size, dtype=np.int64).reshape(dev.phase_ns.shape) * 997 + 2**40
    runs["spec_decode with device times"] = dev
    runs["no steps"] = ReplayResult(trace="t", backend="numpy", protocol="v1", groups=[], phases=list(PHASES),
                                    kv_columns=["live"], kv_series=np.zeros((0, 1), np.int32),
                                    mix_columns=["new"], mix_series=np.zeros((0, 1), np.int64))
    return runs


RUNS = _runs()


@pytest.mark.parametrize("chunk", [jsontext.CHUNK, 3, 1])
@pytest.mark.parametrize("name", list(RUNS))
def test_a_saved_run_is_the_same_bytes_as_the_whole_document(tmp_path, monkeypatch, name, chunk):
    r = RUNS[name]
    if name != "no steps":
        assert len(r.steps) and r.kv_series.shape == (len(r.steps), len(r.kv_columns)) and r.mix_series.size
        assert len(r.step_start_ns) == len(r.steps)
    monkeypatch.setattr(jsontext, "CHUNK", chunk)
    monkeypatch.setattr(report, "CHROME_STEPS", chunk)
    summary = summary_dict(r) if len(r.steps) else {"steps": 0}
    want = _whole({"summary": summary, "result": r.to_json()})
    assert _written(tmp_path, {"summary": summary, "result": r.json_fields()}) == want
    assert _written(tmp_path, r.json_fields()) == _whole(r.to_json())
    assert _written(tmp_path, to_chrome_trace(r, stream=True)) == _whole(to_chrome_trace(r))


def test_device_times_and_warmup_reach_the_file():
    """The runs above hold what they claim: the byte test is not over empty arrays."""
    dev = RUNS["spec_decode with device times"]
    assert dev.device_phase_ns.shape == dev.phase_ns.shape and dev.device_phase_ns.max() > 2**40
    assert RUNS["preemption_v1 3 prewarmed"].prewarm_steps == 3 and RUNS["long_mixed 100:400 warmup 5"].warmup == 5
    assert RUNS["dcp2 both ranks"].ranks == [0, 1]
    assert RUNS["no steps"].to_json()["phase_ns"] == [] and RUNS["no steps"].to_json()["kv_series"] == []


@pytest.mark.parametrize("value", [
    np.zeros((3, 0), np.int64),  # rows of no values: [] each
    np.arange(2 * 3 * 4, dtype=np.int16).reshape(2, 3, 4) - 7,  # three dimensions, negatives
    np.array([2**63 - 1, 0], np.uint64),
    np.array([[True, False]]),
    np.array([0.1, float("nan"), float("inf"), -0.0]),  # not an integer array: json's own text
    np.array(5, np.int32),  # a 0-d array
    np.zeros(0, np.int32),
])
@pytest.mark.parametrize("chunk", [4096, 2, 1])
def test_arrays_of_every_shape_are_tolists_text(tmp_path, monkeypatch, value, chunk):
    monkeypatch.setattr(jsontext, "CHUNK", chunk)
    doc = {"a": 1, "deep": {"x": {"arr": value, "n": None}, "k": [1, {"z": "\u00e9\n"}]}, "empty": {}, "list": []}
    plain = {"a": 1, "deep": {"x": {"arr": value.tolist(), "n": None}, "k": [1, {"z": "\u00e9\n"}]}, "empty": {},
             "list": []}
    assert _written(tmp_path, doc) == _whole(plain)
    assert _written(tmp_path, value) == _whole(value.tolist())  # at the top level too


@pytest.mark.parametrize("parts", [[], [[]], [[], [1], [], [{"a": [1, 2]}, "s"]], [[{"b": {}}]] * 5])
def test_a_stream_is_the_list_of_its_parts_items(tmp_path, parts):
    whole = [x for p in parts for x in p]
    assert _written(tmp_path, {"k": jsontext.Stream(iter(parts)), "t": 2}) == _whole({"k": whole, "t": 2})
    assert _written(tmp_path, jsontext.Stream(parts)) == _whole(whole)


def test_a_document_without_arrays_is_jsons_own_text(tmp_path):
    doc = OrderedDict([("b", {1: 2.5, None: [True]}), ("a", [[], {}, 1e300])])  # keys json turns into strings
    assert _written(tmp_path, doc) == _whole(doc)


def test_report_reads_a_streamed_run_back(tmp_path):
    """replay --json (streamed) -> the file is json's indent-1 text of itself, loads back to the same arrays,
    and `kvmap report` re-renders the summary replay printed."""
    trace = TRACES / "preemption_v1.jsonl"
    saved = tmp_path / "run.json"
    res = runner.invoke(app, ["replay", str(trace), "--json", str(saved), "--no-progress", "--warmup", "2"])
    assert res.exit_code == 0, res.output
    text = saved.read_text()
    d = json.loads(text)
    assert json.dumps(d, indent=1) + "\n" == text
    back = ReplayResult.from_json(d["result"])
    again = replay(Trace(trace), ReplayConfig(nvtx=False, warmup=2))
    for k in ("steps", "num_reqs", "num_tokens", "kv_series", "mix_series"):
        assert getattr(back, k).tolist() == getattr(again, k).tolist(), k
    assert back.phase_ns.shape == again.phase_ns.shape and len(back.step_start_ns) == len(back.steps) == 107
    shown = runner.invoke(app, ["report", str(saved)])
    assert shown.exit_code == 0, shown.output
    assert "".join(shown.stdout.splitlines(keepends=True)[2:]) == res.stdout
