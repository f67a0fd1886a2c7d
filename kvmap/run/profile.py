"""`kvmap profile`: run a replay under Nsight Systems and read its NVTX ranges back, beside kvmap's own timings.

Rules:
- nsys is found as `--nsys PATH`, `$KVMAP_NSYS`, `nsys` on PATH, or the copy `scripts/get_nsys.sh` unpacks
  into `.tools/nsys`. If there is none, the error says how to get it and offers `--builtin` (the same replay
  with a Chrome trace for Perfetto instead of an .nsys-rep).
- The replay runs as a child process under `nsys profile -t nvtx,osrt` (`cuda` too when a GPU is visible),
  with `--capture-range=nvtx` keyed on the `kvmap_capture` range, which the child wraps around the requested
  steps after the warm-up: the report holds only those steps.
- The child writes its own result (JSON); `nsys stats` gives the NVTX summary; both are returned as data.
- An existing report (or its OUTPUT.sqlite, which `nsys stats` exports beside it) is refused (exit 2, one line)
  unless `--force-overwrite` (nsys's own word for it), checked before anything runs; only then is nsys told to
  overwrite (`-f true`).
- nsys writes the report, and `nsys stats` its OUTPUT.sqlite, in a private folder beside OUTPUT (`staged`); both
  are renamed into place only when the profile and the stats finished: Ctrl-C, SIGTERM or a failure leaves no
  report cut short under the final name (nsys itself writes one when it is stopped).
- Every nsys call runs under a timeout (`--timeout`, default NSYS_TIMEOUT_S; an nsys 2022.4 was seen to hang
  on a small script): when it passes, the process group is killed and the error says what timed out and how
  to raise the limit or use `--builtin`.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvmap.defaults import NSYS_TIMEOUT_S
from kvmap.errors import KvmapError
from kvmap.run.markers import CAPTURE_RANGE, DOMAIN

GET_NSYS = "scripts/get_nsys.sh (unpacks Debian's non-free Nsight Systems into .tools/nsys, no system install)"


def find_nsys(explicit: str | None = None) -> str | None:
    for cand in (explicit, os.environ.get("KVMAP_NSYS")):
        if cand and Path(cand).exists() and not (Path(cand).is_file() and os.access(cand, os.X_OK)):
            raise KvmapError(f"{'' if explicit else '$KVMAP_NSYS: '}{cand} is not an executable file (Nsight "
                             "Systems' program is bin/nsys inside its folder)", field="--nsys" if explicit else None)
        if cand:
            return cand if Path(cand).exists() or shutil.which(cand) else None
    found = shutil.which("nsys")
    if found:
        return found
    local = Path(__file__).resolve().parents[2] / ".tools" / "nsys" / "bin" / "nsys"  # the checkout's root
    return str(local) if local.exists() else None


def nsys_missing(explicit: str | None) -> KvmapError:
    """No nsys to run: the path given that does not exist, or none found; how to get one."""
    return KvmapError(f"{f'{explicit} does not exist' if explicit else 'nsys not found'}. Get it with {GET_NSYS}, "
                      "or pass --nsys PATH; or run `kvmap profile --builtin` for a Perfetto trace without nsys",
                      field="--nsys" if explicit else None)


@contextmanager
def staged(rep: Path) -> Iterator[Path]:
    """The `-o` name for nsys in a private folder beside report `rep` (the same file system: renamed, never
    copied); the report and its .sqlite are renamed to `rep` and `rep`'s .sqlite when the block ends cleanly,
    and the folder is removed either way."""
    target = Path(os.path.realpath(rep))
    with tempfile.TemporaryDirectory(prefix=".kvmap-profile-", dir=target.parent) as folder:
        base = Path(folder) / "report"
        yield base
        os.replace(base.with_suffix(".nsys-rep"), target)
        if base.with_suffix(".sqlite").exists():
            os.replace(base.with_suffix(".sqlite"), rep.with_suffix(".sqlite"))


def check_overwrite(report: Path, force: bool) -> None:
    """Refuse to replace an existing report unless `force`."""
    if not force and (report.exists() or report.is_symlink()):
        raise KvmapError("the report exists: pass --force-overwrite to replace it, or -o another name",
                         path=str(report), field="--output")


@dataclass
class NvtxRange:
    name: str  # without the domain prefix
    instances: int
    total_ns: int
    mean_ns: float
    median_ns: float
    min_ns: int
    max_ns: int


def _cuda_visible() -> bool:
    return bool(shutil.which("nvidia-smi")) and os.environ.get("CUDA_VISIBLE_DEVICES", "x") != ""


def nsys_command(nsys: str, out: Path, replay_args: list[str]) -> list[str]:
    traces = "nvtx,osrt,cuda" if _cuda_visible() else "nvtx,osrt"
    return [nsys, "profile", "-t", traces, "-s", "none", "--cpuctxsw=none", "--capture-range=nvtx",
            f"--nvtx-capture={CAPTURE_RANGE}@{DOMAIN}", "--capture-range-end=stop", "-o", str(out), "-f", "true",
            sys.executable, "-m", "kvmap", "replay", *replay_args, "--nvtx-capture"]


def _run(cmd: list[str], timeout: float, what: str, **kw) -> subprocess.CompletedProcess:
    """Run `cmd` in its own process group; past `timeout` seconds kill the group and say so."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kw) as p:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            import signal

            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate()
            raise KvmapError(f"{what} did not finish within {timeout:g} s and was stopped (nsys can hang; "
                             "raise --timeout, or use --builtin for a Perfetto trace without nsys)",
                             field="--timeout") from None
        except BaseException:
            p.kill()
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)


