"""Fault injection, family by family (issue #17): kvmap never loses the user's data, never prints a traceback
on hostile input or a failing disk, and ends in bounded time. Inputs are built from the bundled real traces.

Families: data loss (outputs over inputs), write failures, signals, header bombs, quadratic validate,
pipes and streams, truncated files. validate = replay lives in test_faults_validate.py, hostile names in
test_hostile_names.py. Every subprocess has a timeout; the file runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvmap.cli.app import app
from kvmap.errors import TraceError
from kvmap.trace import Trace, parse_header
from kvmap.trace.checks import Where
from kvmap.validate import validate

from .conftest import ROOT, TRACES

runner = CliRunner()
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
WORKED = TRACES / "worked_example.jsonl"
LONG = TRACES / "long_mixed.jsonl.gz"


def kvmap(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "kvmap", *args], capture_output=True, text=True, env=ENV,
                       timeout=timeout, **kw)
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-2000:]
    return p


def one_error(p) -> str:
    """The run failed with exit 2 and exactly one `kvmap: error:` line; returns it."""
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("kvmap: error:"), lines
    return lines[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".kvmap-") or p.name.endswith(".tmp"))


def invoke(*args: str):
    r = runner.invoke(app, list(args))
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r


# ---------------------------------------------------------------------------------- data loss


@pytest.mark.parametrize("args", [
    ("replay", "{t}", "-q", "--dump-mappings", "{t}"),
    ("replay", "{t}", "-q", "--json", "{t}"),
    ("replay", "{t}", "-q", "--csv", "{d}/./t.jsonl"),
    ("replay", "{t}", "-q", "--trace-out", "{t}"),
    ("validate", "{t}", "--json", "{t}"),
    ("replay", "{t}", "-q", "--json", "{d}/hard.jsonl"),
    ("replay", "{t}", "-q", "--dump-mappings", "{d}/sym.jsonl"),
    ("validate", "{d}/sym.jsonl", "--json", "{t}"),
    ("replay", "{t}", "-q", "--json", "{d}/x.json", "--csv", "{d}/x.json"),
    ("replay", "{t}", "-q", "--json", "{d}/x.json", "--dump-mappings", "{d}/link-x.json"),
], ids=lambda a: " ".join(a).replace("{", "").replace("}", ""))
def test_outputs_never_overwrite_inputs(tmp_path, args):
    t = tmp_path / "t.jsonl"
    shutil.copy(WORKED, t)
    os.link(t, tmp_path / "hard.jsonl")
    (tmp_path / "sym.jsonl").symlink_to(t)
    (tmp_path / "x.json").write_text("{}")
    os.link(tmp_path / "x.json", tmp_path / "link-x.json")
    before = digest(t), digest(tmp_path / "x.json")
    r = invoke(*(a.format(t=t, d=tmp_path) for a in args))
    assert r.exit_code == 2, r.output
    assert "destroy the input" in r.output or "its own file" in r.output
    assert (digest(t), digest(tmp_path / "x.json")) == before
    assert leftovers(tmp_path) == []


def test_stdin_input_is_protected_too(tmp_path):
    t = tmp_path / "t.jsonl"
    shutil.copy(WORKED, t)
    before = digest(t)
    with open(t) as f:
        p = kvmap("validate", "-", "--json", str(t), stdin=f)
    assert "destroy the input" in one_error(p) and digest(t) == before


# ---------------------------------------------------------------------------------- write failures


def test_full_device_is_one_line_and_stays_a_device():
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    p = kvmap("replay", str(WORKED), "-q", "--json", "/dev/full")
    assert "No space left" in one_error(p)
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # never replaced by a file (root could)
    p = kvmap("validate", str(WORKED), "--json", "/dev/full")
    assert "No space left" in one_error(p)


@pytest.mark.parametrize("target", ["/proc/kvmap-out.json", "/sys/kvmap-out.json", "{d}/missing/out.json",
                                    "{d}"])
def test_unwritable_targets_are_one_located_line(tmp_path, target):
    target = target.format(d=tmp_path)
    r = invoke("replay", str(WORKED), "-q", "--json", target)
    assert r.exit_code == 2 and r.output.count("kvmap: error:") == 1 and target in r.output, r.output


def test_read_only_folder(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    os.chmod(tmp_path, 0o555)
    try:
        r = invoke("replay", str(WORKED), "-q", "--json", str(tmp_path / "out.json"))
        assert r.exit_code == 2 and "cannot write" in r.output
    finally:
        os.chmod(tmp_path, 0o755)


def test_longest_legal_name_and_umask(tmp_path):
    out = tmp_path / ("a" * 250 + ".json")  # 255 bytes: the temp name beside it must be shorter
    old = os.umask(0o027)
    try:
        r = invoke("replay", str(WORKED), "-q", "--json", str(out), "--csv", str(tmp_path / "s.csv"))
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["summary"]["steps_replayed"] == 4
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert leftovers(tmp_path) == []


def test_dash_is_stdout_for_every_output():
    for args in (["replay", str(WORKED), "-q", "--json", "-"], ["validate", str(WORKED), "--json", "-"]):
        r = invoke(*args)
        assert r.exit_code == 0 and json.loads(r.stdout[r.stdout.index("{"):])


# ---------------------------------------------------------------------------------- signals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_signal_mid_replay_leaves_no_temp_file(tmp_path, sig):
    out = tmp_path / "m.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kvmap", "replay", str(LONG), "--backend", "reference",
                             "--no-progress", "-q", "--dump-mappings", str(out)], cwd=tmp_path, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not leftovers(tmp_path) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)  # wait until the temporary output exists: the replay is writing it
        assert proc.poll() is None and leftovers(tmp_path), "the replay ended before the signal"
        time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 128 + sig and "Traceback" not in err, err
    assert leftovers(tmp_path) == [] and not out.exists()


def test_a_sigkilled_runs_temporary_file_is_removed_by_the_next_run_in_its_folder(tmp_path):
    """SIGKILL runs no handler, so the temporary dump stays; the next run writing into that folder removes it
    (its process is gone) before writing its own output."""
    out = tmp_path / "m.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kvmap", "replay", str(LONG), "--backend", "reference",
                             "--no-progress", "-q", "--dump-mappings", str(out)], cwd=tmp_path, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not leftovers(tmp_path) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None and leftovers(tmp_path), "the replay ended before the signal"
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = leftovers(tmp_path)
    assert left and all(n.startswith(f".kvmap-{proc.pid}-") for n in left) and not out.exists()
    p = subprocess.run([sys.executable, "-m", "kvmap", "replay", str(TRACES / "worked_example.jsonl"), "-q",
                        "--no-progress", "--json", str(tmp_path / "run.json")], env=ENV, capture_output=True)
    assert p.returncode == 0, p.stderr
    assert leftovers(tmp_path) == [] and (tmp_path / "run.json").exists()


def test_only_the_temporary_files_of_gone_processes_of_this_host_are_removed(tmp_path):
    from kvmap import files

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = files._host()
    other = format((int(host, 16) + 1) & 0xFFFF, "04x")
    names = [f".kvmap-{gone.pid}-{host}-abcd1234.tmp",  # removed: its process is gone
             f".kvmap-{os.getpid()}-{host}-abcd1234.tmp",  # kept: this process
             f".kvmap-{gone.pid}-{other}-abcd1234.tmp",  # kept: another host's (a shared folder)
             ".kvmap-abcd1234.tmp",  # kept: no pid (an older kvmap)
             f".kvmap-0-{host}-abcd1234.tmp",  # kept: no process 0
             f"kvmap-{gone.pid}-{host}-abcd1234.tmp", "data.jsonl"]  # kept: not a temporary output
    for n in names:
        (tmp_path / n).write_text("x")
    assert files.sweep_stale(tmp_path) == [names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
    (tmp_path / names[0]).write_text("x")
    assert files.sweep_stale(tmp_path) == []  # once per folder and process


# ---------------------------------------------------------------------------------- header bombs

BOMBS = [  # (header changes, the field the message must name)
    ({"max_num_seqs": 10**7}, "max_num_seqs"),
    ({"max_num_seqs": 2**40}, "max_num_seqs"),
    ({"max_num_seqs": 65536, "max_model_len": 2**24}, "max_num_seqs"),
    ({"max_model_len": 2**40}, "max_model_len"),
    ({"max_model_len": 10**7, "max_num_seqs": 4096}, "max_num_seqs"),
    ({"max_num_batched_tokens": 2**40}, "max_num_batched_tokens"),
    ({"max_num_scheduled_tokens": 10**9}, "max_num_scheduled_tokens"),
    ({"num_gpu_blocks": 2**40}, "num_gpu_blocks"),
    ({"num_gpu_blocks": 2**27}, "num_gpu_blocks"),
    ({"block_size": 2**30}, "block_size"),
    ({"num_speculative_tokens": 10**8}, "num_speculative_tokens"),
    ({"kv_cache_groups": [{"group_id": i, "kind": "full_attention", "block_size": 16} for i in range(5000)]},
     "kv_cache_groups"),
]


def bomb_header(changes: dict) -> dict:
    h = json.loads(WORKED.read_text().splitlines()[0])
    h.update(changes)
    return h


@pytest.mark.parametrize("changes,field", BOMBS, ids=[b[1] + "-" + str(i) for i, b in enumerate(BOMBS)])
def test_header_bomb_refused_fast_in_process(changes, field):
    """The header check and the checks before each allocation, without allocating: under a second."""
    from kvmap.kv.cache import KVGeometry, PagedKVCache
    from kvmap.workers.state import WorkerState

    t0 = time.perf_counter()
    with pytest.raises(TraceError) as e:
        h = parse_header(bomb_header(changes), Where("bomb.jsonl", 1, None))
        WorkerState(h)
        PagedKVCache(h, KVGeometry())
        raise AssertionError("the bomb was accepted")
    assert time.perf_counter() - t0 < 1.0
    assert e.value.field == field and e.value.line == 1, str(e.value)


_BOMB_SCRIPT = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from typer.testing import CliRunner
from kvmap.cli.app import app
out = []
for path in sys.argv[1:]:
    for args in (["replay", path, "-q", "--backend", "numpy"], ["replay", path, "-q", "--kv-heads", "64",
                 "--head-size", "256"], ["validate", path], ["explain", path, "--step", "1"]):
        t0 = time.perf_counter()
        r = CliRunner().invoke(app, args)
        out.append({"args": args, "s": time.perf_counter() - t0, "code": r.exit_code, "output": r.output,
                    "exc": None if r.exception is None or isinstance(r.exception, SystemExit) else repr(r.exception)})
print(json.dumps(out))
"""


