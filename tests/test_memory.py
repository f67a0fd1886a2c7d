"""Bounded memory (issue 29): replay's per-step records are kept compactly and spilled (run/steplog.py), so a
long trace's peak RSS stays near a short one's, with the same outputs byte for byte; validate keeps the ids of
a whole trace as hashes (validate/idset.py) and bounds the line length it reads on every input form (a file,
gzip, a pipe) and names the line."""

from __future__ import annotations

import gzip
import json
import mmap
import os
import re
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from kvmap.render.report import summary_dict, to_chrome_trace, to_csv
from kvmap.run import steplog
from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.run.stats import phase_stats, warnings
from kvmap.trace import Trace

from .conftest import ROOT, TRACES

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "NVTX_DISABLE": "1"}


def longer(src, dst, times: int) -> int:
    """`src` repeated `times` times, steps renumbered and request ids suffixed per copy (as scripts/
    bench_process.py `longer_trace` does, by text); the number of steps."""
    header, *steps = gzip.open(src, "rt").read().splitlines()
    n = 0
    with open(dst, "w") as out:
        out.write(header + "\n")
        for k in range(times):
            for line in steps:
                out.write(re.sub(r'^\{"step": ?\d+', f'{{"step":{n}', line, count=1).replace('"req-', f'"r{k}-req-')
                          + "\n")
                n += 1
    return n


