"""`kvmap explain` walks the explainer's chain on a real step and says clearly what does not exist."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app

from .conftest import TRACES

runner = CliRunner()


def explain(*args):
    res = runner.invoke(app, ["explain", *map(str, args)])
    return res.exit_code, res.stdout, res.stderr


def test_worked_example_token_chain_json():
    code, out, _ = explain(TRACES / "worked_example.jsonl", "--step", 1, "--req", "B", "--token", 0, "--json")
    assert code == 0
    d = json.loads(out)
    assert d["idx_mapping"] == [7, 6] and d["query_start_loc"] == [0, 1, 9] and d["seq_lens"] == [32, 24]
    t = d["token"]
    assert t["position"] == 31 and t["flat_token_index"] == 0
    g = t["groups"][0]
    assert (g["logical_block"], g["offset"], g["block"]) == (31 // 16, 31 % 16, 12)
    assert g["slot"] == 12 * 16 + 15 == 207
    assert "batch 0 -> row 7 (idx_mapping[0] = 7)" in t["links"]
    assert g["links"][:3] == ["position 31 -> block 31 // 16 = 1, offset 31 % 16 = 15", "block_table[7][1] = 12",
                              "slot 12 * 16 + 15 = 207"]
    # bytes: [2, 96 blocks, 16, 1 head, 8] bfloat16 -> 16 bytes per slot and half
    assert "K at 3312..3327" in g["links"][3] and 207 * 16 == 3312


def test_worked_example_rendered():
    code, out, _ = explain("--step", 1, "--req", "B", "--token", 0)
    assert code == 0
    assert "slot 12 * 16 + 15 = 207" in out and "idx_mapping[0] = 7" in out


def test_flat_token_without_req():
    code, out, _ = explain(TRACES / "worked_example.jsonl", "--step", 1, "--token", 3, "--json")
    t = json.loads(out)["token"]
    assert t["position"] == 16 + 2 and t["groups"][0]["slot"] == 44 * 16 + 2


def test_hybrid_shows_null_and_out_of_window_blocks():
    code, out, _ = explain(TRACES / "hybrid_sliding_window.jsonl", "--step", 30, "--req", "long-b", "--json")
    assert code == 0
    req = json.loads(out)["request"]
    sw = req["block_tables"][1]
    assert sw["kind"] == "sliding_window"
    states = [e["state"] for e in sw["entries"]]
    assert states[:2] == ["null", "null"]  # prefix hit: positions 0..31 fell out of the window
    # Model Runner V2 nulls the forward-pass row below the window: max(123 - (32 - 1), 0) // 16 = 5 entries
    nulled = "out of window (block 0 in the forward-pass table: Model Runner V2 nulls it)"
    assert states[2:5] == [nulled] * 3 and states[5] == "read"
    assert sw["null_history_blocks"] == (123 - (32 - 1)) // 16
    assert all(e["state"] != "null" for e in req["block_tables"][0]["entries"])
    assert "null_history_blocks" not in req["block_tables"][0]
    code, text, _ = explain(TRACES / "hybrid_sliding_window.jsonl", "--step", 30, "--req", "long-b")
    assert "[0]null [1]null [2]9~0 [3]10~0 [4]24~0 [5]25 " in text
    assert "max(123 - R, 0) // 16 = 5, R = 32 - 1 + 0 = 31" in text


@pytest.mark.parametrize("args, fragment", [
    (["--step", 9], "step 9 does not exist: the trace has steps 0..3"),
    (["--step", 1, "--req", "Z"], "request 'Z' does not exist at step 1; scheduled: B, A"),
    (["--step", 1, "--req", "B", "--token", 1], "token 1 does not exist: request 'B' has 1 token in step 1 (0..0)"),
    (["--step", 1, "--token", 9], "step 1 has flat tokens 0..8"),
    (["--step", 1, "--group", 2], "group 2 does not exist: the trace has groups 0..0"),
    (["--step", 3, "--req", "A"], "request 'A' does not exist at step 3; scheduled: none"),
])
def test_unknown_things_list_what_exists(args, fragment):
    code, out, err = explain(TRACES / "worked_example.jsonl", *args)
    assert code == 2 and "Traceback" not in out + err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and fragment in lines[0], err


@pytest.mark.parametrize("trace", ["vllm51031", "dcp2_mamba", "dcp4_interleave8"])
def test_multirank_token_chain_json_is_plain_json(trace):
    """A token's per-rank chain (`holds`, `slot`) is plain JSON, not numpy scalars (was a TypeError traceback)."""
    code, out, _ = explain(trace, "--step", 5, "--req", "req-0" if trace == "dcp4_interleave8" else "a",
                           "--token", 0, "--json")
    assert code == 0, out
    ranks = json.loads(out)["token"]["groups"][0]["ranks"]
    assert sum(r["holds"] for r in ranks) == 1


def test_req_without_step_explains_its_first_scheduled_step():
    trace = TRACES / "hybrid_sliding_window.jsonl"
    code, out, _ = explain(trace, "--req", "long-b", "--json")
    assert code == 0
    step = json.loads(out)["step"]
    code, out, _ = explain(trace, "--step", step - 1, "--req", "long-b")
    assert code == 2  # not scheduled the step before: that was its first
    code, out, err = explain(trace, "--req", "nobody")
    assert code == 2 and "request 'nobody' is never scheduled" in err


def test_request_ranges_are_half_open_alike():
    """`--json`: a request's flat tokens and positions are both [start, end), like query_start_loc; the text
    shows both inclusive (A at step 1: 8 tokens from flat index 1, positions 16..23)."""
    code, out, _ = explain(TRACES / "worked_example.jsonl", "--step", 1, "--req", "A", "--json")
    req = json.loads(out)["request"]
    assert req["tokens"] == [1, 1 + 8] and req["positions"] == [16, 16 + 8]
    code, text, _ = explain(TRACES / "worked_example.jsonl", "--step", 1, "--req", "A")
    assert "flat tokens 1..8, positions 16..23" in text


def test_short_traces_default_to_a_step_they_have(tmp_path):
    """Without --step: step 1, or step 0 in a one-step trace; a header alone is one line that says so (no
    option blamed, no `0..-1`)."""
    lines = (TRACES / "worked_example.jsonl").read_text().splitlines(keepends=True)
    one, header = tmp_path / "one.jsonl", tmp_path / "header.jsonl"
    one.write_text("".join(lines[:2]))
    header.write_text(lines[0])
    code, out, _ = explain(one, "--json")
    assert code == 0 and json.loads(out)["step"] == 0
    code, out, err = explain(header)
    assert code == 2 and err.strip() == f"kvmap: error: {header}: the trace has no steps (a header and nothing " \
                                         "after it): nothing to explain"
