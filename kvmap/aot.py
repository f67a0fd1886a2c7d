"""Ahead-of-time compiled kernels: numba's kernels built into an extension module at install, loaded at once.

A kernel module (`kvmap/workers/kernels_cpu.py`, `kvmap/kv/kernels.py`, `kvmap/forward/kernels.py`) stays the
one source of its kernels, written for numba's JIT. It declares `AOT_EXPORTS` (exported name -> (kernel,
signature)) and `AOT_SOURCES` (the files its machine code depends on), and `AOT_BOUNDSCHECK = True` when its
kernels are compiled with bounds checks (the twin then is too, as its JIT kernels are). `build` compiles those
exports with `numba.pycc` into a twin extension module next to it (`_<name>_aot`): setup.py does it at
install, `python -m kvmap.aot` by hand. `load` then hands out the twin without importing numba or setting up
its type system (docs/performance.md, "Start-up"), or the JIT module when the twin is missing or was built
from other sources.

Rules:
- The twin is used only if its `source_hash()` equals the hash of the sources on disk now: an edited kernel
  never runs stale machine code (it runs under the JIT, which recompiles it). It is compiled for the CPU it
  was built on (as numba's JIT compiles for the host), so it is used only on a CPU with the same model and
  feature flags (`cpu_hash()`): an environment copied to another machine falls back to the JIT, not to an
  illegal instruction.
- A compiled export trusts its arguments (dtype, rank, contiguity are not checked: a wrong one reads the
  wrong memory). The signatures are the dtypes the workers' preallocated buffers have by construction;
  `KVMAP_CHECK_KERNELS=1` (set by the test suite) wraps every export in a check of its declared signature.
- An export with a dtype in its name (`kv_write_u2`) is one variant of a kernel that the JIT specializes
  per dtype; `Kernels.variant(name, dtype)` picks it once, outside the hot path.
"""

from __future__ import annotations

import importlib
import os
import re
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent  # the kvmap package folder
AOT_SUFFIX = "_aot"


def source_hash(sources: tuple[str, ...]) -> int:
    """A signed 64-bit fingerprint of the source files (paths relative to the kvmap package): CRC-32 and
    Adler-32 of their bytes (zlib is loaded anyway; hashlib would add 6 ms to every start). It tells an edited
    kernel from the one compiled; it is not a defence against a crafted file."""
    data = b"".join(rel.encode() + b"\0" + (ROOT / rel).read_bytes() + b"\0" for rel in sources)
    value = (zlib.crc32(data) << 32) | zlib.adler32(data)
    return value - (1 << 64) if value >= 1 << 63 else value


_FINGERPRINT: list[str] = []


def cpu_fingerprint() -> str:
    """The machine, and on Linux the first CPU's model and feature flags (what `target_cpu='host'` compiles
    for), read without importing llvmlite; once per process."""
    if not _FINGERPRINT:
        _FINGERPRINT.append(_read_fingerprint())
    return _FINGERPRINT[0]


def _read_fingerprint() -> str:
    import platform

    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.partition(":")[0].strip()
                if key in ("model name", "flags", "Features", "CPU part"):
                    parts.append(line.strip())
                elif not line.strip():  # the end of the first CPU's block
                    break
    except OSError:
        pass
    return "\n".join(parts)


def cpu_model() -> str:
    """The first CPU's model name from /proc/cpuinfo, else the machine (`x86_64`): `platform.processor()`
    without its `uname -p` subprocess (19 ms of every replay, measured), and more telling."""
    for line in cpu_fingerprint().splitlines()[1:]:
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return cpu_fingerprint().splitlines()[0]


_CPU_HASH: list[int] = []


def cpu_hash() -> int:
    """crc32 of `cpu_fingerprint()`, read once per process."""
    if not _CPU_HASH:
        _CPU_HASH.append(zlib.crc32(cpu_fingerprint().encode()))
    return _CPU_HASH[0]


def twin_name(module: str) -> str:
    """kvmap.kv.kernels -> kvmap.kv._kernels_aot"""
    pkg, _, leaf = module.rpartition(".")
    return f"{pkg}._{leaf}{AOT_SUFFIX}"


# -------------------------------------------------------------------------------------------- signatures

_DTYPES = {"i4": "int32", "i8": "int64", "u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64",
           "b1": "bool"}
_ARRAY = re.compile(r"^(\w+)\[([^\]]*)\]$")