def _peak_kib(*args: str) -> int:
    """Peak RSS (KiB) of one `kvmap` process, read as the child's ru_maxrss by a small wrapper."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True);"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    p = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "kvmap", *args], capture_output=True,
                       text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr
    return int(p.stdout)


@pytest.fixture(scope="module")
def long_traces(tmp_path_factory):
    """The long bundled trace once and 100 times (191,900 steps, 30,000 request ids: issue 29's 200k-step case)."""
    d = tmp_path_factory.mktemp("long")
    short, long_ = d / "x1.jsonl", d / "x100.jsonl"
    longer(TRACES / "long_mixed.jsonl.gz", short, 1)
    assert longer(TRACES / "long_mixed.jsonl.gz", long_, 100) == 100 * 1919
    return short, long_


def test_replay_peak_rss_stays_flat_on_a_long_trace(long_traces):
    """100 x: peak RSS within 1.2x of the trace once (measured 1.06x with --quiet once the phase times stay on
    disk and the statistics read them a column at a time, 1.21x before; with every step's start kept when no
    output reads it, and the median absolute deviation in float64, 1.29x; every step's clock reads in growing
    arrays took 1.9x)."""
    short, long_ = long_traces
    a, b = _peak_kib("replay", str(short), "--no-progress"), _peak_kib("replay", str(long_), "--no-progress")
    assert b < 1.2 * a, (a, b)


def test_saved_outputs_are_written_without_the_whole_document(long_traces, tmp_path):
    """100 x: `--trace-out`, `--json` and `--html` within 1.25x of the trace once (measured 1.07x, 1.09x and
    1.15x with the phase times, step starts and series on disk, each read a part at a time and let go: ondisk.py;
    before, 1.22x, 1.63x and 1.80x; 21x and 5.5x when the events and the document were lists). What `--html` still
    holds is the figures' data (downsampled, as Python lists) and the page's text."""
    short, long_ = long_traces
    for option in ("--trace-out", "--json", "--html"):
        out = str(tmp_path / "out")
        a = _peak_kib("replay", str(short), "--no-progress", "--quiet", option, out)
        b = _peak_kib("replay", str(long_), "--no-progress", "--quiet", option, out)
        assert b < 1.25 * a, (option, a, b)


def test_validate_peak_rss_stays_flat_on_a_long_trace(long_traces):
    """100 x: peak RSS within 1.15x of the trace once (measured 1.09x; sets of every request id as strings took
    1.44x)."""
    short, long_ = long_traces
    a, b = _peak_kib("validate", str(short)), _peak_kib("validate", str(long_))
    assert b < 1.15 * a, (a, b)


def test_an_id_set_keeps_old_ids_as_hashes(monkeypatch):
    from kvmap.validate import idset

    monkeypatch.setattr(idset, "RECENT", 4)
    s = idset.IdSet()
    for r in ["a", "b", "c", "a", "d"]:  # the 4th distinct id moves all 4 into the hashes
        s.add(r)
    assert s.recent == set() and list(s.hashes) == sorted(hash(r) for r in "abcd") and len(s) == 4
    s.add("e")
    s.add("b")  # kept once: among the hashes already
    assert s.recent == {"e"} and len(s) == 5
    assert all(r in s for r in "abcde") and "f" not in s
    s.discard("c")  # from the hashes
    s.discard("e")  # from the recent ids
    s.discard("zz")  # not there: nothing
    assert [r in s for r in "abcde"] == [True, True, False, True, False] and len(s) == 3
    for r in ["c", "x", "y", "z"]:  # merged again: still sorted and distinct
        s.add(r)
    assert list(s.hashes) == sorted(hash(r) for r in "abcdxyz") and len(s) == 4 + 3
    s.clear()
    assert len(s) == 0 and "a" not in s


def _on_disk(a: np.ndarray) -> bool:
    """`a` is a view of a memory map (ondisk.py `mapped`), not an array in memory."""
    base = a.base
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(getattr(base, "obj", base), mmap.mmap)


def test_spilled_records_equal_the_steps_byte_for_byte(monkeypatch, tmp_path):
    """Blocks of 7 steps (every block spilled): the arrays hold exactly the steps replayed; the phase times, step
    starts and series stay on disk; and --json (as the CLI streams it), --csv, the Chrome trace, --html and every
    statistic are the same bytes as from int64 arrays in memory of the same values."""
    from kvmap.files import write_json
    from kvmap.render.html.report import report_html

    monkeypatch.setattr(steplog, "BLOCK", 7)
    r = replay(Trace(TRACES / "preemption_v1.jsonl"), ReplayConfig(nvtx=False, warmup=0))
    assert r.steps.tolist() == list(range(107)) and r.phase_ns.shape == (107, len(r.phases))
    assert (r.phase_ns > 0).all() and (np.diff(r.step_start_ns) > 0).all()
    mapped = ("phase_ns", "step_start_ns", "kv_series", "mix_series")
    assert all(_on_disk(getattr(r, k)) for k in mapped) and not _on_disk(r.steps)
    wide = replace(r, **{k: np.array(getattr(r, k), dtype=np.int64) for k in ("steps", "num_reqs", "num_tokens",
                                                                              *mapped)})  # in memory
    assert json.dumps(r.to_json()) == json.dumps(wide.to_json())
    for x, name in ((r, "disk.json"), (wide, "memory.json")):
        write_json(tmp_path / name, {"summary": summary_dict(x), "result": x.json_fields()})
    assert (tmp_path / "disk.json").read_bytes() == (tmp_path / "memory.json").read_bytes()
    assert to_csv(r) == to_csv(wide) and json.dumps(to_chrome_trace(r)) == json.dumps(to_chrome_trace(wide))
    assert summary_dict(r) == summary_dict(wide) and phase_stats(r) == phase_stats(wide)
    assert warnings(r) == warnings(wide) and report_html(r) == report_html(wide)


def test_released_pages_leave_and_keep_what_was_written(tmp_path):
    """A mapped array read whole holds its pages until `release`; afterwards they are gone from the process, and
    what was written through the map reads back."""
    from kvmap.ondisk import mapped, release

    def file_kib() -> int:  # the process's resident pages of mapped files
        return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("RssFile"))
    with open(tmp_path / "rows", "w+b") as f:
        f.truncate(16 << 20)
        a = mapped(f, np.int32, (4 << 20,))
    before = file_kib()
    a[::1024] = np.arange(4 << 10)  # one value a page: every page in
    assert int(a.sum(dtype=np.int64)) == (4 << 10) * ((4 << 10) - 1) // 2 and file_kib() - before > 12 << 10
    release(a[5:9])  # a view lets the whole map go
    assert file_kib() - before < 4 << 10
    assert a[::1024].tolist() == list(range(4 << 10))
    release(np.zeros(3))  # an array in memory: nothing


def test_a_phase_past_int32_keeps_int64():
    log = steplog.StepLog(1)
    log.add(0, 1, 2, [10, 20])
    log.add(1, 1, 2, [30, 30 + 2**31 + 5])
    steps, reqs, toks, start, phases = log.arrays()
    assert phases.dtype == np.int64 and phases[:, 0].tolist() == [10, 2**31 + 5] and start.tolist() == [10, 30]
    assert steps.tolist() == [0, 1] and reqs.tolist() == [1, 1] and toks.tolist() == [2, 2]


