"""The line scanner (kvmap/trace/scan.py, scan_kernels.py) against the checked path: a worker fed scanned steps
and one fed decoded steps stay equal, state and mappings, after every step of every bundled one-group trace;
a line the checked path refuses is never accepted; a mutated line is either declined or means the same; the id
table agrees with a dict; ids the table cannot hold turn the scanner off until those requests end."""

from __future__ import annotations

import gzip
import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmap.aot import load
from kvmap.errors import TraceError
from kvmap.trace import Trace
from kvmap.trace.scan import KEY_MAX, ReqIdTable, ScannedStep
from kvmap.workers.registry import make_worker

from .conftest import TRACES, bundled_traces
from .test_fuzz import FIELDS, JSONISH, set_field

STATE = ("token_ids", "total_len", "num_computed_tokens", "num_blocks", "capacity")


def _compiled() -> bool:
    try:
        return load("kvmap.trace.scan_kernels").kind == "ahead-of-time"
    except Exception:  # noqa: BLE001 - no twin and no numba
        return False


pytestmark = pytest.mark.skipif(not _compiled(), reason="the scan kernels are not compiled ahead of time "
                                "(pip install -e . or python -m kvmap.aot builds them)")


def one_group(paths):
    return [p for p in paths if Trace(p).header.num_groups == 1]


def raw_lines(path) -> list[bytes]:
    data = path.read_bytes()
    return (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).splitlines()[1:]


def same_state(a, b, where: str) -> None:
    sa, sb = a.state, b.state
    for name in STATE:
        assert np.array_equal(getattr(sa, name), getattr(sb, name)), f"{where}: {name} differs"
    for g, (ta, tb) in enumerate(zip(sa.block_tables, sb.block_tables)):
        assert np.array_equal(ta, tb), f"{where}: block table {g} differs"
    assert sa.req_id_to_index == sb.req_id_to_index, f"{where}: rows differ"
    assert sa.free_indices == sb.free_indices, f"{where}: free rows differ"


def run_pair(trace: Trace, lines: list[bytes], upto: int | None = None):
    """Two numba workers over `lines`: `a` takes what its scanner accepts, `b` every line decoded. Returns
    (a, b, scanner) after `upto` lines (all: None), checking every step on the way."""
    a, b = make_worker("numba", trace.header), make_worker("numba", trace.header)
    scanner = a.line_scanner()
    assert scanner is not None
    for i, raw in enumerate(lines[:upto]):
        step_a = scanner.scan(raw, i + 2, i, trace.decode) or trace.decode(raw, i + 2, i)
        step_b = trace.decode(raw, i + 2, i)
        for w, s in ((a, step_a), (b, step_b)):
            w.run_step(s)
        assert a.mappings_dict() == b.mappings_dict(), f"step {i}: mappings differ"
        for w in (a, b):
            w.append_sampled()
        same_state(a, b, f"step {i}")
    return a, b, scanner


@pytest.mark.parametrize("path", one_group(bundled_traces()), ids=lambda p: p.name)
def test_scanned_and_decoded_workers_stay_equal(path):
    trace = Trace(path)
    _, _, scanner = run_pair(trace, raw_lines(path))
    assert scanner.scanned > 0 or scanner.declined, path.name


def test_every_line_of_the_long_trace_is_scanned():
    """The fast path is the one the long trace takes (so the replay's figures are the scanner's)."""
    path = TRACES / "long_mixed.jsonl.gz"
    trace = Trace(path)
    w = make_worker("numba", trace.header)
    scanner = w.line_scanner()
    n = 0
    for step in trace.steps(scanner=scanner):
        assert type(step) is ScannedStep
        w.run_step(step)
        w.append_sampled()
        n += 1
    assert n == 1919 and scanner.scanned == 1919 and not scanner.declined


def outcome(worker, trace, raw: bytes, i: int, scanner=None):
    """('ok', mappings) or ('error', message) of line `raw` as step i on `worker`."""
    try:
        step = (scanner.scan(raw, i + 2, i, trace.decode) if scanner else None) or trace.decode(raw, i + 2, i)
        worker.run_step(step)
        worker.append_sampled()
        return "ok", worker.mappings_dict(), type(step) is ScannedStep
    except TraceError as e:
        return "error", str(e), False


SMALL = ["worked_example.jsonl", "chunked_prefill.jsonl", "preemption_v2.jsonl", "prefix_caching.jsonl",
         "async_decode.jsonl", "preemption_v1.jsonl"]


