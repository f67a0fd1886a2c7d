"""The typed step decoder (kvmap.trace.typed, when msgspec is installed) against the checked one (`parse_step`):
on every line either it steps aside (None) or it gives the same Step; whenever `parse_step` rejects a line, it
steps aside, so every problem is still named by the checked parser. (Edits of several fields at once:
tests/test_fuzz_multi.py.)"""

from __future__ import annotations

import gzip
import json
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmap.errors import TraceError
from kvmap.trace import Trace, Where, parse_step
from kvmap.trace.typed import typed_decoder
from kvmap.validate import validate

from .conftest import TRACES, bundled_traces
from .test_fuzz import FIELDS, JSONISH, set_field


def lines_of(path):
    op = gzip.open if path.suffix == ".gz" else open
    with op(path, "rt") as f:
        return [json.loads(x) for x in f.read().splitlines()]


def typed(obj, header, i):
    """The typed decoder's result on `obj` written as a JSON line (json.dumps: ints of any size), or None."""
    dec = typed_decoder(header)
    return None if dec is None else dec(json.dumps(obj), i + 2, i)


def both(obj, header, i):
    where = Where("t.jsonl", i + 2, i)
    tfast = typed(obj, header, i)
    try:
        slow = parse_step(obj, header, where)
    except TraceError:
        assert tfast is None, "the typed decoder accepted a line the checked parser rejects"
        return None, "rejected"
    assert tfast is None or tfast == slow
    return tfast, "ok"


@pytest.mark.parametrize("path", bundled_traces(), ids=lambda p: p.name)
def test_typed_decoder_takes_every_bundled_line(path):
    """The raw lines as recorded (not re-serialized) go through the typed decoder and equal the checked parse."""
    header = Trace(path).header
    dec = typed_decoder(header)
    if dec is None:
        pytest.skip("msgspec is not installed")
    data = path.read_bytes()
    raw = (zlib.decompress(data, 31) if data[:2] == b"\x1f\x8b" else data).splitlines()[1:]
    for i, line in enumerate(raw):
        where = Where("t.jsonl", i + 2, i)
        got = dec(line, i + 2, i)
        assert got is not None, f"line {i + 2}: the typed decoder stepped aside"
        assert got == parse_step(json.loads(line), header, where)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.sampled_from(FIELDS + [("cached", "all_token_ids"), ("cached", "num_output_tokens"),
                                       ("new0", "prefill_token_ids"), ("kind",)]),
       value=JSONISH, line=st.integers(1, 3),
       src=st.sampled_from(["worked_example.jsonl", "spec_decode.jsonl", "hybrid_sliding_window.jsonl"]))
def test_typed_decoder_never_accepts_what_the_checked_parser_rejects(which, value, line, src):
    path = TRACES / src
    lines = lines_of(path)
    header = Trace(path).header
    if set_field(lines[line], which, value):
        both(lines[line], header, line - 1)


@pytest.mark.parametrize("mutation", [
    lambda s: s["scheduler_output"]["num_scheduled_tokens"].update(B=True),  # a bool is not a count
    lambda s: s["scheduler_output"]["scheduled_cached_reqs"].update(num_computed_tokens=[31.0]),
    lambda s: s.update(sampled_token_ids={"B": [2**31]}),  # one past the int32 token range
    lambda s: s.update(sampled_token_ids={"B": [True]}),
    lambda s: s["scheduler_output"]["scheduled_cached_reqs"]["new_block_ids"].__setitem__(0, [[96]]),
    lambda s: s["scheduler_output"].update(finished_req_ids=[1]),
])
def test_typed_decoder_steps_aside_on_edge_values(mutation):
    path = TRACES / "worked_example.jsonl"
    lines = lines_of(path)
    step = lines[2]
    mutation(step)
    header = Trace(path).header
    if typed_decoder(header) is None:
        pytest.skip("msgspec is not installed")
    assert typed(step, header, 1) is None


def legacy(step, drop, **old):
    c = step["scheduler_output"]["scheduled_cached_reqs"]
    c.pop(drop)
    c.update(old)


