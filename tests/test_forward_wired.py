"""Items 2-4 of the forward pass wired into `replay --forward` (kvmap/forward/graph_parts.py): on every bundled
trace, both runners and three CUDA-graph configurations (eager; FULL_AND_PIECEWISE and FULL_DECODE_ONLY with
vLLM's default capture sizes), the host workers' dump (numpy forms) equals the reference's (scalar specs) bit
for bit; the bundled traces exercise each item (through the options: their headers predate the keys); a bug
planted in one numpy form is caught by `validate --deep`; `explain` shows the padded shape, the split and the
FlashInfer indices."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace

from .conftest import TRACES, read_lines, write_lines

SMALL = sorted(p.name for p in TRACES.glob("*.jsonl"))
BACKS = ("FLASHINFER", "FLASH_ATTN", "TRITON_ATTN")
# config -> (cudagraph mode, capture sizes, the backend of group g: BACKS[(g + shift) % 3])
CONFIGS = {"eager": ("NONE", None, 0), "full_and_piecewise": ("FULL_AND_PIECEWISE", "default", 0),
           "full_decode_only": ("FULL_DECODE_ONLY", "default", 1)}


def backends_of(name: str, shift: int) -> str:
    G = Trace(TRACES / name).header.num_groups
    return ",".join(f"{g}={BACKS[(g + shift) % 3]}" for g in range(G))


def dumps(name: str, runner: str, config: str, backend: str = "reference", attention: str | None = None) -> list[dict]:
    mode, sizes, shift = CONFIGS[config]
    got: list[dict] = []
    replay(Trace(TRACES / name), ReplayConfig(backend=backend, forward=True, batch_order=runner, nvtx=False, warmup=0,
                                              write_kv=False, attention_backend=attention or backends_of(name, shift),
                                              cudagraph_mode=mode, cudagraph_capture_sizes=sizes),
           on_mappings=got.append)
    return got


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("runner", ["mrv2", "v1"])
@pytest.mark.parametrize("name", SMALL)
def test_host_forms_equal_the_specs(name, runner, config):
    ref = dumps(name, runner, config)
    assert "num_tokens_padded" in ref[-1] and "num_decodes" in ref[-1]
    for backend in ("numpy", "numba", "torch"):
        if backend == "torch":
            pytest.importorskip("torch")
        got = dumps(name, runner, config, backend)
        for a, b in zip(got, ref):
            assert a == b, (backend, a["step"], [k for k in b if a.get(k) != b[k]])
        assert len(got) == len(ref)


@pytest.mark.parametrize("runner", ["mrv2", "v1"])
def test_numba_forms_without_a_backend_equal_the_specs(runner):
    """No group's backend named (split and backend metadata None): the numba worker's dump equals the
    reference's on FULL_AND_PIECEWISE steps, padded ones of both kinds among them."""
    modes: set = set()
    for name in SMALL:
        cfg = ReplayConfig(forward=True, batch_order=runner, nvtx=False, warmup=0, write_kv=False,
                           cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes="default")
        got: dict = {"reference": [], "numba": []}
        for b in got:
            replay(Trace(TRACES / name), replace(cfg, backend=b), on_mappings=got[b].append)
        assert got["numba"] == got["reference"], name
        modes |= {d["cudagraph_mode"] for d in got["numba"] if d["req_ids"]}
    assert {"FULL", "PIECEWISE"} <= modes  # padded steps of both kinds


@pytest.mark.parametrize("runner", ["mrv2", "v1"])
def test_every_attention_backends_rules_equal_the_spec(runner):
    """Every backend of kvmap's table (its reorder_batch_threshold and uniform rule) on two traces with a step
    that schedules nothing (worked_example's step 3) and with drafts: the numba and numpy dumps equal the
    reference's. FLASHMLA (128, uniform) and TRITON_MLA with drafts made the numba split read query_start_loc[1]
    of a step with no rows."""
    from kvmap.forward.attention import BACKENDS

    for name in ("worked_example.jsonl", "spec_decode.jsonl"):
        for attention in BACKENDS:
            ref = dumps(name, runner, "eager", attention=attention)
            for backend in ("numpy", "numba"):
                assert dumps(name, runner, "eager", backend, attention=attention) == ref, (name, attention, backend)


