"""validate knows the multi-rank rules: silent on the recorded multi-rank traces; names each planted fault at
its step, request and (for worker faults) DCP rank."""

from __future__ import annotations

import json

import pytest

from kvmap.errors import TraceError
from kvmap.trace import Trace
from kvmap.validate import validate

from .conftest import ROOT, TRACES

MULTI = ["dcp2", "dcp4_interleave8", "kernel_block_split", "vllm51031", "dcp2_mamba"]


@pytest.mark.parametrize("name", MULTI)
def test_silent_on_recorded_multirank_traces(name):
    r = validate(Trace(TRACES / f"{name}.jsonl"))
    assert r.valid, [p.message for p in r.problems[:3]]


def _lines(name):
    return [json.loads(x) for x in (TRACES / f"{name}.jsonl").read_text().splitlines()]


def _write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


@pytest.mark.parametrize("edit,message", [
    (lambda h: h.update(cp_kv_cache_interleave_size=3), "must divide the block_size"),
    (lambda h: h["kv_cache_groups"][0].update(kernel_block_size=24), "must divide the group's block_size"),
])
def test_header_rules(tmp_path, edit, message):
    lines = _lines("vllm51031")
    edit(lines[0])
    with pytest.raises(TraceError, match=message):
        Trace(_write(tmp_path, lines))


def test_dcp_trace_read_as_single_rank_has_no_blocks(tmp_path):
    """Rows in scheduler blocks of block_size * cp: without the DCP key the same rows are too short."""
    lines = _lines("dcp2")
    del lines[0]["decode_context_parallel_size"]
    r = validate(Trace(_write(tmp_path, lines)))
    p = next(p for p in r.problems if p.kind == "no_block")
    assert p.step is not None and p.req_id is not None and p.group == 0


def test_row_wider_than_max_num_blocks(tmp_path):
    lines = _lines("dcp2")
    nr = lines[1]["scheduler_output"]["scheduled_new_reqs"][0]
    width = -(-lines[0]["max_model_len"] // (16 * 2))
    nr["block_ids"][0] = nr["block_ids"][0] + list(range(40, 40 + width + 1 - len(nr["block_ids"][0])))
    r = validate(Trace(_write(tmp_path, lines)))
    p = next(p for p in r.problems if p.kind == "row_width")
    assert (p.step, p.req_id, p.group) == (0, nr["req_id"], 0) and "block_size * cp" in p.message


BUG = str(ROOT / "tests" / "backends" / "vllm51031_backend.py") + ":VirtualBlockFromKernelSize"


def test_planted_vllm51031_mistake_named_at_step_request_and_rank():
    r = validate(Trace(TRACES / "vllm51031.jsonl"), deep=True, backends=[BUG])
    conf = [p for p in r.problems if p.kind == "conformance"]
    assert conf and conf[0].req_id is not None and conf[0].step is not None
    assert "on DCP rank" in conf[0].message and conf[0].field == "slot_mapping"
    assert any(p.kind == "kv_mismatch" and "on DCP rank" in p.message for p in r.problems)


def test_cross_rank_invariant_named(tmp_path):
    plug = tmp_path / "two_owners.py"
    plug.write_text(
        "from kvmap.workers.host import NumpyWorker\n"
        "class TwoOwners(NumpyWorker):\n"
        "    name = 'two-owners'\n"
        "    def compute_slot_mappings(self):\n"
        "        super().compute_slot_mappings()\n"
        "        T = self.batch.num_tokens\n"
        "        if self.current_step == 2 and T:\n"
        "            m = self.buffers.rank_slot_mapping\n"
        "            m[1, 0, :T] = abs(m[0, 0, :T]) + 1\n")
    r = validate(Trace(TRACES / "dcp2.jsonl"), deep=True, backends=[f"{plug}:TwoOwners"])
    p = next(p for p in r.problems if p.kind == "cross_rank")
    assert p.step == 2 and p.req_id is not None and "local on DCP ranks" in p.message
