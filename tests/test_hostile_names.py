"""Hostile file names and request ids (Rich markup, control characters) through every command: never a
traceback, never a crash in markup. (How they are printed belongs to the renderers' own tests.)"""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app

from . import faults as F

runner = CliRunner()
HOSTILE_IDS = ["[bold red]x[/]", "[/]", "r\x1b[2J\x07\r", "a\nb", "é\u202etxt", "[link=file:///etc]y[/link]"]
HOSTILE_PATHS = ["runs[v2]/trace.jsonl", "a[/]b.jsonl", "[bold]/t.jsonl", "sp ace/[red].jsonl"]


def clean(args: list[str]):
    r = runner.invoke(app, args)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code in (0, 1, 2) and "Traceback" not in r.output, r.output
    return r


def rename_ids(obj, names: dict[str, str]):
    """Every request id (as a key or a string value) renamed throughout a step line."""
    if isinstance(obj, dict):
        return {names.get(k, k): rename_ids(v, names) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rename_ids(v, names) for v in obj]
    return names.get(obj, obj) if isinstance(obj, str) else obj


@pytest.mark.parametrize("rel", HOSTILE_PATHS)
def test_hostile_paths(tmp_path, rel):
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(F.TRACES / "worked_example.jsonl", path)
    bad = path.with_name(path.stem + "-bad.jsonl")
    L = F.load("worked_example.jsonl")
    F.so(L, 1)["total_num_scheduled_tokens"] += 1
    F.write(bad, L)
    for args in (["validate", str(path)], ["validate", str(bad)], ["replay", str(path), "-q"],
                 ["replay", str(bad), "-q"], ["explain", str(path), "--step", "1"],
                 ["replay", str(path), "-q", "--json", str(path)]):
        clean(args)
    assert clean(["replay", str(path), "-q", "--json", str(path)]).exit_code == 2


@pytest.mark.parametrize("rid", HOSTILE_IDS, ids=repr)
def test_hostile_request_ids(tmp_path, rid):
    L = F.load("worked_example.jsonl")
    first = F.so(L, 0)["scheduled_new_reqs"][0]["req_id"]
    L = [L[0]] + [rename_ids(x, {first: rid}) for x in L[1:]]
    good = F.write(tmp_path / "ids.jsonl", L)
    F.so(L, 1)["finished_req_ids"].append(rid)  # then scheduled after it finished: a problem naming it
    bad = F.write(tmp_path / "ids-bad.jsonl", L)
    assert clean(["validate", str(good)]).exit_code == 0
    assert clean(["validate", str(bad)]).exit_code == 1
    clean(["validate", str(bad), "--json", "-"])
    clean(["replay", str(bad), "-q"])
    clean(["replay", str(good), "-q", "--json", str(tmp_path / "o.json")])
    clean(["explain", str(good), "--step", "1", "--req", rid])
    clean(["explain", str(good), "--step", "1"])
    json.loads((tmp_path / "o.json").read_text())
