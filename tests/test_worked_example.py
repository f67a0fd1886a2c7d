"""The explainer's worked example, step 1: B (row 7, 31 computed, blocks [37, 12]) decodes 1 token, A (row 6,
16 computed, blocks [81, 44]) computes 8. Model Runner V2 sorts the batch by scheduled tokens, so B is batch
row 0 (the explainer's "B is batch row 2" contradicts its own query_start_loc [0, 1, 9])."""

from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace

from .conftest import TRACES


def _step(path, backend, n):
    dumps = []
    replay(Trace(path), ReplayConfig(backend=backend, stop=n + 1, nvtx=False, warmup=0), on_mappings=dumps.append)
    return dumps[n]


def test_step_1_matches_the_explainer(worked_example):
    for backend in ("numpy", "reference"):
        m = _step(worked_example, backend, 1)
        assert m["req_ids"] == ["B", "A"]
        assert m["idx_mapping"] == [7, 6]  # B added first: rows are popped from the end of 0..7
        assert m["query_start_loc"] == [0, 1, 9]
        assert m["seq_lens"] == [31 + 1, 16 + 8]
        assert m["positions"] == [31] + list(range(16, 24))
        assert m["block_tables"] == [[[37, 12], [81, 44]]]
        # B's token: block 31 // 16 = 1 -> 12, offset 31 % 16 = 15; A's: block 1 -> 44, offsets 0..7
        assert m["slot_mapping"] == [[12 * 16 + 15] + [44 * 16 + o for o in range(8)]]
        assert m["input_ids"] == [2031] + [1000 + p for p in range(16, 24)]


def test_step_2_needs_a_third_block_for_b(worked_example):
    m = _step(worked_example, "numpy", 2)
    assert m["req_ids"] == ["B", "A"]  # 1 and 1 token: the stable sort keeps scheduler order
    assert m["positions"] == [32, 24]
    assert m["slot_mapping"] == [[5 * 16 + 0, 44 * 16 + 8]]
    assert m["input_ids"] == [2032, 1024]  # the tokens sampled in step 1


def test_verify_kv_reads_back_every_position(worked_example):
    r = replay(Trace(worked_example), ReplayConfig(verify_kv=True, nvtx=False))
    assert r.kv_mismatches == 0
    # step 0: 16 + 31, step 1: 32 + 24, step 2: 33 + 25 readable positions
    assert r.kv_checked == (16 + 31) + (32 + 24) + (33 + 25)


def test_a_trace_without_sampled_tokens_uses_stand_ins_and_says_so(tmp_path):
    """docs/trace-format.md: without sampled_token_ids decode input ids are unknown; the replay must say so and use
    stand-in ids (here 0), never pretend they are real. Positions and slots do not depend on them."""
    import json

    from typer.testing import CliRunner

    from kvmap.cli.app import app

    from .conftest import read_lines, write_lines

    lines = read_lines(TRACES / "worked_example.jsonl")
    for d in lines[1:]:
        d.pop("sampled_token_ids")
    path = write_lines(tmp_path / "nosamples.jsonl", lines)
    for backend in ("numpy", "reference"):
        dumps = []
        r = replay(Trace(path), ReplayConfig(backend=backend, verify_kv=backend == "numpy", nvtx=False),
                   on_mappings=dumps.append)
        assert r.standin_tokens == 1 + 2  # B at position 31 in step 1; B at 32 and A at 24 in step 2
        assert dumps[1]["input_ids"][0] == 0 and dumps[1]["slot_mapping"] == [[207] + list(range(704, 712))]
        assert dumps[2]["input_ids"] == [0, 0]
    res = CliRunner().invoke(app, ["replay", str(path), "--no-progress"])
    assert res.exit_code == 0 and "3 input ids are stand-ins" in res.stdout
    json.dumps(dumps)
