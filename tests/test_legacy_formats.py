"""Older vLLM field forms load unchanged: `resumed_from_preemption` (list of bools, before #27756),
`resumed_req_token_ids` (list aligned with req_ids), `block_ids` as one flat list for a single group (before
#17945), `num_common_prefix_blocks` as one integer. A form that cannot be converted is a located error."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvmap.cli.app import app
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace

from .conftest import TRACES, write_lines

runner = CliRunner()


def legacy(lines: list[dict]) -> list[dict]:
    out = [lines[0]]
    for d in lines[1:]:
        d = json.loads(json.dumps(d))
        so = d["scheduler_output"]
        c = so["scheduled_cached_reqs"]
        resumed = set(c.pop("resumed_req_ids"))
        c["resumed_from_preemption"] = [r in resumed for r in c["req_ids"]]
        all_tok = c.pop("all_token_ids")
        c["resumed_req_token_ids"] = [all_tok.get(r) for r in c["req_ids"]]
        c["new_block_ids"] = [None if b is None else b[0] for b in c["new_block_ids"]]
        for nr in so["scheduled_new_reqs"]:
            nr["block_ids"] = nr["block_ids"][0]
        so["num_common_prefix_blocks"] = 0
        out.append(d)
    return out


def test_legacy_forms_replay_identically(tmp_path):
    lines = [json.loads(x) for x in (TRACES / "preemption_v1.jsonl").read_text().splitlines()]
    old = write_lines(tmp_path / "old.jsonl", legacy(lines))
    assert "resumed_from_preemption" in old.read_text()
    a, b = [], []
    replay(Trace(TRACES / "preemption_v1.jsonl"), ReplayConfig(write_kv=False, nvtx=False), on_mappings=a.append)
    r = replay(Trace(old), ReplayConfig(verify_kv=True, nvtx=False), on_mappings=b.append)
    assert a == b and r.kv_mismatches == 0
    assert runner.invoke(app, ["validate", str(old)]).exit_code == 0


def test_unconvertible_legacy_form_is_a_located_error(tmp_path):
    lines = legacy([json.loads(x) for x in (TRACES / "preemption_v1.jsonl").read_text().splitlines()])
    lines[5]["scheduler_output"]["scheduled_cached_reqs"]["resumed_from_preemption"] = [True]
    path = write_lines(tmp_path / "bad.jsonl", lines)
    res = runner.invoke(app, ["replay", str(path)])
    assert res.exit_code == 2
    assert f"{path}:6, step 4, field scheduled_cached_reqs.resumed_from_preemption: expected" in res.stderr