def _split_args(sig: str) -> tuple[str, list[str]]:
    """'i8(i4[::1], UniTuple(i8, 2))' -> ('i8', ['i4[::1]', 'UniTuple(i8, 2)']) (top-level commas only)."""
    depth, start = 0, len(sig) - 1
    for start in range(len(sig) - 1, -1, -1):  # the "(" that matches the final ")": the argument list
        depth += {")": 1, "(": -1}.get(sig[start], 0)
        if depth == 0:
            break
    ret, body, depth, cur, out = sig[:start], sig[start + 1:-1], 0, "", []
    for ch in body:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return ret.strip(), out


def _checker(name: str, sig: str, fn):
    """`fn` with each argument checked against `sig` (dtype, rank, C order for arrays; int or bool scalars;
    exactly `bytes` for a Bytes argument)."""
    import numpy as np

    _, args = _split_args(sig)
    specs = []
    for a in args:
        m = _ARRAY.match(a)
        if a.startswith("Bytes("):  # a bytes object, read in place (its trailing zero byte is a sentinel)
            specs.append((bytes, None, None))
        elif m:
            dims = m.group(2).split(",")
            specs.append((np.dtype(_DTYPES[m.group(1)]), len(dims), dims[-1].strip() == "::1"))
        else:
            specs.append((None, _DTYPES.get(a, a), None))

    def checked(*values):
        if len(values) != len(specs):
            raise TypeError(f"{name}: {len(values)} arguments, the signature {sig} has {len(specs)}")
        for i, (v, (dtype, rank, contiguous)) in enumerate(zip(values, specs)):
            if dtype is bytes:
                if type(v) is not bytes:
                    raise TypeError(f"{name}: argument {i} is {type(v).__name__}, the signature says {args[i]}")
                continue
            if dtype is None:
                ok = isinstance(v, (bool, np.bool_)) if rank == "bool" else (
                    isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)))
                if not ok:
                    raise TypeError(f"{name}: argument {i} is {type(v).__name__}, the signature says {args[i]}")
                continue
            if not isinstance(v, np.ndarray) or v.dtype != dtype or v.ndim != rank or (
                    contiguous and not v.flags.c_contiguous):
                got = f"{v.dtype}[{v.ndim}d, {'C' if v.flags.c_contiguous else 'strided'}]" if isinstance(
                    v, np.ndarray) else type(v).__name__
                raise TypeError(f"{name}: argument {i} is {got}, the signature says {args[i]}")
        return fn(*values)

    checked.__name__ = name
    return checked


# ------------------------------------------------------------------------------------------------ loading

class Kernels:
    """The kernels of one module: the ahead-of-time twin's exports or the JIT module's dispatchers, by name.
    `kind`: 'ahead-of-time' or 'jit'."""

    def __init__(self, kind: str, fns: dict) -> None:
        self.kind = kind
        self.__dict__.update(fns)

    def variant(self, name: str, dtype) -> object:
        """The export of kernel `name` for an array dtype ('uint16' -> name_u2 ... as declared), or the JIT
        dispatcher (which specializes itself)."""
        if self.kind == "jit":
            return getattr(self, name)
        import numpy as np

        code = {v: k for k, v in _DTYPES.items()}[np.dtype(dtype).name]
        return getattr(self, f"{name}_{code}")


_LOADED: dict[str, Kernels] = {}
_STAMPS = ("source_hash", "cpu_hash")  # a twin's own exports that say what it was built from


def load(module: str) -> Kernels:
    """The kernels of `module` (a kernel module's dotted name): its twin when built from the sources on disk
    for this CPU, else the module itself under numba's JIT (a located KvmapError if numba is missing too)."""
    if module in _LOADED:
        return _LOADED[module]
    kernels = twin = None
    if os.environ.get("KVMAP_AOT", "1") != "0":
        try:
            twin = importlib.import_module(twin_name(module))
        except ImportError:
            twin = None
        if twin is not None and twin.source_hash() == source_hash(_sources(module)) \
                and twin.cpu_hash() == cpu_hash():
            fns = {n: getattr(twin, n) for n in dir(twin) if not n.startswith("_") and n not in _STAMPS}
            if os.environ.get("KVMAP_CHECK_KERNELS") == "1":
                exports = _spec(module)["AOT_EXPORTS"]
                assert set(fns) == set(exports), (module, sorted(fns), sorted(exports))
                fns = {n: _checker(n, exports[n][1], f) for n, f in fns.items()}
            kernels = Kernels("ahead-of-time", fns)
    if kernels is None:
        spec = _spec(module)
        try:
            jit = importlib.import_module(module)
        except ImportError as e:
            from kvmap.errors import KvmapError

            why = ("turned off (KVMAP_AOT=0)" if os.environ.get("KVMAP_AOT", "1") == "0" else "missing"
                   if twin is None else "built from other sources or for another CPU")
            raise KvmapError(f"the compiled kernels ({twin_name(module)}) are {why} and numba cannot load "
                             f"({e}): pip install numba, rebuild with `python -m kvmap.aot`, or use --backend "
                             "numpy", field="--backend") from None
        names = {k for k, _ in spec["AOT_EXPORTS"].values()}
        kernels = Kernels("jit", {n: getattr(jit, n) for n in names})
    _LOADED[module] = kernels
    return kernels


