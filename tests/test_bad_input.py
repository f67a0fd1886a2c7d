"""Every malformed input gets one located line on stderr, exit code 2, no traceback, no half-written file."""

from __future__ import annotations

import copy
import gzip
import json

import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app

from .conftest import read_lines, write_lines

runner = CliRunner()


def run(*args):
    res = runner.invoke(app, list(map(str, args)))
    return res.exit_code, res.stdout, res.stderr


def mutate(lines, fn):
    lines = copy.deepcopy(lines)
    fn(lines)
    return lines


def so(lines, i):
    return lines[i + 1]["scheduler_output"]


def _unknown(L):
    s = so(L, 1)
    s["scheduled_cached_reqs"]["req_ids"][0] = "Z"
    s["num_scheduled_tokens"] = {"Z": 1, "A": 8}
    L[2]["sampled_token_ids"] = {"Z": [5], "A": [1024]}


def _drop_a(L):
    s = so(L, 1)
    del s["num_scheduled_tokens"]["A"]
    s["total_num_scheduled_tokens"] = 1


def _past_known(L):
    so(L, 2)["num_scheduled_tokens"]["A"] = 2
    so(L, 2)["total_num_scheduled_tokens"] = 3


def _continuation_drops_a_block(L):  # B, live, sent again as new (a streaming-input continuation) without block 12
    s = so(L, 1)
    s["scheduled_new_reqs"].append(copy.deepcopy(so(L, 0)["scheduled_new_reqs"][0]))
    s["scheduled_new_reqs"][-1]["block_ids"] = [[37]]
    s["scheduled_cached_reqs"] = {"req_ids": ["A"], "resumed_req_ids": [], "new_block_ids": [[[44]]],
                                  "num_computed_tokens": [16], "all_token_ids": {}}
    s["num_scheduled_tokens"] = {"A": 8, "B": 1}


CASES = {
    # name: (mutation, expected fragment of the one-line message)
    "header missing": (lambda L: L.pop(0), "line 1"),
    "wrong format": (lambda L: L[0].update(format="other/9"), "field format"),
    "bad protocol": (lambda L: L[0].update(model_runner_protocol="v3"), "field model_runner_protocol"),
    "header missing key": (lambda L: L[0].pop("max_model_len"), "field max_model_len"),
    "step not consecutive": (lambda L: L[2].update(step=5), "expected step 1, got 5"),
    "wrong type": (lambda L: so(L, 1)["scheduled_cached_reqs"].update(num_computed_tokens=["31", 16]),
                   "request 'B', field scheduled_cached_reqs.num_computed_tokens"),
    "unknown request": (_unknown, "step 1, request 'Z', field scheduled_cached_reqs.req_ids: unknown request"),
    "block out of range": (lambda L: so(L, 1)["scheduled_cached_reqs"]["new_block_ids"].__setitem__(1, [[96]]),
                           "block id 96 at entry 0 is outside [0, 96)"),
    "negative block": (lambda L: so(L, 0)["scheduled_new_reqs"][0].update(block_ids=[[37, -1]]),
                       "request 'B', group 0, field block_ids"),
    "total does not add up": (lambda L: so(L, 1).update(total_num_scheduled_tokens=10),
                              "num_scheduled_tokens adds up to 9"),
    "scheduled but not in nst": (_drop_a, "request 'A', field num_scheduled_tokens"),
    "position without block": (lambda L: so(L, 1)["scheduled_cached_reqs"]["new_block_ids"].__setitem__(1, None),
                               "position 23 has no block"),
    "past known tokens": (_past_known, "step 2, request 'A', field num_scheduled_tokens: positions 25..25 are "
                                       "past the request's 25 known tokens"),
    "token id not int": (lambda L: so(L, 0)["scheduled_new_reqs"][1]["prompt_token_ids"].__setitem__(3, 1.5),
                         "request 'A', field prompt_token_ids: entry 3 is float"),
    "continuation drops a block": (_continuation_drops_a_block,
                                   "request 'B', group 0, field block_ids: 1 blocks drop the 2 the request held"),
    "group count": (lambda L: so(L, 0)["scheduled_new_reqs"][0].update(block_ids=[[37], [12]]),
                    "declares 1 KV cache groups"),
    "kernel block size": (lambda L: L[0]["kv_cache_groups"][0].update(kernel_block_size=5), "must divide"),
    "interleave": (lambda L: L[0].update(decode_context_parallel_size=2, cp_kv_cache_interleave_size=5),
                   "must divide the block_size"),
    "integer past 64 bits": (lambda L: so(L, 1)["scheduled_cached_reqs"].update(num_computed_tokens=[2 ** 70, 16]),
                             "request 'B', field scheduled_cached_reqs.num_computed_tokens: expected an integer, got "
                             "a number past 64-bit integers (1.181e+21)"),
    "token id past 64 bits": (lambda L: so(L, 0)["scheduled_new_reqs"][1]["prompt_token_ids"].__setitem__(3, 10 ** 23),
                              "field prompt_token_ids: entry 3 is a number past 64-bit integers (1e+23)"),
    "kv_cache_spec heads": (lambda L: L[0].update(kv_cache_spec={"num_kv_heads": 0, "head_size": 8}),
                            "field kv_cache_spec.num_kv_heads: must be >= 1, got 0"),
    "kv_cache_spec dtype": (lambda L: L[0].update(kv_cache_spec={"dtype": 16}),
                            "field kv_cache_spec.dtype: expected a string, got int"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_trace(tmp_path, worked_example, name):
    fn, fragment = CASES[name]
    path = write_lines(tmp_path / "bad.jsonl", mutate(read_lines(worked_example), fn))
    dump = tmp_path / "dump.jsonl"
    code, stdout, stderr = run("replay", path, "--dump-mappings", dump, "--json", tmp_path / "r.json")
    assert code == 2, (stdout, stderr)
    assert "Traceback" not in stderr + stdout
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert len(lines) == 1, stderr
    assert str(path) in lines[0] and fragment in lines[0], lines[0]
    assert not dump.exists() and not (tmp_path / "r.json").exists()
    assert not list(tmp_path.glob(".*tmp"))  # nothing half-written


def test_not_json(tmp_path, worked_example):
    raw = worked_example.read_text().splitlines()
    raw[2] = raw[2][:40]  # truncated line 3 (step 1)
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(raw) + "\n")
    code, _, stderr = run("replay", path)
    assert code == 2 and f"{path}:3, step 1: truncated line" in stderr
    raw[2] = "{not json at all}"
    path.write_text("\n".join(raw) + "\n")
    code, _, stderr = run("replay", path)
    assert code == 2 and "not valid JSON" in stderr


@pytest.mark.parametrize("content", [b"", b"\x00\x01\x02binary", b"hello world\n", b"[1, 2, 3]\n",
                                     b"\x1f\x8b\x08garbage-gzip"])
def test_not_a_trace(tmp_path, content):
    path = tmp_path / "x.jsonl"
    path.write_bytes(content)
    code, stdout, stderr = run("replay", path)
    assert code == 2 and "Traceback" not in stderr and str(path) in stderr, stderr


def test_gzip_reads_like_plain(tmp_path, worked_example):
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(worked_example.read_bytes()))
    d1, d2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert run("replay", worked_example, "--dump-mappings", d1)[0] == 0
    assert run("replay", gz, "--dump-mappings", d2)[0] == 0
    assert d1.read_text() == d2.read_text()


