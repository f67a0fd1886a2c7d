"""Golden `--dump-mappings` bytes: every bundled trace x every built-in backend x both batch orders, recorded
once (`--write`) as sha256 + line count + byte size in tests/data/golden_dumps.json, then checked (the default)
so that a restructure keeps every output byte.

Rules:
- A case is the argv of one `kvmap replay TRACE --backend B [--batch-order v1] [--steps W] --dump-mappings F`
  (plus --quiet --no-progress, which change no dump byte). The golden value is what that command gives: the
  dump's sha256, lines and bytes when it exits 0; its exit code and the first line of its standard error when
  the CLI refuses it (a refusal is recorded, never skipped).
- Triton runs under TRITON_INTERPRET=1 on a machine without a GPU, too slow for CI on whole traces: its cases
  replay a step window (TRITON_WINDOW, WINDOWS), stored with each case. Every other backend replays the whole
  trace.
- Cases run in this process through the Typer app (`kvmap.cli.app.app`, the object `kvmap replay` runs), each
  with its own temporary dump file; `--subprocess` runs each as `python -m kvmap` instead (slow; to confirm).
- The dumps themselves are never stored.

    PYTHONPATH=. python scripts/golden_dumps.py --write   # record today's bytes
    PYTHONPATH=. python scripts/golden_dumps.py           # check; exit 1 and a reproducer per difference
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "traces"
GOLDEN = ROOT / "tests" / "data" / "golden_dumps.json"
BACKENDS = ("numba", "numpy", "reference", "torch", "triton")
ORDERS = (None, "v1")  # None: the default order (mrv2)
EXTRA = ("--quiet", "--no-progress")  # no dump byte depends on these
# (trace name, backend) -> --steps window, for the combinations too slow for a CI run of the whole trace
WINDOWS = {("long_mixed.jsonl.gz", "triton"): "0:40"}
TRITON_WINDOW = "0:12"  # Triton under the interpreter: every other trace replays its first 12 steps


def setup_env() -> None:
    """The environment the tests use (tests/conftest.py): Triton kernels on CPU under the interpreter without a
    GPU, one BLAS and torch thread."""
    if shutil.which("nvidia-smi") is None:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def traces() -> list[Path]:
    return sorted(p for p in TRACES.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))


def window(trace: str, backend: str) -> str | None:
    if (trace, backend) in WINDOWS:
        return WINDOWS[(trace, backend)]
    return TRITON_WINDOW if backend == "triton" else None


def case_key(trace: str, backend: str, order: str | None) -> str:
    return f"{trace}|{backend}|{order or 'default'}"


def case_argv(trace: str, backend: str, order: str | None, dump: str) -> list[str]:
    argv = ["replay", f"traces/{trace}", "--backend", backend]
    if order:
        argv += ["--batch-order", order]
    w = window(trace, backend)
    if w:
        argv += ["--steps", w]
    return argv + ["--dump-mappings", dump, *EXTRA]


def reproducer(trace: str, backend: str, order: str | None) -> str:
    argv = case_argv(trace, backend, order, "/tmp/golden.jsonl")
    env = "TRITON_INTERPRET=1 " if backend == "triton" else ""
    return (f"cd {ROOT} && {env}PYTHONPATH=. python -m kvmap {' '.join(argv)}; echo rc=$?; "
            f"sha256sum /tmp/golden.jsonl; wc -lc /tmp/golden.jsonl")


def run_cli(argv: list[str]) -> tuple[int, str]:
    """Run the CLI in this process: (exit code, standard error)."""
    from kvmap.cli.app import app

    errbuf, outbuf = io.StringIO(), io.StringIO()
    rc = 0
    with contextlib.redirect_stderr(errbuf), contextlib.redirect_stdout(outbuf):
        try:
            app(args=argv, prog_name="kvmap")
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return rc, errbuf.getvalue()


def run_process(argv: list[str]) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "kvmap", *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    return p.returncode, p.stderr


def golden_value(trace: str, backend: str, order: str | None, *, subprocess_mode: bool = False) -> dict:
    """What `kvmap replay` gives on one case (module docstring, rules)."""
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        dump = Path(tmp) / "dump.jsonl"
        argv = case_argv(trace, backend, order, str(dump))
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            rc, err = (run_process if subprocess_mode else run_cli)(argv)
        finally:
            os.chdir(cwd)
        value: dict = {"steps": window(trace, backend)} if window(trace, backend) else {}
        if rc != 0 or not dump.exists():
            first = next((ln for ln in err.splitlines() if ln.strip()), "")
            return {**value, "rc": rc, "stderr": first}
        data = dump.read_bytes()
    return {**value, "rc": 0, "sha256": hashlib.sha256(data).hexdigest(), "lines": data.count(b"\n"),
            "bytes": len(data)}


def all_cases() -> list[tuple[str, str, str | None]]:
    return [(p.name, b, o) for p in traces() for b in BACKENDS for o in ORDERS]


def installed(backend: str) -> bool:
    """Whether the package a backend needs is installed (numpy and the reference need nothing more)."""
    import importlib.util

    need = {"numba": "numba", "torch": "torch", "triton": "triton"}.get(backend)
    return need is None or importlib.util.find_spec(need) is not None


def compute(cases, *, subprocess_mode: bool = False, verbose: bool = False) -> dict[str, dict]:
    got = {}
    for trace, backend, order in cases:
        t0 = time.perf_counter()
        got[case_key(trace, backend, order)] = golden_value(trace, backend, order, subprocess_mode=subprocess_mode)
        if verbose:
            print(f"{time.perf_counter() - t0:7.2f}s {case_key(trace, backend, order)}", file=sys.stderr)
    return got


def differences(want: dict[str, dict], got: dict[str, dict]) -> list[str]:
    """One paragraph per case whose value differs from the golden one (or has none)."""
    out = []
    for key, value in got.items():
        if want.get(key) != value:
            trace, backend, order = key.split("|")
            out.append(f"{trace} backend={backend} order={order}:\n  golden {want.get(key)}\n  now    {value}\n"
                       f"  reproduce: {reproducer(trace, backend, None if order == 'default' else order)}")
    missing = sorted(set(want) - set(got) - {"_about"})
    if missing:
        out.append(f"golden cases no longer computed: {missing}")
    return out


def load_golden() -> dict:
    return json.loads(GOLDEN.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="record the golden values (default: check them)")
    ap.add_argument("--subprocess", action="store_true", help="run each case as its own `python -m kvmap`")
    ap.add_argument("--only", default="", help="check only cases whose key contains this text")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each case's time")
    args = ap.parse_args(argv)
    setup_env()
    cases = [c for c in all_cases() if args.only in case_key(*c) and (args.write or installed(c[1]))]
    t0 = time.perf_counter()
    got = compute(cases, subprocess_mode=args.subprocess, verbose=args.verbose)
    took = time.perf_counter() - t0
    if args.write:
        about = {"what": "sha256, lines and bytes of `kvmap replay TRACE --backend B [--batch-order v1] "
                         "[--steps W] --dump-mappings F --quiet --no-progress`; rc and the first stderr line when "
                         "the CLI refuses", "generated_by": "PYTHONPATH=. python scripts/golden_dumps.py --write",
                 "windows": {f"{t}|{b}": w for (t, b), w in WINDOWS.items()},
                 "triton_window": f"every other trace replays --steps {TRITON_WINDOW} under triton "
                                  "(TRITON_INTERPRET=1 on CPU is slow)"}
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({"_about": about, **got}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got)} cases to {GOLDEN.relative_to(ROOT)} in {took:.1f}s")
        return 0
    want = load_golden()
    want = {k: v for k, v in want.items() if k != "_about" and args.only in k and installed(k.split("|")[1])}
    diffs = differences(want, got)
    for d in diffs:
        print(d)
    print(f"{len(got)} cases, {len(diffs)} differ ({took:.1f}s)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