@pytest.mark.parametrize("mutation", [
    lambda s: s["scheduler_output"]["scheduled_cached_reqs"].update(new_block_ids=[None, []]),  # an empty entry
    lambda s: s["scheduler_output"]["scheduled_cached_reqs"].update(new_block_ids=[None, [96]]),  # legacy flat form
    lambda s: s["scheduler_output"]["scheduled_cached_reqs"].update(num_output_tokens=[1, 2, 3]),  # 3 for 2 requests
    lambda s: legacy(s, "resumed_req_ids", resumed_from_preemption=[False, False]),  # before #27756
    lambda s: legacy(s, "all_token_ids", resumed_req_token_ids=[None, None]),  # before #27756
    lambda s: s["scheduler_output"].update(scheduled_spec_decode_tokens={"B": [2**31]}),
    lambda s: s["scheduler_output"].update(total_num_scheduled_tokens=True),
    lambda s: s.update(step=True),
    lambda s: s.update(kind="header"),
])
def test_typed_decoder_steps_aside_on_what_only_the_checked_path_reads(mutation):
    """Checks a type cannot state (lengths, legacy keys, draft ranges, a bool where an int goes)."""
    path = TRACES / "worked_example.jsonl"
    header = Trace(path).header
    if typed_decoder(header) is None:
        pytest.skip("msgspec is not installed")
    step = lines_of(path)[2]
    assert typed(step, header, 1) is not None  # the unmutated line is taken
    mutation(step)
    assert typed(step, header, 1) is None


def test_invalid_utf8_in_a_skipped_member_is_refused_by_every_decoder(tmp_path):
    """msgspec skips an unknown member without checking its UTF-8; the checked parser refuses the line, so the
    typed decoder must step aside and `Trace.decode` name the byte (a replay used to accept the line)."""
    path = TRACES / "worked_example.jsonl"
    lines = path.read_bytes().splitlines()
    lines[2] = lines[2].replace(b'"step": 1', b'"step": 1, "junk": "x\xff"', 1)
    bad = tmp_path / "bad_utf8.jsonl"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    trace = Trace(bad)
    dec = typed_decoder(trace.header)
    if dec is not None:
        assert dec(lines[2], 3, 1) is None
    with pytest.raises(TraceError) as e:
        trace.decode(lines[2], 3, 1)
    assert e.value.kind == "json" and e.value.line == 3 and "not UTF-8" in e.value.message


@pytest.mark.parametrize("bad,what", [(b"\xff", "byte 0xff at column 22 cannot start a character"),
                                      (b"\xc3(", "byte 0xc3 at column 22 starts a character: invalid continuation "
                                                 "byte"),
                                      (b"\xe2\x82", "byte 0xe2 at column 22 starts a character: invalid continuation "
                                                    "byte")])
def test_invalid_utf8_names_the_byte_and_what_is_wrong(tmp_path, bad, what):
    """0xc3 can start a character (its next byte is what is wrong): the message said it cannot."""
    lines = (TRACES / "worked_example.jsonl").read_bytes().splitlines()
    lines[2] = lines[2].replace(b'{"step": 1', b'{"step": 1, "junk": "' + bad + b'"', 1)
    assert lines[2].index(bad) + 1 == len(b'{"step": 1, "junk": "') + 1 == 22
    bad_trace = tmp_path / "bad_utf8.jsonl"
    bad_trace.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(TraceError) as e:
        list(Trace(bad_trace).steps())
    assert e.value.line == 3 and e.value.message == f"not UTF-8 text ({what})", e.value.message