def test_step_starts_are_kept_only_when_an_output_reads_them(monkeypatch):
    """Without --json or --trace-out (`series` off) no step start is held or spilled; every other array and the
    summary are the same as with them."""
    monkeypatch.setattr(steplog, "BLOCK", 7)
    log = steplog.StepLog(1, keep_start=False)
    for k in range(9):
        log.add(k, 1, 2, [10 * k, 10 * k + 3])
    steps, reqs, toks, start, phases = log.arrays()
    assert start.tolist() == [] and steps.tolist() == list(range(9)) and phases[:, 0].tolist() == [3] * 9
    t = Trace(TRACES / "preemption_v1.jsonl")
    full, lean = (replay(t, ReplayConfig(nvtx=False, warmup=0, series=s)) for s in (True, False))
    assert len(full.step_start_ns) == 107 and len(lean.step_start_ns) == 0
    for k in ("steps", "num_reqs", "num_tokens"):
        assert getattr(full, k).tolist() == getattr(lean, k).tolist()
    assert lean.phase_ns.shape == full.phase_ns.shape and set(summary_dict(lean)) == set(summary_dict(full))


@pytest.mark.parametrize("wide_at", [None, 2, 9, 17])
def test_series_rows_spilled_in_blocks_are_the_rows_appended(monkeypatch, wide_at):
    """Blocks of 4 rows (every full block spilled): the rows come back in order, int32 unless some value needs
    int64 (a value past int32 in a spilled block, in the open one, or none)."""
    monkeypatch.setattr(steplog, "BLOCK", 4)
    rows = steplog.Rows(3)
    want = [[k, -k, 7 * k + (2**31 if k == wide_at else 0)] for k in range(19)]
    for row in want:
        rows.extend(row)
    wide_block = -1 if wide_at is None else wide_at // 4  # the block holding the wide value (4: the open one)
    assert len(rows) == 19 and rows.blocks == ["q" if b == wide_block else "i" for b in range(19 // 4)]
    out = rows.take()
    assert out.tolist() == want and out.dtype == (np.int32 if wide_at is None else np.int64)
    assert rows.take().shape == (0, 3) and len(rows) == 0  # taken once: the rows start over


@pytest.mark.parametrize("wide_at", [None, 2, 9, 17])
@pytest.mark.parametrize("parts", [[19], [1, 18], [3, 5, 2, 9], [4, 4, 11], [1] * 19])
def test_series_rows_appended_as_arrays_are_those_appended_one_by_one(monkeypatch, wide_at, parts):
    """`extend_many` over any split of the rows leaves the blocks, their dtypes and the rows `extend` leaves."""
    monkeypatch.setattr(steplog, "BLOCK", 4)
    want = [[k, -k, 7 * k + (2**31 if k == wide_at else 0)] for k in range(19)]
    one, many = steplog.Rows(3), steplog.Rows(3)
    for row in want:
        one.extend(row)
    at = 0
    for n in parts:
        many.extend_many(np.array(want[at : at + n], dtype=np.int64).reshape(-1, 3))
        at += n
    assert (len(many), many.blocks, many.buf.typecode) == (len(one), one.blocks, one.buf.typecode)
    a, b = one.take(), many.take()
    assert b.tolist() == want and b.dtype == a.dtype


def test_trace_out_alone_keeps_the_step_starts_but_no_series():
    t = Trace(TRACES / "preemption_v1.jsonl")
    r = replay(t, ReplayConfig(nvtx=False, warmup=0, series=False, step_starts=True))
    assert len(r.step_start_ns) == 107 and r.kv_series.size == 0 and r.mix_series.size == 0


def test_counts_take_the_narrowest_dtype_that_holds_them():
    log = steplog.StepLog(1)
    log.add(0, 3, 2**15 - 1, [10, 20])
    log.add(1, 2**15, 40, [30, 40])
    steps, reqs, toks, start, phases = log.arrays()
    assert (steps.dtype, reqs.dtype, toks.dtype) == (np.int32, np.int32, np.int16)
    assert reqs.tolist() == [3, 2**15] and toks.tolist() == [2**15 - 1, 40] and phases[:, 0].tolist() == [10, 10]


@pytest.mark.parametrize("n", [1, 7, 8, 9, 127, 128, 129, 1000, (1 << 14) + 1, 3 * (1 << 14) + 5, 200_003])
def test_the_mean_in_us_is_numpys_to_the_bit(n):
    from kvmap.run import stats

    rng = np.random.default_rng(n)
    m = rng.integers(0, 2**31 - 1, (n, 3)) // rng.integers(1, 10**6, (n, 3))
    for ns in (m[:, 1], m[:, 1].astype(np.int32), m.sum(axis=1)):  # a strided column, int32, a derived series
        assert stats.mean_us(ns).tobytes() == (ns / 1e3).mean().tobytes()


@pytest.mark.parametrize("n", [3, 4, 1000, 1001])
@pytest.mark.parametrize("top", [10**4, 2**30 // 3, 2**31 - 1])
def test_median_and_mad_in_doubled_integers_are_the_float_definitions_to_the_bit(n, top):
    """|2 * ns - 2 * median| in place (int32 until twice a value could pass it) halves to the float64 figures."""
    from kvmap.run import stats

    rng = np.random.default_rng(n + top)
    m = rng.integers(0, top, (n, 2)).astype(np.int32 if top < 2**31 - 1 else np.int64)
    before, total = m.copy(), m.sum(axis=1, dtype=np.int64)
    med = float(np.median(total))
    mad = float(np.median(np.abs(total.astype(np.float64) - med)))
    assert stats._median_and_mad(m) == (med, mad)
    assert (m == before).all()  # the result's own array is not touched


def test_row_sums_are_int32_unless_a_sum_could_pass_it():
    from kvmap.run.stats import row_sums

    m = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    assert row_sums(m).tolist() == [1 + 2 + 3, 4 + 5 + 6] and row_sums(m).dtype == np.int32
    assert row_sums(m, [0, 2]).tolist() == [1 + 3, 4 + 6] and row_sums(m, []).tolist() == [0, 0]
    big = np.array([[2**30, 2**30]], dtype=np.int32)  # 2 * 2^30 > int32
    assert row_sums(big).tolist() == [2**31] and row_sums(big).dtype == np.int64


def test_slow_steps_judged_in_parts_are_the_same(monkeypatch):
    from kvmap.run import stats

    rng = np.random.default_rng(7)
    tokens, reqs = rng.integers(1, 2048, 50_000), rng.integers(1, 128, 50_000)
    ns = (5_000 + 3 * tokens + 200 * reqs + rng.normal(0, 300, 50_000)).astype(np.int64)
    ns[rng.integers(0, 50_000, 40)] *= 30
    monkeypatch.setattr(stats, "JUDGE_CHUNK", 1 << 20)
    whole = stats.slow_steps(ns, tokens, reqs)
    monkeypatch.setattr(stats, "JUDGE_CHUNK", 999)
    parts = stats.slow_steps(ns, tokens, reqs)
    assert len(whole.index) >= 40 and whole.index.tolist() == parts.index.tolist()
    assert whole.model_ns.tobytes() == parts.model_ns.tobytes()


def test_distinct_ids_count_each_id_once():
    ids = steplog.DistinctIds()
    for i in range(3 * steplog.BLOCK):
        ids.update([f"req-{i % 1000}", f"req-{i % 1000}"])
    assert len(ids) == 1000 and len(ids.hashes) == 1000


# ------------------------------------------------------------------------ validate: a line past the limit

def _with_long_line(path, opener, n: int) -> None:
    lines = (TRACES / "worked_example.jsonl").read_bytes().splitlines(keepends=True)
    with opener(path, "wb") as f:
        f.writelines(lines[:3])
        for _ in range(n >> 20):
            f.write(b"x" * (1 << 20))
        f.write(b"\n")
        f.writelines(lines[3:])


@pytest.mark.parametrize("opener", [open, gzip.open], ids=["plain", "gzip"])
def test_validate_a_line_past_the_limit_is_one_located_problem(tmp_path, monkeypatch, opener):
    from kvmap.trace import reader
    from kvmap.trace.streams import LINE_MIN
    from kvmap.validate.driver import validate

    monkeypatch.setattr(reader, "available_memory", lambda: (0, "memory"))  # the smallest limit, LINE_MIN
    path = tmp_path / "long.jsonl"
    _with_long_line(path, opener, LINE_MIN + (1 << 20))
    report = validate(Trace(path, warn=lambda m: None))
    assert [(p.kind, p.line) for p in report.problems] == [("json", 4)], report.problems
    assert "runs past 64 MiB without ending" in report.problems[0].message


def test_validate_stdin_with_an_endless_line_names_it(tmp_path):
    """A generator writing one endless line into `kvmap validate -`: one problem at line 4, exit 1."""
    head = "".join((TRACES / "worked_example.jsonl").read_text().splitlines(keepends=True)[:3])
    gen = ("import sys; o = sys.stdout.buffer; o.write(sys.argv[1].encode()); b = b'x' * (1 << 20)\n"
           "while True: o.write(b)")
    g = subprocess.Popen([sys.executable, "-c", gen, head], stdout=subprocess.PIPE)
    try:
        p = subprocess.run([sys.executable, "-m", "kvmap", "validate", "-", "--json", "-"], stdin=g.stdout,
                           capture_output=True, env=ENV, timeout=300)
    finally:
        g.kill()
        g.wait()
    assert p.returncode == 1, p.stderr
    problems = json.loads(p.stdout)["problems"]
    assert [(x["kind"], x["line"]) for x in problems] == [("json", 4)], problems
    assert "without ending" in problems[0]["message"]


# ------------------------------------------------------------------------ a line past the limit: bounded reads

def test_a_long_line_is_read_on_in_pieces_and_refused_at_the_limit(monkeypatch):
    import io

    from kvmap.trace import streams

    monkeypatch.setattr(streams, "LINE_PIECE", 4)
    data = b"0123456789\n" + b"x" * 12 + b"\n" + b"tail"
    f = io.BufferedReader(io.BytesIO(data), 8)
    assert streams.read_rest(f.readline, f.readline(4), 11) == b"0123456789\n"  # 10 + newline: the limit
    assert streams.read_rest(f.readline, f.readline(4), 11) is None  # 11 bytes without their newline: refused
    f = io.BufferedReader(io.BytesIO(data), 8)
    assert streams.read_rest(f.readline, f.readline(4), 64) == b"0123456789\n"
    assert streams.read_rest(f.readline, f.readline(4), 64) == b"x" * 12 + b"\n"
    assert streams.read_rest(f.readline, f.readline(4), 64) == b"tail"  # the data's end


@pytest.mark.parametrize("opener", [open, gzip.open], ids=["plain", "gzip"])
def test_lines_around_a_piece_read_alike(tmp_path, monkeypatch, opener):
    """Lines shorter than, as long as and longer than a piece: the same (line, bytes) as whole reads."""
    from kvmap.trace import streams

    src = TRACES / "worked_example.jsonl"
    path = tmp_path / "t.jsonl"
    with opener(path, "wb") as f:
        f.write(src.read_bytes())
    want = list(Trace(src).raw_lines())
    monkeypatch.setattr(streams, "LINE_PIECE", 64)
    assert list(Trace(path).raw_lines()) == want and max(len(raw) for _, raw in want) > 64


def test_gzip_is_inflated_a_bounded_amount_at_a_time(monkeypatch):
    import io

    from kvmap.trace import streams

    monkeypatch.setattr(streams, "INFLATE_MAX", 1000)
    data = b"x" * 300_000 + b"\n" + bytes(range(256)) * 40
    gz = gzip.compress(data[:100_000]) + gzip.compress(data[100_000:]) + bytes(500)  # two members, zero padding
    src = streams._Gunzip(io.BytesIO(gz))
    sizes = []
    inflate = src.inflater.inflate_some
    src.inflater.inflate_some = lambda d, m: (lambda r: sizes.append(len(r[0])) or r)(inflate(d, m))
    assert io.BufferedReader(src, 4096).read() == data and src.stopped is None
    assert max(sizes) == 1000 and sum(sizes) == len(data)


@pytest.mark.parametrize("opener, stdin", [(open, False), (gzip.open, False), (gzip.open, True)],
                         ids=["plain", "gzip", "gzip-stdin"])
def test_a_line_past_the_limit_is_refused_holding_at_most_the_limit(tmp_path, opener, stdin):
    """The step line limit at its smallest (64 MiB), a line 4 MiB past it: validate's memory grows by about the
    limit (65 MiB measured), not twice it (129 MiB plain and 132 MiB gzip before reads were bounded); a gzip
    stream on `-` is spooled inflating 1 MiB at a time."""
    from kvmap.trace.streams import LINE_MIN

    path = tmp_path / "long.jsonl"
    _with_long_line(path, opener, LINE_MIN + (4 << 20))
    code = ("import resource, sys; from kvmap.trace import reader; reader.available_memory = lambda: (0, 'memory');"
            "from kvmap.trace import Trace; from kvmap.validate.driver import validate;"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
            "r = validate(Trace(sys.argv[1], warn=lambda m: None));"
            "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
            "print(r.problems[0].kind, r.problems[0].line, after - before)")
    with open(path, "rb") as f:
        p = subprocess.run([sys.executable, "-c", code, "-" if stdin else str(path)], stdin=f, capture_output=True,
                           text=True, env=ENV, timeout=300)
    kind, line, grew_kib = p.stdout.split()
    assert (kind, line) == ("json", "4"), p.stderr
    assert int(grew_kib) < 1.5 * (LINE_MIN >> 10), grew_kib
