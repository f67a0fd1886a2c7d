"""The forward-pass settings (kvmap/forward/config.py) and their header keys, options and checks: located errors
for bad values, older traces replayed as eager with the backend unknown (and said so), `--runner` as the one
choice of batch order and rules (`--batch-order` its deprecated name), `--forward` dumps, and validate's
`cascade` kind."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app
from kvmap.errors import KvmapError, TraceError
from kvmap.forward.config import parse_backends, resolve
from kvmap.trace import Trace
from kvmap.validate.driver import validate

from .conftest import TRACES, read_lines, write_lines

runner = CliRunner()
SPEC = TRACES / "spec_decode.jsonl"


def with_header(tmp_path, **keys):
    lines = read_lines(SPEC)
    for k, v in keys.items():
        if k.startswith("group_"):
            lines[0]["kv_cache_groups"][0][k[len("group_"):]] = v
        else:
            lines[0][k] = v
    p = tmp_path / "t.jsonl"
    write_lines(p, lines)
    return p


def test_an_older_trace_is_eager_with_the_backend_unknown():
    cfg = resolve(Trace(SPEC).header)
    assert (cfg.runner, cfg.cudagraph_mode, cfg.cudagraph_capture_sizes) == ("mrv2", "NONE", ())
    assert cfg.groups[0].attention_backend is None and cfg.groups[0].kernel_block_size == 16
    assert any("cudagraph_mode" in s for s in cfg.skipped) and any("attention_backend" in s for s in cfg.skipped)


def test_a_backend_kvmap_does_not_model_is_said_not_computed(tmp_path):
    """A name vLLM may have but kvmap has no rules for (FLASHINFER's metadata or FLASH_ATTN's splits) is taken,
    and a note says its split and metadata are not computed; a modeled name gives no note."""
    h = Trace(with_header(tmp_path, cudagraph_mode="NONE", group_attention_backend="FLASHINFER")).header
    assert resolve(h).skipped == () and resolve(h, attention_backend="FLASH_ATTN").skipped == ()
    (note,) = resolve(h, attention_backend="ROCM_AITER_FA").skipped
    assert note.startswith("group(s) 0: ROCM_AITER_FA: a backend kvmap does not model") and "FLASHINFER" in note


def test_header_keys_are_read(tmp_path):
    h = Trace(with_header(tmp_path, runner="v1", cudagraph_mode="FULL_AND_PIECEWISE",
                          cudagraph_capture_sizes=[8, 1, 4, 2, 4], group_attention_backend="FLASHINFER")).header
    cfg = resolve(h)
    assert (cfg.runner, cfg.cudagraph_mode, cfg.cudagraph_capture_sizes) == ("v1", "FULL_AND_PIECEWISE", (1, 2, 4, 8))
    assert cfg.groups[0].attention_backend == "FLASHINFER" and cfg.skipped == ()
    over = resolve(h, "mrv2", "TRITON_ATTN", "FULL_DECODE_ONLY", "16,32")
    assert (over.runner, over.cudagraph_mode, over.cudagraph_capture_sizes) == ("mrv2", "FULL_DECODE_ONLY", (16, 32))
    assert over.groups[0].attention_backend == "TRITON_ATTN"
    assert resolve(h, cudagraph_mode="NONE").cudagraph_capture_sizes == ()


@pytest.mark.parametrize("keys,field", [
    ({"runner": "v3"}, "runner"),
    ({"cudagraph_mode": "FULLISH"}, "cudagraph_mode"),
    ({"cudagraph_capture_sizes": 8}, "cudagraph_capture_sizes"),
    ({"cudagraph_capture_sizes": [1, 0]}, "cudagraph_capture_sizes"),
    ({"cudagraph_mode": "FULL"}, "cudagraph_capture_sizes"),  # graphs on, no sizes (docs/trace-format.md)
    ({"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": []}, "cudagraph_capture_sizes"),
    ({"group_attention_backend": "flash attn"}, "kv_cache_groups[0].attention_backend"),
])
def test_bad_header_keys_are_located(tmp_path, keys, field):
    with pytest.raises(TraceError) as e:
        assert Trace(with_header(tmp_path, **keys)).header is None
    assert e.value.line == 1 and e.value.field == field


def test_option_overrides_are_checked():
    h = Trace(SPEC).header
    assert parse_backends("0=FLASH_ATTN", 1) == {0: "FLASH_ATTN"} and parse_backends("FLASHINFER", 2) == {
        0: "FLASHINFER", 1: "FLASHINFER"}
    for kw, field in [({"attention_backend": "1=FLASH_ATTN"}, "--attention-backend"),
                      ({"attention_backend": "fa"}, "--attention-backend"),
                      ({"cudagraph_mode": "FULL"}, "--cudagraph-capture-sizes"),  # no sizes anywhere
                      ({"cudagraph_mode": "ALL"}, "--cudagraph-mode"),
                      ({"cudagraph_capture_sizes": "1,x"}, "--cudagraph-capture-sizes"),
                      ({"runner": "v2"}, "--runner")]:
        with pytest.raises(KvmapError) as e:
            resolve(h, **kw)
        assert e.value.field == field, kw


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_runner_option_and_its_old_name(tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    assert invoke("replay", SPEC, "-q", "--no-progress", "--no-kv", "--runner", "v1", "--dump-mappings",
                  a).exit_code == 0
    assert invoke("replay", SPEC, "-q", "--no-progress", "--no-kv", "--batch-order", "v1", "--dump-mappings",
                  b).exit_code == 0
    assert invoke("replay", SPEC, "-q", "--no-progress", "--no-kv", "--dump-mappings", c).exit_code == 0
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    r = invoke("replay", SPEC, "-q", "--no-progress", "--runner", "v1", "--batch-order", "mrv2")
    assert r.exit_code == 2 and "option --batch-order" in r.output


def test_forward_dump_and_its_options(tmp_path):
    d = tmp_path / "d.jsonl"
    r = invoke("replay", SPEC, "-q", "--no-progress", "--no-kv", "--forward", "--runner", "v1", "--dump-mappings", d)
    assert r.exit_code == 0, r.output
    first = json.loads(d.read_text().splitlines()[3])
    keys = list(first)
    at = keys.index("logits_indices")
    assert keys[at: at + 8] == ["logits_indices", "num_draft_tokens", "cu_num_draft_tokens", "cu_num_sampled_tokens",
                                "target_logits_indices", "bonus_logits_indices", "draft_token_ids",
                                "num_decode_draft_tokens"]
    # an older trace: eager, the backend unknown (the split is null, no backend keys)
    assert keys[at + 8:] == ["cudagraph_mode", "num_tokens_padded", "num_reqs_padded", "num_actual_tokens",
                             "max_query_len", "max_seq_len", "is_prefilling", "reorder_batch_threshold",
                             "num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens"]
    assert first["cudagraph_mode"] == "NONE" and first["num_decodes"] == [None]
    r = invoke("replay", SPEC, "-q", "--no-progress", "--cudagraph-mode", "FULL")
    assert r.exit_code == 2 and "option --" in r.output
    r = invoke("replay", SPEC, "-q", "--no-progress", "--attention-backend", "FLASHINFER")
    assert r.exit_code == 2 and "option --forward" in r.output
    r = invoke("replay", SPEC, "--no-progress", "--no-kv", "--forward", "--steps", "2:")
    assert r.exit_code == 0 and "prepare_forward" in r.output


def test_explain_shows_the_sampler_arithmetic():
    r = invoke("explain", SPEC, "--step", "5", "--json")
    f = json.loads(r.output)["forward"]
    assert f["runner"] == "mrv2" and f["sampler"]["cu_num_logits"] == [0, 4, 8, 12, 16, 20]
    assert "query_start_loc[1] - 4 + j = 4 - 4 + 0..3 = [0, 1, 2, 3]" in f["sampler"]["rows"][0]
    r = invoke("explain", SPEC, "--step", "5", "--runner", "v1")
    assert r.exit_code == 0 and "bonus_logits_indices[0] = cu_num_sampled_tokens[0] - 1 = 3" in r.output


def test_validate_reports_a_cascade_prefix(tmp_path):
    lines = read_lines(SPEC)
    lines[4]["scheduler_output"]["num_common_prefix_blocks"] = [3]
    lines[5]["scheduler_output"]["num_common_prefix_blocks"] = [0]  # older vLLM: no shared prefix, no claim
    p = tmp_path / "t.jsonl"
    write_lines(p, lines)
    found = [x for x in validate(Trace(p)).problems if x.kind == "cascade"]
    assert [(x.line, x.step, x.field) for x in found] == [(5, 3, "num_common_prefix_blocks")]
    assert not [x for x in validate(Trace(SPEC)).problems if x.kind == "cascade"]