@pytest.mark.parametrize("number", [b"1e400", b"-" + b"9" * 400, b"9" * 5000])
@pytest.mark.parametrize("decoder", ["typed", "orjson", "stdlib"])
def test_a_number_past_a_doubles_range_in_a_skipped_member_is_json_to_every_decoder(tmp_path, monkeypatch,
                                                                                   number, decoder):
    """JSON sets no range on numbers. The typed decoder skips such a member; orjson refused it, so validate
    named a line replay had replayed. Every decoder now reads the line, and the steps are the same steps."""
    import kvmap.trace.reader
    import kvmap.validate.driver
    from kvmap.trace.checks import stdlib_loads

    lines = (TRACES / "worked_example.jsonl").read_bytes().splitlines()
    lines[2] = lines[2].replace(b'"scheduler_output": {', b'"scheduler_output": {"junk": [' + number + b"], ", 1)
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"\n".join(lines) + b"\n")
    if decoder != "typed":
        monkeypatch.setattr(Trace, "_typed_decoder", lambda self: None)  # the checked path
    if decoder == "stdlib":
        monkeypatch.setattr(kvmap.trace.reader, "loads", stdlib_loads)
        monkeypatch.setattr(kvmap.validate.driver, "loads", stdlib_loads)
    assert list(Trace(big).steps()) == list(Trace(TRACES / "worked_example.jsonl").steps())
    assert validate(Trace(big)).problems == []


def test_a_number_past_a_doubles_range_in_a_field_kvmap_reads_is_refused_by_both_decoders(tmp_path, monkeypatch):
    lines = (TRACES / "worked_example.jsonl").read_bytes().splitlines()
    lines[2] = lines[2].replace(b'"total_num_scheduled_tokens": 9', b'"total_num_scheduled_tokens": 1e400', 1)
    assert b"1e400" in lines[2]
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(TraceError) as typed:
        list(Trace(big).steps())
    monkeypatch.setattr(Trace, "_typed_decoder", lambda self: None)
    with pytest.raises(TraceError) as checked:
        list(Trace(big).steps())
    assert (typed.value.line, checked.value.line) == (3, 3) and validate(Trace(big)).problems[0].line == 3


def test_nesting_past_the_depth_limit_in_a_skipped_member_is_one_located_error(tmp_path):
    """msgspec raised RecursionError (a traceback from replay and explain) on a member it skips; validate named
    the line. Now the typed decoder steps aside and every consumer gets the checked parser's located error."""
    lines = (TRACES / "worked_example.jsonl").read_bytes().splitlines()
    lines[2] = lines[2].replace(b'{"step": 1', b'{"step": 1, "junk": ' + b"[" * 100_000 + b"]" * 100_000, 1)
    bad = tmp_path / "deep.jsonl"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(TraceError) as e:
        list(Trace(bad).steps())
    assert (e.value.kind, e.value.line, e.value.step) == ("json", 3, 1), e.value
    assert [(p.kind, p.line) for p in validate(Trace(bad)).problems] == [("json", 3)]


@pytest.mark.parametrize("junk", [b"[" * 100_000 + b"]" * 100_000, b"NaN"])
def test_the_standard_library_fallback_fails_as_orjson_does(tmp_path, monkeypatch, junk):
    """Without orjson, json.loads raised RecursionError on deep nesting (a traceback from replay and validate)
    and took NaN, which is not JSON. `stdlib_loads` refuses both with the located error orjson gives."""
    import kvmap.trace.reader
    import kvmap.validate.driver
    from kvmap.trace.checks import stdlib_loads

    monkeypatch.setattr(kvmap.trace.reader, "loads", stdlib_loads)
    monkeypatch.setattr(kvmap.validate.driver, "loads", stdlib_loads)
    lines = (TRACES / "worked_example.jsonl").read_bytes().splitlines()
    lines[2] = lines[2].replace(b'"scheduler_output": {', b'"scheduler_output": {"junk": ' + junk + b", ", 1)
    bad = tmp_path / "junk.jsonl"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    monkeypatch.setattr(Trace, "_typed_decoder", lambda self: None)  # as without msgspec: the checked path
    with pytest.raises(TraceError) as e:
        list(Trace(bad).steps())
    assert (e.value.kind, e.value.line, e.value.step) == ("json", 3, 1), e.value
    assert [(p.kind, p.line) for p in validate(Trace(bad)).problems] == [("json", 3)]