def run_nsys(nsys: str, out: Path, replay_args: list[str],
             timeout: float = NSYS_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NVTX_DISABLE"}  # a profile needs the ranges
    env["NSYS_NVTX_PROFILER_REGISTER_ONLY"] = "0"
    proc = _run(nsys_command(nsys, out, replay_args), timeout, "nsys profile", env=env)
    rep = out.with_suffix(".nsys-rep") if out.suffix != ".nsys-rep" else out
    if proc.returncode != 0 or not rep.exists():
        if "recording-less" in proc.stderr + proc.stdout:  # markers.py said so in the child
            from kvmap.run.markers import WORKS_WITH, nvtx_version

            raise KvmapError(f"nsys captured nothing: the nvtx package here ({nvtx_version()}) records no ranges "
                             f"under this nsys; {WORKS_WITH}", field="nsys")
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        why = " | ".join(tail) if tail else (f"it exited {proc.returncode} without a word" if proc.returncode else
                                             f"it exited 0 but wrote no report: is {nsys} Nsight Systems?")
        raise KvmapError(f"{nsys} profile failed: {why}", field="--nsys")
    return proc


def nvtx_ranges(nsys: str, rep: Path, timeout: float = NSYS_TIMEOUT_S) -> list[NvtxRange]:
    """The NVTX summary of a report (`nvtx_sum`; `nvtxsum` in nsys 2022-2023), kvmap's domain only."""
    for report in ("nvtx_sum", "nvtxsum"):
        proc = _run([nsys, "stats", "-q", "--force-export=true", "--report", report, "--format", "csv",
                     "-o", "-", str(rep)], timeout, "nsys stats")
        if proc.returncode == 0 and "Range" in proc.stdout:
            break
    else:
        raise KvmapError(f"nsys stats could not read {rep}: {proc.stderr.strip()[-200:]}", field="nsys")
    text = proc.stdout[proc.stdout.index("Time"):] if "Time" in proc.stdout else proc.stdout
    out = []
    for row in csv.DictReader(io.StringIO(text)):
        name = row.get("Range", "")
        if not name.startswith(f"{DOMAIN}:"):
            continue
        g = row.get
        out.append(NvtxRange(name[len(DOMAIN) + 1:], int(g("Instances") or 0), int(float(g("Total Time (ns)") or 0)),
                             float(g("Avg (ns)") or 0), float(g("Med (ns)") or 0), int(float(g("Min (ns)") or 0)),
                             int(float(g("Max (ns)") or 0))))
    return out