def mutated_case(src: str, line: int, mutate):
    path = TRACES / src
    trace = Trace(path)
    lines = raw_lines(path)
    i = min(line, len(lines) - 1)
    raw = mutate(lines[i])
    if raw is None:
        return
    a, b, scanner = run_pair(trace, lines, i)
    got_a = outcome(a, trace, raw, i, scanner)
    got_b = outcome(b, trace, raw, i)
    if got_a[2]:  # the scanner took the line: it must mean what the checked path makes of it
        assert got_b[0] == "ok", f"the scanner accepted a line the checked path refuses: {got_b[1]}"
    assert got_a[:2] == got_b[:2]
    if got_a[0] == "ok":
        same_state(a, b, f"mutated step {i}")


@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.sampled_from(FIELDS + [("cached", "all_token_ids"), ("cached", "num_output_tokens"),
                                       ("new0", "prefill_token_ids"), ("kind",)]),
       value=JSONISH, line=st.integers(0, 12), src=st.sampled_from(SMALL))
def test_a_changed_field_is_declined_or_means_the_same(which, value, line, src):
    def mutate(raw: bytes):
        obj = json.loads(raw)
        if not set_field(obj, which, value):
            return None
        return json.dumps(obj, separators=(",", ":")).encode()

    mutated_case(src, line, mutate)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(line=st.integers(0, 12), src=st.sampled_from(SMALL), at=st.floats(0, 1, exclude_max=True),
       op=st.sampled_from(["drop", "insert", "replace", "space", "swap"]), byte=st.sampled_from(
           list(b'0123456789,:[]{}"-.e \\\ta') + [0xC3, 0x00]))
def test_a_changed_byte_is_declined_or_means_the_same(line, src, at, op, byte):
    def mutate(raw: bytes):
        k = int(at * len(raw))
        if op == "drop":
            return raw[:k] + raw[k + 1:]
        if op == "insert":
            return raw[:k] + bytes([byte]) + raw[k:]
        if op == "replace":
            return raw[:k] + bytes([byte]) + raw[k + 1:]
        if op == "space":
            return raw[:k] + b" \n\t"[k % 3: k % 3 + 1] + raw[k:]
        return raw[:k] + raw[k + 1: k + 2] + raw[k: k + 1] + raw[k + 2:]

    mutated_case(src, line, mutate)


@pytest.mark.parametrize("edit, reason", [
    (lambda d: d.update(kind="step"), "a form the scanner leaves to the decoder"),
    (lambda d: d["scheduler_output"].update(total_num_scheduled_tokens=1 + d["scheduler_output"]
                                            ["total_num_scheduled_tokens"]), "counts or ids that do not match"),
    (lambda d: d["scheduler_output"]["num_scheduled_tokens"].update({"nobody": 1}), "an unknown request id"),
    (lambda d: d["scheduler_output"]["scheduled_cached_reqs"].update(num_computed_tokens=[
        float(x) for x in d["scheduler_output"]["scheduled_cached_reqs"]["num_computed_tokens"]]), "another form"),
    (lambda d: d["scheduler_output"].update(scheduled_spec_decode_tokens={"A": [5]}),
     "a form the scanner leaves to the decoder"),
])
def test_declines_with_a_reason(edit, reason):
    path = TRACES / "worked_example.jsonl"
    trace = Trace(path)
    lines = raw_lines(path)
    a, _, scanner = run_pair(trace, lines, 2)
    d = json.loads(lines[2])
    assert scanner.scan(lines[2], 4, 2, trace.decode) is not None  # as recorded: taken
    edit(d)
    scanner.declined.clear()
    assert scanner.scan(json.dumps(d).encode(), 4, 2, trace.decode) is None
    assert dict(scanner.declined) == {reason: 1}


def test_keys_out_of_the_recorders_order_are_declined():
    path = TRACES / "worked_example.jsonl"
    trace = Trace(path)
    lines = raw_lines(path)
    _, _, scanner = run_pair(trace, lines, 2)
    d = json.loads(lines[2])
    moved = {"sampled_token_ids": d.pop("sampled_token_ids"), **d}  # sampled before scheduler_output
    assert scanner.scan(json.dumps(moved).encode(), 4, 2, trace.decode) is None


@pytest.mark.parametrize("name", ["x" * (KEY_MAX + 1), "réq-B", 'q"uote'])
def test_ids_the_table_cannot_hold_turn_the_scanner_off_while_they_live(tmp_path, name):
    """worked_example with request B renamed: every line while B lives is decoded, and the results equal."""
    src = TRACES / "worked_example.jsonl"
    text = src.read_text()
    path = tmp_path / "renamed.jsonl"
    head, *steps = text.splitlines()
    out = [head]
    for s in steps:
        d = json.loads(s)
        out.append(json.dumps(d, ensure_ascii=False).replace('"B"', json.dumps(name, ensure_ascii=False)))
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    trace = Trace(path)
    a, _, scanner = run_pair(trace, raw_lines(path))
    assert scanner.declined["ids the table does not hold"] > 0
    assert a.state.ids.untracked == (name in a.state.req_id_to_index)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), min_size=1, max_size=300))
