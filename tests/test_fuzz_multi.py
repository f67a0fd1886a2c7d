"""Differential fuzz with multi-field edits (tests/fuzz_multi.py): lines where fields contradict each other must
be judged the same way by every decoder and every backend.

- Decoders: on every mutated line, `Trace.decode(raw)` (the fast path) equals `parse_step` (the checked
  parser, the oracle), or both raise `TraceError` with the same kind, step and request.
- Backends: a short bundled trace with one mutated line, replayed from step 0 through that step and 1-2 more:
  every backend gives identical `mappings_dict()` records at every step, or every backend raises `TraceError`
  with the same kind at the same step and request; when the checked parser refuses the line, that refusal
  (kind, step, request) is the one every backend must give. Nothing but `TraceError` may escape.

Every case is one integer seed (BASE_SEED + n) that picks the trace, the line and the edits; each failure names
its seed and a one-line command that replays it. Zero divergences are asserted.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import io
import os
import re
import random
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from kvmap.errors import TraceError
from kvmap.trace import Trace, Where, parse_step
from kvmap.trace.reader import json_error
from kvmap.workers.registry import make_worker

from .conftest import ROOT, TRACES, bundled_traces
from .fuzz_multi import mutate

BASE_SEED = 240_000
DECODER_LINES = 40_000  # mutated lines per run of the decoder differential
BAD_BYTE_SHARE = 0.05  # of those, lines that also get an unknown member whose string is not UTF-8
BACKEND_CASES = 800  # mutated traces per run of the backend differential
BACKENDS = ("reference", "numpy", "numba", "torch")
TRITON_EVERY = 10  # the Triton backend (interpreted on CPU) joins every 10th backend case
BACKEND_MAX_STEP = 16  # the mutated step of a backend case is one of the trace's first 16
SHOW = 3  # failures shown in full per divergence class


# ------------------------------------------------------------------------------------------------ traces


@functools.cache
def _trace(name: str) -> tuple[Trace, dict, list[bytes]]:
    """(Trace, header line as a dict, raw step lines) of a bundled trace."""
    path = TRACES / name
    data = path.read_bytes()
    text = gzip.decompress(data) if name.endswith(".gz") else data
    lines = text.splitlines()
    return Trace(path), orjson.loads(lines[0]), lines[1:]


def _names() -> list[str]:
    return [p.name for p in bundled_traces()]


def _short_names() -> list[str]:
    return [n for n in _names() if not n.endswith(".gz")]


def _mutated(rng: random.Random, name: str, i: int) -> tuple[bytes, list[str]]:
    _, ctx, lines = _trace(name)
    step = orjson.loads(lines[i])
    labels = mutate(step, rng, ctx)
    raw = orjson.dumps(step)
    if rng.random() < BAD_BYTE_SHARE:  # a member the decoders skip, its string holding a byte that is not UTF-8
        starts = [m.start() + 1 for m in re.finditer(rb'\{"', raw)]
        at = rng.choice(starts)
        raw = raw[:at] + b'"x_note":"' + bytes([rng.randrange(0x80, 0x100)]) + b'",' + raw[at:]
        labels = [*labels, f"bad_byte@{at}"]
    return raw, labels


def _signature(e: BaseException) -> tuple:
    return (e.kind, e.step, e.req_id) if isinstance(e, TraceError) else ("crash", type(e).__name__)


def _where_crashed(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    last = tb[-1] if tb else None
    return f"{type(e).__name__}({e}) at {Path(last.filename).name}:{last.lineno}" if last else repr(e)


# ------------------------------------------------------------------------------------------- decoders


def _typed_takes(trace: Trace, raw: bytes, line: int, i: int) -> str:
    """Which decoder takes the line: the typed one, or the checked parser (diagnostics only)."""
    try:
        from kvmap.trace.typed import typed_decoder

        dec = typed_decoder(trace.header)
        if dec is not None and dec(raw, line, i) is not None:
            return "typed"
    except Exception:  # noqa: BLE001 - a diagnostic must not hide the divergence itself
        return "?"
    return "checked"


def decoder_case(seed: int) -> tuple[str, str] | None:
    """None when the fast path and the checked parser agree on the line `seed` makes; else (class, message)."""
    rng = random.Random(seed)
    name = rng.choice(_names())
    trace, _, lines = _trace(name)
    i = rng.randrange(len(lines))
    raw, labels = _mutated(rng, name, i)
    line = i + 2
    got = want = None
    try:
        got = trace.decode(raw, line, i)
    except Exception as e:  # noqa: BLE001
        got = e
    try:  # the checked path: orjson (a line that is not JSON or not UTF-8 is a located `json` error), parse_step
        want = parse_step(orjson.loads(raw), trace.header, Where(trace.name, line, i))
    except orjson.JSONDecodeError as e:
        want = json_error(raw, e, trace.name, line, i)
    except Exception as e:  # noqa: BLE001
        want = e
    g_err, w_err = isinstance(got, BaseException), isinstance(want, BaseException)
    if not g_err and not w_err:
        if got == want:
            return None
        cls = f"decode and parse_step give different steps ({_typed_takes(trace, raw, line, i)} decoder)"
    elif g_err and w_err:
        if _signature(got) == _signature(want) and isinstance(got, TraceError):
            return None
        cls = f"both refuse, decode {_signature(got)[:2]} vs parse_step {_signature(want)[:2]}"
    elif w_err:
        cls = (f"decode ({_typed_takes(trace, raw, line, i)} decoder) accepts what parse_step refuses as "
               f"{want.kind} ({want.message})" if isinstance(want, TraceError)
               else f"parse_step crashed: {_where_crashed(want)}")
    else:
        cls = (f"decode refuses as {_signature(got)[0]} what parse_step accepts" if isinstance(got, TraceError)
               else f"decode crashed: {_where_crashed(got)}")
    what = lambda x: f"{x}" if isinstance(x, BaseException) else "accepted"  # noqa: E731
    msg = (f"seed {seed}: {name} line {line} (step {i}), edits {labels}\n"
           f"    decode: {what(got)}\n    parse_step: {what(want)}\n"
           f"    reproduce: cd {ROOT} && PYTHONPATH=. python -c \"from tests.test_fuzz_multi import show; "
           f"show('decoder', {seed})\"")
    return cls, msg


def _report(kind: str, n: int, found: dict[str, list[str]], took: float) -> str:
    out = [f"{kind}: {sum(map(len, found.values()))} divergences in {n} cases ({took:.1f}s), "
           f"{len(found)} classes:"]
    for cls, msgs in sorted(found.items(), key=lambda kv: -len(kv[1])):
        out.append(f"\n[{len(msgs)}x] {cls}")
        out.extend("  " + m for m in msgs[:SHOW])
    return "\n".join(out)


def test_decoders_agree_with_the_checked_parser_on_multi_field_edits():
    found: dict[str, list[str]] = defaultdict(list)
    t0 = time.perf_counter()
    for n in range(DECODER_LINES):
        r = decoder_case(BASE_SEED + n)
        if r is not None:
            found[r[0]].append(r[1])
    took = time.perf_counter() - t0
    print(f"decoder differential: {DECODER_LINES} lines in {took:.1f}s")
    assert not found, _report("decoder differential", DECODER_LINES, found, took)


# ------------------------------------------------------------------------------------------- backends


def run_backend(path: Path, backend: str, batch_order: str) -> tuple[list[dict], BaseException | None]:
    """Replay `path` through one backend as `kvmap replay` does, without KV cache: the record of every step
    (`mappings_dict()` after the step's phases and `append_sampled`), and the exception that ended it."""
    records: list[dict] = []
    if backend in ("torch", "triton"):
        import torch

        torch.set_num_threads(1)
    try:
        trace = Trace(path)
        worker = make_worker(backend, trace.header, "cpu", batch_order)
        for step in trace.steps():
            worker.run_step(step)
            worker.append_sampled()
            records.append(worker.mappings_dict())
    except Exception as e:  # noqa: BLE001 - every outcome is compared
        return records, e
    return records, None


def _oracle(path: Path) -> TraceError | None:
    """The checked parser's refusal of some line of `path`, if any (`parse_step` on every line)."""
    trace = Trace(path)
    for line, raw in trace.raw_lines():
        try:
            parse_step(orjson.loads(raw), trace.header, Where(trace.name, line, line - 2))
        except orjson.JSONDecodeError as e:
            return json_error(raw, e, trace.name, line, line - 2)
        except TraceError as e:
            return e
    return None


def _short_sig(records: list[dict], err: BaseException | None, groups: list[list[dict]]) -> str:
    if err is None:
        return f"ok#{groups.index(records) + 1}" if len(groups) > 1 else "ok"
    if isinstance(err, TraceError):
        return f"{err.kind}@step{err.step}"
    return f"crash:{_where_crashed(err).split('(')[0]}@{_where_crashed(err).rsplit(' at ', 1)[-1]}"


def backend_case(seed: int, tmp: Path | None = None) -> tuple[str, str] | None:
    """None when every backend judges the trace `seed` makes the same way; else (class, message)."""
    rng = random.Random(seed)
    name = rng.choice(_short_names())
    _, _, lines = _trace(name)
    i = rng.randrange(min(len(lines), BACKEND_MAX_STEP))
    extra = rng.choice([1, 2])
    order = "v1" if rng.random() < 0.25 else "mrv2"
    raw, labels = _mutated(rng, name, i)
    tmp = Path(tmp or tempfile.gettempdir())
    path = tmp / f"fuzz-multi-{seed}.jsonl"
    header = (TRACES / name).read_bytes().split(b"\n", 1)[0]
    path.write_bytes(b"\n".join([header, *lines[:i], raw, *lines[i + 1:i + 1 + extra]]) + b"\n")
    backends = BACKENDS + (("triton",) if (seed - BASE_SEED) % TRITON_EVERY == 0 else ())
    try:
        outcomes = {b: run_backend(path, b, order) for b in backends}
        oracle = _oracle(path)
    finally:
        if tmp is not None:
            path.unlink(missing_ok=True)
    errs = {b: e for b, (_, e) in outcomes.items()}
    sigs = {(_signature(e) if e is not None else "ok") for e in errs.values()}
    crashed = any(e is not None and not isinstance(e, TraceError) for e in errs.values())
    records_agree = len(sigs) == 1 and (sigs != {"ok"} or all(r == outcomes[backends[0]][0]
                                                               for r, _ in outcomes.values()))
    oracle_agrees = oracle is None or sigs == {_signature(oracle)}
    if records_agree and not crashed and oracle_agrees:
        return None
    groups: list[list[dict]] = []
    for r, e in outcomes.values():
        if e is None and r not in groups:
            groups.append(r)
    short = {b: _short_sig(r, e, groups) for b, (r, e) in outcomes.items()}
    cls_parts = [f"{b}={s.split('@step')[0]}" for b, s in short.items()]
    if oracle is not None:
        cls_parts.append(f"oracle={oracle.kind}")
    first_diff = ""
    if len(groups) > 1:
        a, b = groups[0], groups[1]
        k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        key = next((x for x in (a[k] if k < len(a) else {}) if k < len(b) and a[k][x] != b[k].get(x)), "?")
        first_diff = f"\n    first differing record: step {k}, key {key!r}"
    lines_out = [f"seed {seed}: {name} step {i} mutated, replayed {i + 1 + extra} steps, batch order {order}, "
                 f"edits {labels}"]
    for b, (r, e) in outcomes.items():
        lines_out.append(f"    {b}: {len(r)} records, " + ("ok" if e is None else
                         str(e) if isinstance(e, TraceError) else _where_crashed(e)))
    if oracle is not None:
        lines_out.append(f"    parse_step: {oracle}")
    lines_out.append(first_diff.strip("\n") if first_diff else "")
    lines_out.append(f"    reproduce: cd {ROOT} && TRITON_INTERPRET=1 PYTHONPATH=. python -c \"from "
                     f"tests.test_fuzz_multi import show; show('backend', {seed})\" (keeps the trace as "
                     f"{Path(tempfile.gettempdir()) / path.name})")
    return "; ".join(cls_parts), "\n".join(x for x in lines_out if x)


def test_backends_agree_on_multi_field_edits(tmp_path):
    found: dict[str, list[str]] = defaultdict(list)
    t0 = time.perf_counter()
    for n in range(BACKEND_CASES):
        r = backend_case(BASE_SEED + n, tmp_path)
        if r is not None:
            found[r[0]].append(r[1])
    took = time.perf_counter() - t0
    print(f"backend differential: {BACKEND_CASES} traces in {took:.1f}s")
    assert not found, _report("backend differential", BACKEND_CASES, found, took)


def show(kind: str, seed: int) -> None:
    """Print what case `seed` of the decoder or backend differential finds (the failure messages' reproducer;
    a backend case keeps its trace in the temporary directory, for `kvmap replay`)."""
    r = (decoder_case if kind == "decoder" else backend_case)(seed)
    print("agree" if r is None else f"{r[0]}\n{r[1]}")


if __name__ == "__main__":  # python -m tests.test_fuzz_multi: both reports, without pytest
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for fn, n, kind in ((decoder_case, DECODER_LINES, "decoder"), (backend_case, BACKEND_CASES, "backend")):
        found = defaultdict(list)
        t0 = time.perf_counter()
        for k in range(n):
            r = fn(BASE_SEED + k)
            if r is not None:
                found[r[0]].append(r[1])
        print(_report(kind, n, found, time.perf_counter() - t0))


# ------------------------------------------------------------------------- the review's line (d.3)


def _review_line(tmp: Path, steps: int = 4) -> Path:
    """traces/worked_example.jsonl with step 1's cached req_ids ["B", "B"] (A still in num_scheduled_tokens),
    the line of review-architecture.md section d.3, the first `steps` steps."""
    lines = (TRACES / "worked_example.jsonl").read_bytes().splitlines()
    step = orjson.loads(lines[2])
    step["scheduler_output"]["scheduled_cached_reqs"].update(
        req_ids=["B", "B"], num_computed_tokens=[31, 31], new_block_ids=[None, None], num_output_tokens=[1, 1])
    lines[2] = orjson.dumps(step)
    path = tmp / "review_d3.jsonl"
    path.write_bytes(b"\n".join(lines[:steps + 1]) + b"\n")
    return path


@pytest.mark.parametrize("backend", BACKENDS + ("triton",))
def test_the_review_line_is_refused_by_every_backend(tmp_path, backend):
    records, err = run_backend(_review_line(tmp_path), backend, "mrv2")
    assert isinstance(err, TraceError), f"{backend}: {len(records)} records, then {err!r}"
    assert (err.kind, err.step, err.req_id) == ("duplicate_request", 1, "B"), str(err)
    assert len(records) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_review_line_exits_2_in_the_cli_with_verify_kv(tmp_path, backend):
    """`kvmap replay --steps 0:2 --warmup 0 --verify-kv --dump-mappings`: exit 2, the one located line, no dump."""
    from kvmap.cli.app import app

    path, dump = _review_line(tmp_path), tmp_path / "m.jsonl"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            app(args=["replay", str(path), "--backend", backend, "--steps", "0:2", "--warmup", "0", "--verify-kv",
                      "--dump-mappings", str(dump), "--quiet", "--no-progress"], prog_name="kvmap")
            rc = 0
        except SystemExit as e:
            rc = e.code
    assert rc == 2, f"{backend}: exit {rc}, stderr {err.getvalue()!r}"
    assert "step 1, request 'B'" in err.getvalue() and "scheduled twice" in err.getvalue(), err.getvalue()
    assert not dump.exists()