def test_long_trace_slice_equals_the_spec():
    got: dict = {}
    for b in ("reference", "numpy", "numba"):
        got[b] = []
        replay(Trace(TRACES / "long_mixed.jsonl.gz"),
               ReplayConfig(backend=b, forward=True, nvtx=False, warmup=0, write_kv=False, start=0, stop=200,
                            attention_backend="FLASHINFER", cudagraph_mode="FULL_AND_PIECEWISE",
                            cudagraph_capture_sizes="default"), on_mappings=got[b].append)
    assert got["numpy"] == got["reference"] == got["numba"] and len(got["numpy"]) == 200


# ------------------------------------------------------------------------------- what the traces exercise

def test_spec_decode_full_graphs_pad_request_rows():
    """spec_decode.jsonl under FULL_DECODE_ONLY (k = 3): uniform 4-token decodes run the decode graph, padded to
    the next capture size with num_reqs_padded = num_tokens_padded // 4 > num_reqs; FlashInfer's padded rows
    hold no pages."""
    for runner in ("mrv2", "v1"):
        d = dumps("spec_decode.jsonl", runner, "full_decode_only")
        padded = [x for x in d if x["cudagraph_mode"] == "FULL" and x["num_reqs_padded"] > len(x["req_ids"])]
        assert padded, runner
        x = padded[0]
        assert x["num_reqs_padded"] * 4 == x["num_tokens_padded"] > len(x["positions"])
        assert x["num_actual_tokens"] == x["num_tokens_padded"]  # FULL: the padded count
        d0 = dumps("spec_decode.jsonl", runner, "full_and_piecewise")
        fi = next(y for y in d0 if y["step"] == x["step"])
        ip = fi["paged_kv_indptr"][0]
        assert len(ip) == x["num_reqs_padded"] + 1 and ip[-1] == ip[len(x["req_ids"])]  # padded rows: no pages
        assert fi["paged_kv_last_page_len"][0][len(x["req_ids"]):] == [0] * (x["num_reqs_padded"] - len(x["req_ids"]))


def test_sliding_window_history_is_block_0_in_flashinfer_indices_under_mrv2():
    """hybrid_sliding_window.jsonl, the sliding group past its window: MRV2's gathered table holds block 0 below
    the window, so FlashInfer's paged_kv_indices do too; V1's hold only what the scheduler itself nulled (the
    sliding-window manager's freed blocks)."""
    h = Trace(TRACES / "hybrid_sliding_window.jsonl").header
    g = next(i for i, grp in enumerate(h.kv_cache_groups) if grp.kind == "sliding_window")
    zeros = {}
    for runner in ("mrv2", "v1"):
        d = dumps("hybrid_sliding_window.jsonl", runner, "eager", attention="FLASHINFER")
        zeros[runner] = sum(x["paged_kv_indices"][g].count(0) for x in d if x["paged_kv_indices"][g] is not None)
    assert zeros["mrv2"] > zeros["v1"]


def test_chunked_local_virtual_batches():
    """chunked_local.jsonl: the chunked_local group's metadata are its virtual batches (one row per chunk a query
    touches), the other groups have none."""
    h = Trace(TRACES / "chunked_local.jsonl").header
    local = [i for i, grp in enumerate(h.kv_cache_groups) if grp.kind == "chunked_local"]
    assert local
    d = dumps("chunked_local.jsonl", "mrv2", "eager")
    assert all(x["local_query_start_loc"][g] is not None for x in d if x["req_ids"] for g in local)
    assert any(len(x["local_seqused_k"][local[0]]) > len(x["req_ids"]) for x in d)  # a request split into chunks
    assert all(x["local_query_start_loc"][g] is None for x in d for g in range(h.num_groups) if g not in local)


def test_no_forward_dump_keeps_its_keys():
    from kvmap.workers.mappings import DUMP_KEYS

    got: list[dict] = []
    replay(Trace(TRACES / "spec_decode.jsonl"), ReplayConfig(nvtx=False, warmup=0, write_kv=False,
                                                             attention_backend="FLASHINFER"), on_mappings=got.append)
    assert all(set(x) <= set(DUMP_KEYS) for x in got)


# ------------------------------------------------------------------------------- validate --deep

def trace_with_keys(tmp_path, name: str = "spec_decode.jsonl", **keys):
    lines = read_lines(TRACES / name)
    lines[0].update(keys)
    lines[0]["cudagraph_mode"] = "FULL_AND_PIECEWISE"
    lines[0]["cudagraph_capture_sizes"] = [1, 2, 4, 8, 16, 24, 32]
    for grp in lines[0]["kv_cache_groups"]:
        grp["attention_backend"] = "FLASHINFER"
    p = tmp_path / name
    write_lines(p, lines)
    return Trace(p)