def test_id_table_agrees_with_a_dict(ops):
    """Random adds and removals (rows reused, probe chains shifted back on delete) against a dict."""
    rows = 24
    table = ReqIdTable(rows)
    live: dict[str, int] = {}
    free = list(range(rows))
    rng = random.Random(len(ops))
    for add, k in ops:
        req_id = f"req-{k}-{'x' * (k % 7)}"
        if add and req_id not in live and free:
            row = free.pop(rng.randrange(len(free)))
            table.add(req_id, row)
            live[req_id] = row
        elif not add and req_id in live:
            row = live.pop(req_id)
            table.remove(row)
            free.append(row)
        for r_id in [f"req-{j}-{'x' * (j % 7)}" for j in range(41)]:
            assert table.find(r_id) == live.get(r_id, -1)


# ------------------------------------------------------------------ what the scanner carries from line to line
# The skip memo (a run of skipped members as the previous line had it), the key guesses (the key that followed
# each key) and the row guesses (the previous line's cached requests, in order) are all checked against the
# line before they are taken. Each edit below makes a line differ from its predecessor exactly where one of
# them looks, at the edges where a careless compare would go wrong; the line must then be declined or mean
# what the checked path makes of it.

def _cached_ids_edit(how: str):
    def edit(raw: bytes):
        d = json.loads(raw)
        ids = d["scheduler_output"]["scheduled_cached_reqs"]["req_ids"]
        if len(ids) < 2:
            return None
        old = json.dumps(ids, separators=(",", ":")).encode()
        new = {"swap": [ids[1], ids[0], *ids[2:]], "drop": ids[1:], "twice": [ids[0], *ids],
               "longer": [ids[0] + "0", *ids[1:]], "shorter": [ids[0][:-1], *ids[1:]],
               "other": [ids[1], *ids[1:]]}[how]
        return raw.replace(b'"req_ids":' + old, b'"req_ids":' + json.dumps(new, separators=(",", ":")).encode(), 1)
    return edit


def _bytes_edit(old: bytes, new: bytes):
    def edit(raw: bytes):
        return raw.replace(old, new, 1) if old in raw else None
    return edit


CARRIED_EDITS = {
    # the skip memo: a value or key changed inside a run, at its first and last byte, a number that goes on
    # past where the run ended, a member more or less, a handled key where a skipped one was
    "memo value": _bytes_edit(b'"has_sync_kv_loads":false', b'"has_sync_kv_loads":true'),
    "memo first key byte": _bytes_edit(b'"scheduled_encoder_inputs":{}', b'"Scheduled_encoder_inputs":{}'),
    "memo last byte": _bytes_edit(b'"skip_drafts":false', b'"skip_drafts":falsE'),
    "memo number goes on": _bytes_edit(b'"num_spec_tokens_to_schedule":0', b'"num_spec_tokens_to_schedule":01'),
    "memo number longer": _bytes_edit(b'"num_spec_tokens_to_schedule":0', b'"num_spec_tokens_to_schedule":0.5'),
    "memo number then space": _bytes_edit(b'"num_spec_tokens_to_schedule":0,', b'"num_spec_tokens_to_schedule":0 ,'),
    "memo literal goes on": _bytes_edit(b'"skip_drafts":false', b'"skip_drafts":falsex'),
    "memo run cut": _bytes_edit(b'"skip_drafts":false', b'"skip_drafts":fals'),
    "memo member more": _bytes_edit(b'"has_sync_kv_loads":false', b'"has_sync_kv_loads":false,"x":[1,{"a":null}]'),
    "memo member less": _bytes_edit(b'"kv_connector_metadata":null,', b''),
    "memo handled key": _bytes_edit(b'"skip_drafts":false', b'"finished_req_ids":["nobody"]'),
    "memo handled key that counts": _bytes_edit(b'"skip_drafts":false', b'"total_num_scheduled_tokens":1'),
    "memo same length, a handled key": _bytes_edit(b'"aux_output_connector_metadata":null',
                                                   b'"total_num_scheduled_tokens":  12345'),  # 36 bytes each
    "memo key twice": _bytes_edit(b'"scheduled_encoder_inputs":{}',
                                  b'"scheduled_encoder_inputs":{},"scheduled_encoder_inputs":{}'),
    "memo then a bad end": _bytes_edit(b'"skip_drafts":false}', b'"skip_drafts":false,}'),
    "memo then space": _bytes_edit(b'"skip_drafts":false}', b'"skip_drafts":false }'),
    "memo in a new request": _bytes_edit(b'"pooling_params":null', b'"pooling_params":nul'),
    "memo new request goes on": _bytes_edit(b'"prompt_is_token_ids":null', b'"prompt_is_token_ids":nullx'),
    # the key guesses: a name one byte longer or shorter than the guess, an escape, whitespace
    "key longer": _bytes_edit(b'"req_ids":', b'"req_idsx":'),
    "key shorter": _bytes_edit(b'"num_output_tokens":', b'"num_output_token":'),
    "key escaped": _bytes_edit(b'"req_ids":', b'"req_\\u0069ds":'),
    "key then space": _bytes_edit(b'"num_computed_tokens":', b'"num_computed_tokens" :'),
    "top key longer": _bytes_edit(b'"sampled_token_ids":', b'"sampled_token_idss":'),
    # the row guesses: the cached ids reordered, one dropped or given twice, an id one byte longer or shorter
    # than the guessed row's, another live id in its place
    **{f"cached ids {how}": _cached_ids_edit(how) for how in ("swap", "drop", "twice", "longer", "shorter",
                                                              "other")},
}