def test_header_bombs_under_a_4gib_address_space_limit(tmp_path):
    """Every bomb through replay (also with a large KV geometry), validate and explain under `ulimit -v
    4194304`: no traceback, no MemoryError, and each refusal is one error line in under a second."""
    lines = WORKED.read_text().splitlines()
    paths = []
    for i, (changes, _) in enumerate(BOMBS + [({"num_gpu_blocks": 2**20}, "num_gpu_blocks")]):
        p = tmp_path / f"bomb{i}.jsonl"
        p.write_text("\n".join([json.dumps(bomb_header(changes))] + lines[1:]) + "\n")
        paths.append(str(p))
    p = subprocess.run([sys.executable, "-c", _BOMB_SCRIPT, *paths], capture_output=True, text=True, env=ENV,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    for run in json.loads(p.stdout):
        assert run["exc"] is None, run
        assert "Traceback" not in run["output"] and "MemoryError" not in run["output"], run
        if run["code"] == 2:
            assert run["output"].count("kvmap: error:") == 1 and run["s"] < 1.0, run
        else:
            assert run["code"] in (0, 1), run  # validate checks no memory; a sane header may fit
    refused = [r for r in json.loads(p.stdout) if r["args"][0] == "replay" and "64" not in r["args"]]
    assert all(r["code"] == 2 for r in refused[:len(BOMBS)])


# ---------------------------------------------------------------------------------- quadratic validate


def sharers_trace(path: Path, n: int, per_step: int = 500, bs: int = 16) -> Path:
    """n live requests sharing one full prefix block (block 1), each with its own second block."""
    h = {"kind": "header", "format": "kvmap-vllm-trace/1", "model_runner_protocol": "v2", "block_size": bs,
         "num_gpu_blocks": n + 2, "kv_cache_groups": [{"group_id": 0, "kind": "full_attention", "block_size": bs}],
         "max_num_seqs": n, "max_num_batched_tokens": per_step, "max_model_len": 64, "null_block_id": 0}
    prefix = list(range(100, 100 + bs))
    lines, k = [h], 0
    for step in range(-(-n // per_step)):
        new = []
        for _ in range(min(per_step, n - k)):
            new.append({"req_id": f"r{k}", "prompt_token_ids": prefix + [k], "block_ids": [[1, k + 2]],
                        "num_computed_tokens": bs})
            k += 1
        lines.append({"step": step, "scheduler_output": {
            "scheduled_new_reqs": new, "scheduled_cached_reqs": {"req_ids": [], "resumed_req_ids": [],
                                                                 "new_block_ids": [], "num_computed_tokens": []},
            "num_scheduled_tokens": {r["req_id"]: 1 for r in new}, "total_num_scheduled_tokens": len(new),
            "scheduled_spec_decode_tokens": {}, "finished_req_ids": [], "preempted_req_ids": []},
            "sampled_token_ids": {r["req_id"]: [7] for r in new}})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_validate_is_linear_in_the_sharers_of_a_block(tmp_path):
    times = {}
    for n in (5000, 20000):
        p = sharers_trace(tmp_path / f"s{n}.jsonl", n)
        t0 = time.perf_counter()
        report = validate(Trace(p))
        times[n] = time.perf_counter() - t0
        assert report.valid and report.requests == n
    assert times[20000] < 20 and times[20000] < 8 * times[5000] + 1, times  # quadratic would be 16x


def test_a_conflicting_sharer_is_still_found(tmp_path):
    p = sharers_trace(tmp_path / "s.jsonl", 600)
    L = [json.loads(x) for x in p.read_text().splitlines()]
    L[2]["scheduler_output"]["scheduled_new_reqs"][3]["prompt_token_ids"][0] = 99  # other tokens in block 1
    p.write_text("".join(json.dumps(x) + "\n" for x in L))
    probs = validate(Trace(p)).problems
    assert [(x.kind, x.step, x.req_id) for x in probs] == [("double_allocation", 1, "r503")]


# ---------------------------------------------------------------------------------- pipes and streams


def _feed_fifo(fifo: Path, data: bytes) -> threading.Thread:
    def run():
        try:
            with open(fifo, "wb") as f:
                f.write(data)
        except BrokenPipeError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("source", ["preemption_v1.jsonl", "long_mixed.jsonl.gz"])
def test_fifo_is_read_once(tmp_path, source):
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    feeder = _feed_fifo(fifo, (TRACES / source).read_bytes())
    trace = Trace(fifo)  # header, then two full passes over the steps: the FIFO is read once
    n = sum(1 for _ in trace.steps())
    assert n == sum(1 for _ in trace.steps()) > 0
    feeder.join(timeout=10)
    feeder = _feed_fifo(fifo, (TRACES / source).read_bytes())
    p = kvmap("validate", str(fifo), timeout=120)
    feeder.join(timeout=10)
    assert p.returncode == 0 and p.stdout.startswith("valid:"), p.stdout + p.stderr


def test_stdin_dash_dev_stdin_and_process_substitution(tmp_path):
    gz = LONG.read_bytes()
    with open(LONG, "rb") as f:
        p = kvmap("validate", "-", stdin=f, timeout=120)
    assert p.returncode == 0 and "1919 steps" in p.stdout, p.stdout + p.stderr
    with open(TRACES / "spec_decode.jsonl", "rb") as f:
        p = kvmap("validate", "/dev/stdin", stdin=f)
    assert p.returncode == 0 and "21 steps" in p.stdout
    q = subprocess.run([sys.executable, "-m", "kvmap", "replay", "-", "-q", "--backend", "numpy", "--json", "-"],
                       input=gzip.decompress(gz)[:400_000].rsplit(b"\n", 1)[0] + b"\n", capture_output=True,
                       env=ENV, timeout=120)
    assert q.returncode == 0 and json.loads(q.stdout)["summary"]["steps_replayed"] > 10, q.stderr
    if shutil.which("bash"):
        cmd = f"{sys.executable} -m kvmap validate <(cat {TRACES / 'prefix_caching.jsonl'})"
        r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=ENV, timeout=60)
        assert r.returncode == 0 and "14 steps" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------------------------- truncated files


def _complete_steps(data: bytes) -> int:
    """Steps in the complete lines of a (possibly cut) gzip stream."""
    text = zlib.decompressobj(wbits=31).decompress(data)
    return text.count(b"\n") - 1


@pytest.mark.parametrize("fraction", [0.05, 0.4, 0.999])
def test_cut_gzip_yields_every_complete_step_with_one_warning(tmp_path, fraction):
    data = LONG.read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: int(len(data) * fraction)])
    want = _complete_steps(cut.read_bytes())
    warnings: list[str] = []
    trace = Trace(cut, warn=warnings.append)
    assert sum(1 for _ in trace.steps()) == want and sum(1 for _ in trace.raw_steps()) == want
    assert len(warnings) == 1 and f"{want} complete step(s)" in warnings[0] and f"line {want + 2}" in warnings[0]
    report = validate(Trace(cut, warn=warnings.append))
    assert report.valid and report.steps == want and len(report.warnings) == 1


