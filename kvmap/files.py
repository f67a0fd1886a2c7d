"""Output files: written whole or not at all, never over an input or a special file, errors as one located line.

Rules (one output policy for every command that writes files):
- `check_outputs` runs before any work: an output that is the same file as an input, as another output or as
  the regular file standard error writes to is refused (by device and inode, so links and other spellings are
  caught; character devices such as `/dev/null` may be shared); at most one output is standard output (`-`, or
  a path that is the file standard output already writes, such as `/dev/stdout`); a missing folder, a
  directory, a name too long, a loop of links or a folder kvmap cannot create a file in is refused in
  milliseconds, naming the path.
- A regular file is written to a short temporary name beside its target (`.kvmap-PID-HOST-XXXXXXXX.tmp`: the
  writing process, 4 hex digits of its host's name), with the permissions the umask gives a new file, and
  renamed into place only when complete: an error part-way (a bad step at line 5000, a full disk, SIGTERM)
  leaves the target as it was and no temporary file behind. A symbolic link stays a link: the file it names
  is replaced.
- Only SIGKILL (or a crash of the machine) can leave a temporary file behind: the first output a later run
  writes into that folder removes every one whose process is gone (`os.kill(pid, 0)` finds no such process)
  and was made on this host (a folder shared across hosts or PID namespaces keeps the others, as it keeps names
  without a pid, from older kvmap versions).
- A special file is written in place, never renamed over: standard output, an existing device, FIFO or
  socket, and every path whose links pass through /proc (`/dev/stdout`, `/dev/fd/N`, `/proc/self/fd/N`).
- Every OS error (no space, permission, read-only, name too long, a missing folder) becomes a `KvmapError`
  naming the path: exit 2, no traceback.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import sys
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from kvmap.errors import KvmapError

STDOUT = "-"
_MAX_LINKS = 40  # as the kernel's ELOOP limit
_STAGED = re.compile(r"\.kvmap-([0-9]+)-([0-9a-f]{4})-[^/]+\.tmp\Z")  # a temporary output's name: pid, host
_swept: set[str] = set()  # folders this process has removed stale temporary files from


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _stat(path: str | Path) -> os.stat_result | None:
    try:
        return os.fstat(0) if str(path) == STDOUT else os.stat(path)  # an input `-`: standard input
    except (OSError, ValueError):
        return None


def _fd_stat(fd: int) -> os.stat_result | None:
    try:
        return os.fstat(fd)
    except OSError:
        return None


def _same(a: os.stat_result | None, b: os.stat_result | None) -> bool:
    return a is not None and b is not None and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _through_proc(path: str | Path) -> bool:
    """True when `path` or a link on its way names a file under /proc (a process's descriptors)."""
    p = os.path.abspath(path)
    for _ in range(_MAX_LINKS):
        p = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
        if p == "/proc" or p.startswith("/proc/"):
            return True
        if not os.path.islink(p):
            return False
        p = os.path.join(os.path.dirname(p), os.readlink(p))
    return False


def output_kind(path: str | Path) -> str:
    """"stdout" (`-` or the file standard output writes), "stream" (a special file, written in place) or
    "file" (a regular file or a new name, written whole or not at all)."""
    if str(path) == STDOUT:
        return "stdout"
    st = _stat(path)
    if st is not None and not stat.S_ISCHR(st.st_mode) and _same(st, _fd_stat(1)):
        return "stdout"
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return "stream"
    return "stream" if _through_proc(path) else "file"


def _host() -> str:
    return format(zlib.crc32(os.uname().nodename.encode()) & 0xFFFF, "04x")


def _stage_prefix() -> str:
    """The start of this process's temporary output names (module rules)."""
    return f".kvmap-{os.getpid()}-{_host()}-"


def _gone(pid: int) -> bool:
    """Whether no process `pid` exists (one of another user's exists: PermissionError)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def sweep_stale(folder: str | Path) -> list[str]:
    """Remove the temporary outputs in `folder` of processes of this host that are gone (module rules), once per
    folder and process; the names removed."""
    folder = os.path.realpath(folder)
    if folder in _swept:
        return []
    _swept.add(folder)
    removed = []
    try:
        with os.scandir(folder) as entries:
            names = [e.name for e in entries if e.name.startswith(".kvmap-")]
    except OSError:
        return []
    for name in names:
        m = _STAGED.match(name)
        if m and m[2] == _host() and int(m[1]) > 0 and _gone(int(m[1])):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(name)
            except OSError:  # gone meanwhile, or not ours to remove
                pass
    return removed


def _check_folder(option: str, path: str | Path) -> None:
    """A regular output: not a directory, a name the system takes (not too long, not a loop of links), in a
    folder where kvmap can create its temporary file."""
    try:
        os.stat(path)
    except FileNotFoundError:  # a new name (or a link to one): the folder is checked next
        pass
    except OSError as e:  # too long a name, a loop of links, a path through a file
        raise KvmapError(f"cannot write: {e.strerror or e}", path=str(path), field=option) from None
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise KvmapError("is a directory; give a file name", path=str(path), field=option)
    if not target.parent.is_dir():
        raise KvmapError(f"cannot write: folder {target.parent} does not exist", path=str(path), field=option)
    try:  # the probe the write will need: a temporary name in that folder
        fd, tmp = tempfile.mkstemp(prefix=_stage_prefix(), suffix=".tmp", dir=target.parent)
    except OSError as e:
        raise KvmapError(f"cannot write: {e.strerror or e}", path=str(path), field=option) from None
    os.close(fd)
    _unlink(tmp)


def check_outputs(outputs: dict[str, str | Path | None], inputs: Iterable[str | Path] = ()) -> str | None:
    """Refuse outputs (option name -> path) that would overwrite an input or each other, share standard
    output, or cannot be written; returns the option that writes standard output (None: none does)."""
    seen_in = [(str(p), st) for p in inputs if (st := _stat(p)) is not None]
    seen_out: list[tuple[str, os.stat_result | None, str]] = []  # (option, stat, real path)
    to_stdout: str | None = None
    for option, p in outputs.items():
        if p is None:
            continue
        kind = output_kind(p)
        if kind == "stdout":
            if to_stdout is not None:
                raise KvmapError(f"only one output can be '-' (standard output): {to_stdout} and {option} both "
                                 "are", field=option)
            to_stdout = option
            continue
        st = _stat(p)
        shared = st is not None and stat.S_ISCHR(st.st_mode)  # /dev/null, /dev/full, a terminal
        for name, ist in seen_in:
            if not shared and _same(st, ist):
                raise KvmapError(f"is the input {name!r}: writing it would destroy the input; choose another "
                                 "output name", path=str(p), field=option)
        real = os.path.realpath(p)
        for other, ost, oreal in seen_out:
            if not shared and (_same(st, ost) or real == oreal):
                raise KvmapError(f"is also the {other} output; give each output its own file", path=str(p),
                                 field=option)
        seen_out.append((option, st, real))
        if kind == "file" and _same(st, _fd_stat(2)):  # renamed over, it would take kvmap's messages with it
            raise KvmapError("is the file standard error writes to (2>); give the output its own file",
                             path=str(p), field=option)
        if kind == "file":
            _check_folder(option, p)
        elif st is None or not os.access(p, os.W_OK):
            raise KvmapError("cannot write: " + ("permission denied" if st else "no such file"), path=str(p),
                             field=option)
    return to_stdout


def _os_error(e: OSError, path: Path) -> KvmapError:
    return KvmapError(f"cannot write: {e.strerror or e}", path=str(path))


@contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Open `path` for writing whole-or-nothing (see the module rules); text mode unless `mode` has "b"."""
    kind = output_kind(path)
    if kind == "stdout":
        sys.stdout.flush()
        yield sys.stdout.buffer if "b" in mode else sys.stdout
        sys.stdout.flush()
        return
    path = Path(path)
    if kind == "stream":  # a device, FIFO or descriptor: written in place, never replaced
        try:
            with open(path, mode) as f:
                yield f
        except OSError as e:
            raise _os_error(e, path) from None
        return
    with _beside(path) as (fd, _):
        with os.fdopen(fd, mode) as f:
            yield f


@contextmanager
def _beside(path: Path) -> Iterator[tuple[int, str]]:
    """(descriptor, name) of a new temporary file beside regular output `path`, renamed over it when the block
    ends cleanly and removed when it does not."""
    target = Path(os.path.realpath(path))  # a link stays a link: the file it names is replaced
    if target.is_dir():
        raise KvmapError("is a directory; give a file name", path=str(path))
    if not target.parent.is_dir():
        raise KvmapError(f"cannot write: folder {target.parent} does not exist", path=str(path))
    sweep_stale(target.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_stage_prefix(), suffix=".tmp", dir=target.parent)
    except OSError as e:
        raise _os_error(e, path) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        yield fd, tmp
        os.replace(tmp, target)
    except OSError as e:
        _unlink(tmp)
        raise _os_error(e, path) from None
    except BaseException:
        _unlink(tmp)
        raise


@contextmanager
def staged_output(path: str | Path) -> Iterator[Path]:
    """A name another process writes output `path` under (`replay --nproc`: rank 0's dump): a temporary name
    beside a regular file, renamed into place when the block ends cleanly; for standard output or a special
    file, a private temporary file copied into it then. On an error or a signal nothing reaches `path`."""
    if output_kind(path) == "file":
        with _beside(Path(path)) as (fd, tmp):
            os.close(fd)
            yield Path(tmp)
        return
    with tempfile.TemporaryDirectory(prefix="kvmap-") as folder:
        tmp = Path(folder) / "output"
        tmp.touch()
        yield tmp
        with atomic_open(path, "wb") as f, open(tmp, "rb") as src:
            shutil.copyfileobj(src, f)

def _unlink(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def write_json(path: str | Path, obj: object) -> None:
    """`obj` as `json.dump(obj, f, indent=1)` and a newline write it, its numpy arrays and `Stream`s written a
    piece at a time (jsontext.py, imported here: it brings numpy)."""
    from kvmap.jsontext import iter_json

    with atomic_open(path) as f:
        for piece in iter_json(obj):
            f.write(piece)
        f.write("\n")


def write_text(path: str | Path, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def bundled_traces_dir() -> Path:
    """traces/ of the source checkout kvmap runs from (an editable install or the repository itself), else the
    copy a regular install ships inside the package (setup.py `BuildWithTraces`)."""
    here = Path(__file__).resolve().parent
    checkout = here.parent / "traces"
    return checkout if checkout.is_dir() or not (here / "traces").is_dir() else here / "traces"


def bundled_traces() -> dict[str, Path]:
    """Bundled trace name (file name without .jsonl/.jsonl.gz) -> path."""
    d = bundled_traces_dir()
    if not d.is_dir():
        return {}
    out = {}
    for p in sorted(d.iterdir()):
        for ext in (".jsonl.gz", ".jsonl"):
            if p.name.endswith(ext):
                out[p.name[: -len(ext)]] = p
    return out


def resolve_trace(name: str | Path | None) -> Path:
    """A trace argument: a path, or the name of a bundled trace (`long_mixed`), or None for the worked example."""
    if name is None:
        return default_trace()
    p = Path(name)
    if p.exists() or str(name) == STDOUT or os.sep in str(name):
        return p
    bundled = bundled_traces()
    if str(name) in bundled:
        return bundled[str(name)]
    return p  # the reader names the missing file


def default_trace() -> Path:
    p = bundled_traces_dir() / "worked_example.jsonl"
    if not p.exists():
        raise KvmapError("no trace given and the bundled traces/ folder is not beside this kvmap "
                         "(install with `pip install -e .` from the repository, or name a trace)")
    return p