@pytest.mark.parametrize("module,name,field", [
    ("flashinfer", "build", "paged_kv_last_page_len"),
    ("attention", "split_decodes_and_prefills", "num_decodes"),
])
def test_deep_validate_catches_a_planted_bug(tmp_path, monkeypatch, module, name, field):
    from dataclasses import replace

    from kvmap.forward import graph_parts
    from kvmap.validate.deep import deep_check

    mod = {"flashinfer": graph_parts.FI, "attention": graph_parts.A}[module]
    right = getattr(mod, name)

    def wrong(*a, **kw):
        r = right(*a, **kw)
        if module == "flashinfer":  # one row's last page off by one
            last = r.paged_kv_last_page_len.copy()
            last[0] += 1
            return replace(r, paged_kv_last_page_len=last)
        return replace(r, num_decodes=r.num_decodes + 1)

    t = trace_with_keys(tmp_path)
    assert deep_check(t, ["numpy"])["backends"]["numpy"]["differing_steps"] == 0
    monkeypatch.setattr(mod, name, wrong)
    r = deep_check(t, ["numpy"])
    assert r["backends"]["numpy"]["differing_steps"] > 0
    assert next(p for p in r["problems"] if p["kind"] == "conformance")["field"] == field


def test_deep_validate_a_v1_trace_with_backends(tmp_path):
    """A V1 header naming FlashInfer: the reference and the backend both reorder V1's batch decode-first (the
    backends' reorder_batch_threshold), so they agree; the order differs from V1's without a threshold."""
    from kvmap.validate.deep import deep_check

    t = trace_with_keys(tmp_path, "async_decode.jsonl", runner="v1")
    assert deep_check(t, ["numpy"])["backends"]["numpy"]["differing_steps"] == 0
    plain, reordered = [], []
    replay(Trace(TRACES / "async_decode.jsonl"), ReplayConfig(batch_order="v1", nvtx=False, warmup=0,
                                                                 write_kv=False), on_mappings=plain.append)
    replay(t, ReplayConfig(batch_order="v1", nvtx=False, warmup=0, write_kv=False), on_mappings=reordered.append)
    assert [d["req_ids"] for d in plain] != [d["req_ids"] for d in reordered]


# ------------------------------------------------------------------------------- explain

def test_explain_shows_padding_split_and_flashinfer_indices():
    r = CliRunner().invoke(app, ["explain", str(TRACES / "spec_decode.jsonl"), "--step", "5", "--json",
                                 "--cudagraph-mode", "FULL_DECODE_ONLY", "--cudagraph-capture-sizes", "default",
                                 "--attention-backend", "FLASHINFER"])
    assert r.exit_code == 0, r.output
    f = json.loads(r.output)["forward"]
    p = f["padding"]
    # 5 requests of 1 + 3 tokens: 20 tokens, the decode graph of 24 = 6 * 4 tokens
    assert (p["cudagraph_mode"], p["num_tokens"], p["num_tokens_padded"], p["num_reqs_padded"]) == ("FULL", 20, 24, 6)
    assert any("24 // 4 = 6" in line for line in p["why"])
    s = f["split"][0]
    assert s["reorder_batch_threshold"] == 1 and (s["num_decodes"], s["num_prefills"]) == (0, 6)
    fi = f["flashinfer"][0]
    assert fi["paged_kv_indptr"] == [0, 5, 11, 13, 16, 19, 19]  # ceil(76/16)=5, ceil(83/16)=6, 2, 3, 3, padding 0
    assert fi["paged_kv_last_page_len"] == [76 - 4 * 16, 83 - 5 * 16, 27 - 16, 39 - 2 * 16, 34 - 2 * 16, 0]
    assert "paged_kv_indices[0:5] = block_table[0, :5]" in fi["rows"][0]
    text = CliRunner().invoke(app, ["explain", str(TRACES / "spec_decode.jsonl"), "--step", "5", "--runner", "v1",
                                    "--cudagraph-mode", "FULL_AND_PIECEWISE", "--cudagraph-capture-sizes", "default",
                                    "--attention-backend", "FLASHINFER"]).output
    assert "forward: padded shape: FULL" in text and "V1 uniform decode (shape only)" in text
    assert "forward: FlashInfer group 0 (page size 16)" in text
