"""The forward-pass parts the vLLM backends take from vLLM's own code: the sampler part (vLLM's, with kvmap's
dtypes), the graph choice (V1's `_determine_batch_execution_and_padding`, MRV2's `dispatch_cg_and_sync_dp`), the
attention and FlashInfer metadata; each against the reference, and a planted break in each is seen at its first
step. The vLLM tests run in CI's vLLM environments and skip elsewhere."""

from __future__ import annotations

import importlib.util

import pytest

from kvmap.forward import cudagraph as cg
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace
from kvmap.validate import validate

from .conftest import ROOT, TRACES, read_lines, write_lines
from .vllm_backends_helpers import GPU, dumps, needs_mrv2, needs_v1


def sampler_checked(backend: str, trace: Trace, order: str, seen: list):
    """A `backend` worker whose every step's sampler part is held to kvmap's numpy form (values and dtypes) and,
    on a non-empty step, is the object vLLM's input preparation gave (`ops.sampler()`), appended to `seen`."""
    from kvmap.forward import sampler as S
    from kvmap.workers.registry import make_worker

    from .test_forward_sampler import same

    worker = make_worker(backend, trace.header, "cuda" if GPU else "cpu", order)
    own_forward, own_sampler, given = worker.prepare_forward, worker.ops.sampler, []

    def sampler():
        given.append(own_sampler())
        return given[-1]

    def prepare_forward():
        given.clear()
        own_forward()
        rows, got, k = worker.forward_step().rows, worker.forward.sampler, trace.header.num_speculative_tokens
        buf = S.SamplerBuffers(trace.header.max_num_seqs, k, max(len(rows.input_ids), 1))
        same(got, S.mrv2_numpy(rows, buf) if order == "mrv2" else S.v1_numpy(rows, k, buf))
        if len(rows.idx_mapping):
            assert given and got is given[0] and "sampler" in worker.native_forward_parts
            seen.append(got)

    worker.ops.sampler, worker.prepare_forward = sampler, prepare_forward
    return worker


@needs_mrv2
def test_mrv2_sampler_part_is_vllms_with_kvmaps_dtypes():
    seen: list = []
    for name in ("spec_decode", "chunked_prefill"):
        trace = Trace(TRACES / f"{name}.jsonl")
        dumps(trace, "vllm-mrv2", forward=True, worker=sampler_checked("vllm-mrv2", trace, "mrv2", seen))
    assert len(seen) > 20


@needs_v1
def test_v1_sampler_part_is_vllms_with_kvmaps_dtypes():
    seen: list = []
    for name in ("spec_decode", "chunked_prefill"):  # with a speculative config (SpecDecodeMetadata) and without
        trace = Trace(TRACES / f"{name}.jsonl")
        dumps(trace, "vllm-v1", forward=True, batch_order="v1", worker=sampler_checked("vllm-v1", trace, "v1", seen))
    assert len(seen) > 20


@needs_mrv2
@pytest.mark.skipif(GPU, reason="validate --deep runs backends on host tensors: the Triton interpreter, off here")
def test_validate_deep_compares_vllms_sampler_and_names_a_broken_expand_idx_mapping(monkeypatch):
    import vllm.v1.worker.gpu.model_runner as mr

    trace = Trace(TRACES / "spec_decode.jsonl")
    r = validate(trace, deep=True, backends=["vllm-mrv2"])
    assert r.valid and not r.problems, [p.message for p in r.problems[:3]]
    assert r.deep["backends"]["vllm-mrv2"]["forward_parts"] == {  # no attention backend named: no metadata
        "native": ["sampler", "cudagraph", "attention"], "kvmap": ["backends"]}
    # the plant: each request's last logits row gets local position 0 (right only for one-row requests)
    first = next(d["step"] for d in dumps(trace, "reference", forward=True) if any(d["expanded_local_pos"]))
    right = mr.expand_idx_mapping

    def broken(idx_mapping, total_num_logits, cu_num_logits, max_expand_len):
        idx, pos = right(idx_mapping, total_num_logits, cu_num_logits, max_expand_len)
        pos[cu_num_logits[1:].long() - 1] = 0
        return idx, pos

    monkeypatch.setattr(mr, "expand_idx_mapping", broken)
    r = validate(Trace(TRACES / "spec_decode.jsonl"), deep=True, backends=["vllm-mrv2"])
    conf = [p for p in r.problems if p.kind == "conformance"]
    assert conf and (conf[0].step, conf[0].field) == (first, "expanded_local_pos"), conf[:1]
    assert "vllm-mrv2 differs from the reference in expanded_local_pos" in conf[0].message


def flashinfer_trace(tmp_path, name: str) -> Trace:
    """Trace `name` with a header naming FlashInfer on every group and FULL_AND_PIECEWISE graphs (vLLM's default
    sizes): what `validate --deep` replays (it takes the forward settings from the header)."""
    lines = read_lines(TRACES / name)
    h = Trace(TRACES / name).header
    lines[0].update(cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes=cg.default_capture_sizes(
        h.max_num_seqs, h.max_num_batched_tokens, h.num_speculative_tokens))
    for grp in lines[0]["kv_cache_groups"]:
        grp["attention_backend"] = "FLASHINFER"
    return Trace(write_lines(tmp_path / name, lines))