def _path(module: str) -> Path:
    return ROOT / (module.removeprefix("kvmap.").replace(".", "/") + ".py")


def _sources(module: str) -> tuple[str, ...]:
    """A kernel module's AOT_SOURCES, from its one line (every start reads it: no import, no parse)."""
    for line in _path(module).read_text().splitlines():
        if line.startswith("AOT_SOURCES = "):
            return tuple(re.findall(r'"([^"]+)"', line))
    return ()


def _spec(module: str) -> dict:
    """A kernel module's AOT_* declarations, read without importing it (importing it imports numba)."""
    import ast

    tree = ast.parse(_path(module).read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id.startswith("AOT_"):
            out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


# -------------------------------------------------------------------------------------------------- build

def build(module: str, out_dir: str | os.PathLike, target_cpu: str = "host", verbose: bool = False) -> Path:
    """Compile `module`'s AOT_EXPORTS with numba.pycc into its twin in `out_dir` (imports numba). Returns the
    file written."""
    from numba.pycc import CC

    jit = importlib.import_module(module)
    spec = _spec(module)
    basename = twin_name(module).rpartition(".")[2]
    cc = CC(basename)
    cc.output_dir = str(out_dir)
    cc.target_cpu = target_cpu
    cc.verbose = verbose
    for name, (kernel, sig) in spec["AOT_EXPORTS"].items():
        cc.export(name, sig)(getattr(jit, kernel).py_func)
    ns: dict = {}
    exec(f"def source_hash():\n    return {source_hash(spec['AOT_SOURCES'])}\n"
         f"def cpu_hash():\n    return {cpu_hash()}\n", ns)
    cc.export("source_hash", "i8()")(ns["source_hash"])
    cc.export("cpu_hash", "i8()")(ns["cpu_hash"])
    os.makedirs(out_dir, exist_ok=True)
    from numba.core import config

    saved = config.BOUNDSCHECK
    if spec.get("AOT_BOUNDSCHECK"):  # numba.pycc takes no per-export flags: the global switch, for this module
        config.BOUNDSCHECK = 1
    try:
        cc.compile()
    finally:
        config.BOUNDSCHECK = saved
    return Path(out_dir) / (basename + _ext_suffix())


def _ext_suffix() -> str:
    import sysconfig

    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


KERNEL_MODULES = ("kvmap.workers.kernels_cpu", "kvmap.kv.kernels", "kvmap.forward.kernels",
                  "kvmap.run.occupancy_kernels")


def twins_on_disk() -> bool:
    """Whether every twin is installed and not turned off (KVMAP_AOT=0), looked up without importing it
    (its sources and CPU are checked at load)."""
    import importlib.util

    return os.environ.get("KVMAP_AOT", "1") != "0" and all(
        importlib.util.find_spec(twin_name(m)) is not None for m in KERNEL_MODULES)


def available() -> bool:
    """Whether the compiled kernels can load, without importing them or numba: the twins are on disk or
    numba is installed."""
    import importlib.util

    return twins_on_disk() or importlib.util.find_spec("numba") is not None


def main() -> None:
    """python -m kvmap.aot: rebuild every twin in place (after editing a kernel, to skip the JIT again)."""
    import time

    for module in KERNEL_MODULES:
        t = time.perf_counter()
        out = build(module, _path(module).parent)
        print(f"{out.relative_to(ROOT.parent)}  ({time.perf_counter() - t:.1f} s)")


if __name__ == "__main__":
    main()