def test_usage_errors(worked_example):
    assert run("replay", worked_example, "--steps", "5:2")[0] == 2
    code, _, stderr = run("replay", worked_example, "--backend", "gpu9")
    assert code == 2 and "unknown backend" in stderr
    code, _, stderr = run("replay", worked_example, "--kv-dtype", "int3")
    assert code == 2 and "--kv-dtype" in stderr


def test_steps_window_and_json(tmp_path, worked_example):
    j = tmp_path / "r.json"
    dump = tmp_path / "d.jsonl"
    code, stdout, _ = run("replay", worked_example, "--steps", "1:3", "--json", j, "--dump-mappings", dump,
                          "--warmup", "0")
    assert code == 0, stdout
    d = json.loads(j.read_text())
    assert d["result"]["steps"] == [1, 2]
    assert [json.loads(x)["step"] for x in dump.read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_sampled_tokens_past_max_model_len(tmp_path, worked_example, backend):
    """The last step's sampled token would be token max_model_len + 1: named, and nothing is appended."""
    from kvmap.errors import TraceError
    from kvmap.run.config import ReplayConfig
    from kvmap.run.replay import replay
    from kvmap.trace import Trace

    lines = read_lines(worked_example)
    longest = 0
    for step in lines[1:]:  # the longest request after its last step: computed + scheduled + 1 sampled
        c = step["scheduler_output"]["scheduled_cached_reqs"]
        for r, nc in zip(c["req_ids"], c["num_computed_tokens"]):
            longest = max(longest, nc + step["scheduler_output"]["num_scheduled_tokens"][r] + 1)
    lines[0]["max_model_len"] = longest - 1
    path = write_lines(tmp_path / "short.jsonl", lines)
    with pytest.raises(TraceError) as e:
        replay(Trace(path), ReplayConfig(backend=backend, nvtx=False, write_kv=False))
    assert "field sampled_token_ids: sampled tokens overflow max_model_len" in str(e.value), e.value