@needs_mrv2
@pytest.mark.skipif(GPU, reason="validate --deep runs backends on host tensors: the Triton interpreter, off here")
def test_validate_deep_compares_vllms_attention_and_names_a_broken_flashinfer_last_page(tmp_path):
    """vLLM's CommonAttentionMetadata, split and FlashInfer metadata against the reference; then a broken copy of
    vLLM's page-table rule (tests/backends/flashinfer_last_page_mrv2_backend.py) is named at the first request
    whose KV fills its last page exactly."""
    trace = flashinfer_trace(tmp_path, "chunked_prefill.jsonl")
    r = validate(trace, deep=True, backends=["vllm-mrv2"])
    assert r.valid and not r.problems, [p.message for p in r.problems[:3]]
    assert r.deep["backends"]["vllm-mrv2"]["forward_parts"] == {
        "native": ["sampler", "cudagraph", "attention", "backends"], "kvmap": []}
    page = trace.header.kv_cache_groups[0].block_size
    first = next((d["step"], d["req_ids"][b]) for d in dumps(trace, "reference", forward=True)
                 for b, last in enumerate(d["paged_kv_last_page_len"][0][: len(d["req_ids"])]) if last == page)
    bug = str(ROOT / "tests" / "backends" / "flashinfer_last_page_mrv2_backend.py") + ":MRV2FlashInferLastPageOneShort"
    r = validate(trace, deep=True, backends=[bug])
    conf = [p for p in r.problems if p.kind == "conformance"]
    assert conf and (conf[0].step, conf[0].req_id, conf[0].group, conf[0].field) == \
        (first[0], first[1], 0, "paged_kv_last_page_len"), conf[:1]
    assert f"{page - 1} where the reference has {page}" in conf[0].message


@needs_v1
def test_v1_forward_parts_are_vllms_and_a_broken_split_threshold_is_seen(monkeypatch):
    """Under --runner v1 the graph choice, the attention metadata and (where FlashInfer imports) the FlashInfer
    metadata are vLLM's, as backend_detail says; a split threshold one short (decode rows counted as
    prefills) shows at the first step with a decode."""
    from vllm.v1.attention.backends import utils as bu

    from kvmap.workers.registry import make_worker

    trace = Trace(TRACES / "chunked_prefill.jsonl")
    want = dumps(trace, "reference", batch_order="v1", forward=True, config="graphs-flashinfer")
    worker = make_worker("vllm-v1", trace.header, "cuda" if GPU else "cpu", "v1", 1)
    assert dumps(trace, "vllm-v1", batch_order="v1", forward=True, config="graphs-flashinfer", worker=worker) == want
    fi = ("backends",) if importlib.util.find_spec("flashinfer") else ()
    assert worker.native_forward_parts == ("sampler", "cudagraph", "attention") + fi
    assert "sampler, cudagraph, attention" + (", backends" if fi else "") + " by vLLM" in worker.backend_detail
    right = bu.split_decodes_and_prefills

    def one_short(cm, decode_threshold=1, **kw):  # the plant
        return right(cm, decode_threshold=decode_threshold - 1, **kw)

    monkeypatch.setattr(bu, "split_decodes_and_prefills", one_short)
    got = dumps(trace, "vllm-v1", batch_order="v1", forward=True, config="graphs-flashinfer")
    first = next(w["step"] for w in want if w["num_decodes"][0])
    bad = [(w["step"], next(k for k in w if g[k] != w[k])) for g, w in zip(got, want) if g != w]
    assert bad and bad[0] == (first, "num_decodes"), bad[:2]


def planted_no_uniform_decode(h, d: dict) -> tuple:
    """The planted rule by kvmap's spec: MRV2's FULL_AND_PIECEWISE dispatch (default sizes) that never finds a
    uniform decode; (mode, padded tokens, padded requests) of dump record `d`."""
    sizes = cg.default_capture_sizes(h.max_num_seqs, h.max_num_batched_tokens, h.num_speculative_tokens)
    qsl = d["query_start_loc"]
    max_q = max(b - a for a, b in zip(qsl, qsl[1:]))
    p = cg.dispatch_spec("mrv2", "FULL_AND_PIECEWISE", sizes, h.max_num_seqs, h.num_speculative_tokens,
                         len(d["req_ids"]), qsl[-1], max_q, decode_eligible=False)
    return p.cudagraph_mode, p.num_tokens_padded, p.num_reqs_padded


@needs_mrv2
def test_mrv2_graph_choice_is_vllms_dispatch(monkeypatch):
    import vllm.v1.worker.gpu.dp_utils as dp

    trace = Trace(TRACES / "spec_decode.jsonl")  # FULL (requests padded), PIECEWISE and eager steps

    def run(backend):
        out: list[dict] = []
        replay(trace, ReplayConfig(backend=backend, device="cuda" if GPU else "cpu", write_kv=False, nvtx=False,
                                   warmup=0, forward=True, cudagraph_mode="FULL_AND_PIECEWISE",
                                   cudagraph_capture_sizes="default"), on_mappings=out.append)
        return out

    want = run("reference")
    assert {d["cudagraph_mode"] for d in want} == {"FULL", "PIECEWISE", "NONE"}
    assert any(d["num_reqs_padded"] > len(d["req_ids"]) for d in want)
    assert run("vllm-mrv2") == want
    right = dp.dispatch_cg_and_sync_dp

    def eager_decodes(manager, num_reqs, num_tokens, uniform_token_count, *a, **kw):  # the plant: decodes eager
        return right(manager, num_reqs, num_tokens, None, *a, **kw)

    first = next(w["step"] for w in want if planted_no_uniform_decode(trace.header, w) !=
                 (w["cudagraph_mode"], w["num_tokens_padded"], w["num_reqs_padded"]))
    monkeypatch.setattr(dp, "dispatch_cg_and_sync_dp", eager_decodes)
    got = run("vllm-mrv2")
    bad = [(w["step"], next(k for k in w if g[k] != w[k])) for g, w in zip(got, want) if g != w]
    assert bad and bad[0][0] == first and bad[0][1] in ("cudagraph_mode", "num_tokens_padded", "num_reqs_padded")