def test_cut_files_through_the_cli(tmp_path):
    data = LONG.read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 3])
    plain = tmp_path / "cut.jsonl"
    text = (TRACES / "preemption_v1.jsonl").read_text()
    plain.write_text(text[: len(text) // 2])  # mid-line, no newline at the end
    for path in (cut, plain):
        for args in (["validate", str(path)], ["replay", str(path), "-q", "--backend", "numpy"]):
            p = kvmap(*args, timeout=120)
            warns = [x for x in p.stderr.splitlines() if "kvmap: warning:" in x]
            assert p.returncode == 0 and len(warns) == 1 and "ends early" in warns[0], p.stderr


def test_columns_are_characters_of_the_line(tmp_path):
    lines = WORKED.read_text().splitlines()
    lines[2] = lines[2][:267]  # cut at column 268, followed by more lines
    lines[3] = lines[3].replace('"scheduler_output"', '"é€": 1, "scheduler_output": }', 1)
    p = tmp_path / "cols.jsonl"
    p.write_text("\n".join(lines) + "\n")
    probs = validate(Trace(p)).problems
    assert probs[0].kind == "json" and probs[0].line == 3 and "column 268" in probs[0].message, probs[0]
    col = lines[3].index('}', lines[3].index("é€")) + 1
    assert probs[1].line == 4 and f"column {col}" in probs[1].message, probs[1]
    with pytest.raises(TraceError) as e:
        list(Trace(p).steps())
    assert "column 268" in e.value.message and e.value.line == 3


def test_not_utf8_is_one_located_problem(tmp_path):
    raw = WORKED.read_bytes().split(b"\n")
    raw[2] = raw[2].replace(b'"step"', b'"st\xffep"', 1)
    p = tmp_path / "bytes.jsonl"
    p.write_bytes(b"\n".join(raw))
    probs = validate(Trace(p)).problems
    assert [(x.kind, x.line) for x in probs] == [("json", 3)] and "UTF-8" in probs[0].message


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frac=st.floats(0.0, 1.0), gz=st.booleans())
def test_any_cut_reads_every_complete_step(tmp_path, frac, gz):
    """A trace cut at any byte (plain or gzip): every complete step is read and validates, with at most one
    warning; a cut inside the header is one located error."""
    text = (TRACES / "spec_decode.jsonl").read_bytes()
    data = gzip.compress(text, mtime=0) if gz else text
    cut = data[: int(len(data) * frac)]
    p = tmp_path / ("cut.jsonl.gz" if gz else "cut.jsonl")
    p.write_bytes(cut)
    seen = zlib.decompressobj(wbits=31).decompress(cut) if gz else cut
    lines = seen.split(b"\n")
    whole = bool(lines[-1]) and lines[-1] == text.split(b"\n")[len(lines) - 1]  # cut right before a newline
    complete = len(lines) - 1 + whole
    cut_short = cut != data if gz else bool(lines[-1]) and not whole
    warnings: list[str] = []
    if complete < 1:
        with pytest.raises(TraceError) as e:
            Trace(p, warn=warnings.append)
        assert e.value.line == 1
        return
    trace = Trace(p, warn=warnings.append)
    assert sum(1 for _ in trace.steps()) == complete - 1
    report = validate(trace)
    assert report.valid and report.steps == complete - 1
    assert len(warnings) == cut_short, warnings


@pytest.mark.parametrize("lines", [1, 3])
def test_a_gzip_cut_right_before_a_newline_keeps_the_whole_line(tmp_path, lines):
    """A gzip stream cut where a line's bytes are all out but its newline is not (hypothesis found it in
    test_any_cut_reads_every_complete_step): the line is complete, as in a plain file; one warning."""
    text = (TRACES / "spec_decode.jsonl").read_bytes()
    upto = sum(len(x) + 1 for x in text.split(b"\n")[:lines]) - 1  # the last byte before line `lines`'s newline
    z = zlib.compressobj(wbits=31)
    cut = z.compress(text[:upto]) + z.flush(zlib.Z_SYNC_FLUSH)  # a stream that stops there, without its end
    p = tmp_path / "cut.jsonl.gz"
    p.write_bytes(cut)
    warnings: list[str] = []
    trace = Trace(p, warn=warnings.append)
    assert sum(1 for _ in trace.steps()) == lines - 1 and validate(trace).valid
    read = "no complete step read" if lines == 1 else "2 complete step(s) read (steps 0..1)"
    assert len(warnings) == 1 and f"the trace ends early: {read}; it stopped at line {lines + 1}" in warnings[0]


def test_endless_and_padded_streams(tmp_path):
    """An endless stream fails at once; zero padding after a gzip member is ignored, garbage after it is
    where the trace stops (with the one warning)."""
    if Path("/dev/zero").exists():
        t0 = time.perf_counter()
        with pytest.raises(TraceError) as e:
            Trace("/dev/zero")
        assert "not a kvmap trace header" in e.value.message and time.perf_counter() - t0 < 5
    data = LONG.read_bytes()
    for tail, warned in ((b"\0" * 5000, 0), (b"garbage\n", 1)):
        p = tmp_path / "tail.jsonl.gz"
        p.write_bytes(data + tail)
        warnings: list[str] = []
        assert sum(1 for _ in Trace(p, warn=warnings.append).raw_lines()) == 1919 and len(warnings) == warned


def test_overlong_line_is_one_located_error(tmp_path, monkeypatch):
    from kvmap.trace import reader

    monkeypatch.setattr(reader, "LINE_MIN", 4096)
    monkeypatch.setattr(reader, "LINE_MAX", 4096)
    lines = WORKED.read_text().splitlines()
    lines[2] = lines[2].replace('"step"', '"pad": "' + "x" * 5000 + '", "step"', 1)
    p = tmp_path / "long.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as e:
        list(Trace(p).steps())
    assert e.value.line == 3 and "runs past 4 KiB without ending" in e.value.message, e.value


# ---------------------------------------------------------------------------------- bounded memory (issue 29)


def _blank_lines(tmp_path: Path, n: int) -> Path:
    p = tmp_path / f"blank{n}.jsonl.gz"
    with gzip.open(p, "wb") as f:
        f.write(WORKED.read_bytes().splitlines(keepends=True)[0] + b"\n" * n)
    return p


def test_validate_keeps_a_bounded_number_of_problems(tmp_path):
    from kvmap.validate.problems import KEPT_PROBLEMS

    n = KEPT_PROBLEMS + 5000
    report = validate(Trace(_blank_lines(tmp_path, n)))
    assert len(report.problems) == KEPT_PROBLEMS and report.problems.found() == n
    d = report.to_json()
    assert d["by_kind"] == {"json": n} and d["problems_not_kept"] == {"json": 5000} and not d["valid"]
    p = kvmap("validate", str(_blank_lines(tmp_path, n)))
    assert p.returncode == 1 and f"{n} problem(s)" in p.stdout and f"json {n}" in p.stdout, p.stdout


def test_validate_memory_is_flat_in_blank_lines(tmp_path):
    code = ("import resource, sys\nfrom kvmap.trace import Trace\nfrom kvmap.validate import validate\n"
            "r = validate(Trace(sys.argv[1]))\njson = r.to_json()\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    rss = {}
    for n in (20_000, 400_000):
        p = subprocess.run([sys.executable, "-c", code, str(_blank_lines(tmp_path, n))], capture_output=True,
                           text=True, env=ENV, timeout=120)
        assert p.returncode == 0, p.stderr
        rss[n] = int(p.stdout.split()[-1])
    assert rss[400_000] <= 1.25 * rss[20_000], rss