@pytest.mark.parametrize("src, line", [("prefix_caching.jsonl", 4), ("preemption_v2.jsonl", 6),
                                       ("async_decode.jsonl", 5), ("long_mixed.jsonl.gz", 168)])
@pytest.mark.parametrize("edit", list(CARRIED_EDITS))
def test_a_line_that_differs_where_the_scanner_guesses_is_declined_or_means_the_same(edit, src, line):
    lines = raw_lines(TRACES / src)
    if CARRIED_EDITS[edit](lines[line]) is None:
        pytest.skip("the line has no such bytes")
    mutated_case(src, line, CARRIED_EDITS[edit])


def test_the_scanner_carries_its_guesses_on_the_long_trace():
    """On the long trace the memo holds scheduler_output's runs of skipped members and a new request's. A line
    that differs from the one before it inside a memoized run is still scanned (the long way there, keeping
    the new run), and so is the next line, back as recorded: the workers agree after both."""
    from kvmap.trace import scan_layout as L

    path = TRACES / "long_mixed.jsonl.gz"
    trace = Trace(path)
    lines = raw_lines(path)
    a, b, scanner = run_pair(trace, lines, 170)

    def held(slot: int) -> bytes:
        kept = scanner.keytab[slot * L.MEMO_MAX: slot * L.MEMO_MAX + scanner.keyidx[L.MEMO_LEN + slot]]
        return kept.astype(np.uint8).tobytes()  # a byte an entry

    assert held(L.MEMO_SO + 2).startswith(b'"has_structured_output_requests":false,')
    assert held(L.MEMO_SO + 2).endswith(b'"skip_drafts":false')
    assert held(L.MEMO_NEW).startswith(b'"mm_features":null')
    changed = lines[170].replace(b'"has_sync_kv_loads":false', b'"has_sync_kv_loads":true')
    for i, raw in ((170, changed), (171, lines[171])):
        got_a, got_b = outcome(a, trace, raw, i, scanner), outcome(b, trace, raw, i)
        assert got_a[2], f"line {i} was not scanned: {dict(scanner.declined)}"
        assert got_a[:2] == got_b[:2]
        same_state(a, b, f"step {i}")
        if i == 170:
            assert b'"has_sync_kv_loads":true' in held(L.MEMO_SO + 2)
    assert b'"has_sync_kv_loads":false' in held(L.MEMO_SO + 2)


def test_the_epoch_wraps_without_changing_what_a_line_means():
    """The scans' count marks rows in the MK_* columns; when it reaches 2**30 the kernel clears those columns
    and counts from 1 again. Lines scanned across the wrap mean what the checked path makes of them."""
    from kvmap.trace import scan_layout as L

    path = TRACES / "preemption_v2.jsonl"
    trace = Trace(path)
    lines = raw_lines(path)
    a, b, scanner = run_pair(trace, lines, 3)
    scanner.meta[L.A_EPOCH] = (1 << 30) - 2
    scanned = 0
    for i in range(3, len(lines)):
        got_a, got_b = outcome(a, trace, lines[i], i, scanner), outcome(b, trace, lines[i], i)
        assert got_a[:2] == got_b[:2], f"step {i}"
        same_state(a, b, f"step {i}")
        scanned += got_a[2]
    assert scanned >= 3 and 1 <= scanner.meta[L.A_EPOCH] <= len(lines)
