"""The guards of the kernels compiled without bounds checks, held against the same kernels compiled with them.

kvmap/workers/kernels_cpu.py and kvmap/kv/kernels.py run without numba's bounds checks: each kernel checks its
indices' ranges itself (per call, row, block or slot) and raises IndexError. Here every such kernel, as the
workers load it (the ahead-of-time twin, or the JIT), is run on arguments captured from replays of the bundled
traces and then edited (an index moved to -1, one past or before a dimension, doubled; an array cut short; a
size set to 0 or 1), beside its own source compiled with `boundscheck=True` (the checked form). Rules held:
- whenever the checked form raises, the guarded kernel raises too (a missing guard would be a silent read or
  write of other memory in a user's run);
- whenever the guarded kernel returns, the checked form returned the same value and wrote the same arrays;
- the guarded kernel never writes outside its arrays, even when it raises (each array is a view into a larger
  one whose margins hold a sentinel and reach as far as any index the arguments can make along a 1-D array
  or within a row).
The cases the checked form refuses run in a child process, twice: in margins of -77 (a write shows) and of 1 (a
read past an array then passes for a valid row or count, so the kernel runs on instead of tripping a later
guard). A missing guard whose access lands past the margins takes the child down, and the case is named.
The guarded kernel may refuse what the checked one accepts (a negative index, which numba wraps). Every case
is one seed; a failure names the kernel, the trace and the seed.
"""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest

from kvmap.run.config import ReplayConfig
from kvmap.run.replay import replay
from kvmap.trace import Trace

from .conftest import bundled_traces

nb = pytest.importorskip("numba")

MODULES = ("kvmap.workers.kernels_cpu", "kvmap.kv.kernels")
CALLS_KEPT = 2  # captured calls per kernel, trace and runner (the first ones)
CASES_PER_KERNEL = 1000  # edits spread over a kernel's captured calls (a rarely called kernel gets more a call)
SENTINELS = (-77, 1)  # the margins' values: -77 shows a write; 1, read as a row or count, lets a kernel run on
MAX_REACH = 1 << 22  # elements of margin at most (a missing guard reaching past it may crash the child)


def _loaded():
    from kvmap import aot

    return {m: aot.load(m) for m in MODULES}


def _kernel_name(module: str, export: str) -> str:
    """The kernel an export compiles (`kv_write_u2` -> `kv_write`); a JIT dispatcher is its own name."""
    import importlib

    exports = getattr(importlib.import_module(module), "AOT_EXPORTS", {})
    return exports[export][0] if export in exports else export


@pytest.fixture(scope="module")
def captured():
    """(module, export, kernel, trace name, args) of calls the workers made replaying the short bundled traces,
    with the KV canary written and read back and both runners."""
    loaded = _loaded()
    calls: dict[tuple, list] = defaultdict(list)
    current = {"trace": ""}
    saved = {}
    for module, kernels in loaded.items():
        for name, fn in list(vars(kernels).items()):
            if not callable(fn):
                continue
            saved[(module, name)] = fn

            def wrapper(*args, _fn=fn, _key=(module, name)):
                kept = calls[(*_key, current["trace"])]
                if len(kept) < CALLS_KEPT:
                    kept.append(tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args))
                return _fn(*args)

            setattr(kernels, name, wrapper)
    try:
        for path in bundled_traces():
            if path.name.endswith(".gz"):
                continue
            for order in ("mrv2", "v1"):
                current["trace"] = f"{path.name} ({order})"
                replay(Trace(path), ReplayConfig(backend="numba", batch_order=order, verify_kv=True, nvtx=False,
                                                 warmup=0, series=False))
    finally:
        for (module, name), fn in saved.items():
            setattr(loaded[module], name, fn)
    return [(m, e, _kernel_name(m, e), t, args) for (m, e, t), kept in calls.items() for args in kept], saved


def _checked(module: str, kernel: str):
    """The kernel's source compiled with bounds checks (inlined callees such as `slot_of` take them too)."""
    import importlib

    key = (module, kernel)
    if key not in _CHECKED:
        src = getattr(importlib.import_module(module), kernel)
        _CHECKED[key] = nb.njit(boundscheck=True, nogil=True)(src.py_func)
    return _CHECKED[key]


_CHECKED: dict = {}


def _edit(args: tuple, rng: random.Random) -> tuple[tuple, list[str]]:
    """One or two edits of the captured arguments (arrays copied first)."""
    args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    arrays = [i for i, a in enumerate(args) if isinstance(a, np.ndarray) and a.size]
    dims = sorted({d for a in args if isinstance(a, np.ndarray) for d in a.shape} | {0, 1})
    labels = []
    for _ in range(rng.choice([1, 1, 2])):
        i = rng.randrange(len(args))
        a = args[i]
        if isinstance(a, np.ndarray) and a.size and rng.random() < 0.25:  # cut short along one axis
            ax = rng.randrange(a.ndim)
            keep = rng.randrange(a.shape[ax])
            args[i] = np.ascontiguousarray(np.take(a, range(keep), axis=ax))
            labels.append(f"arg {i} cut to {keep} along axis {ax}")
        elif isinstance(a, np.ndarray) and a.size and a.dtype.kind in "iu":
            at = tuple(rng.randrange(d) for d in a.shape)
            old = int(a[at])
            new = rng.choice([-1, old + 1, old - 1, 2 * old + 1, rng.choice(dims), rng.choice(dims) + 1,
                              rng.choice(dims) - 1])
            info = np.iinfo(a.dtype)
            a[at] = min(max(new, info.min), info.max)
            labels.append(f"arg {i}{list(at)} {old} -> {a[at]}")
        elif isinstance(a, (bool, np.bool_)):
            args[i] = not a
            labels.append(f"arg {i} flipped")
        elif isinstance(a, np.unsignedinteger):  # the canary's bit mask: not an index
            continue
        elif isinstance(a, (int, np.integer)):
            args[i] = type(a)(rng.choice([0, 1, -1, int(a) + 1, int(a) - 1, 2 * int(a)]))
            labels.append(f"arg {i} {a} -> {args[i]}")
        elif arrays:
            j = rng.choice(arrays)
            args[j] = args[j][: args[j].shape[0] // 2].copy()
            labels.append(f"arg {j} halved")
    return tuple(args), labels


def _reach(args: tuple) -> int:
    """How far past an array an access can land, in elements: twice the largest dimension or integer argument
    (the canary's bit mask, unsigned, is no index).
    Every index the kernels form is below a dimension of some argument (a row, a block id, a slot, a position)
    or a sum of two such, and an edit at most doubles a value and adds one."""
    values = [abs(int(a)) for a in args if isinstance(a, (int, np.integer)) and not isinstance(a, np.unsignedinteger)]
    values += [d for a in args if isinstance(a, np.ndarray) for d in a.shape]
    return min(2 * max(values, default=0) + 8, MAX_REACH)


def _in_margins(a: np.ndarray, reach: int, sentinel: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(parent, view, pad): `a` copied into the middle of a larger C-ordered array, `pad` entries of axis 0 of
    `sentinel` on either side: enough for an index `reach` past the end of a 1-D array, or of axis 1 (which moves
    `shape[2:]`'s product of elements); a row index of a 2-D or 3-D array that far past would need `reach` rows,
    too many for the token table, so such an access can land past the margins (in the child run, which then
    names the case). The view is C-contiguous, as the kernels' buffers are."""
    pad = (-(-reach // max(1, a.shape[1])) if a.ndim > 1 else reach) + 1
    parent = np.empty((a.shape[0] + 2 * pad, *a.shape[1:]), dtype=a.dtype)
    parent[...] = np.array(sentinel).astype(a.dtype)
    view = parent[pad: pad + a.shape[0]]
    view[...] = a
    return parent, view, pad


def _margins_intact(parent: np.ndarray, pad: int, sentinel: int) -> bool:
    sentinel = np.array(sentinel).astype(parent.dtype)
    return bool((parent[:pad] == sentinel).all() and (parent[parent.shape[0] - pad:] == sentinel).all())


def _run(fn, args):
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - compared below
        return None, e


def _guarded_call(fn, edited: tuple, sentinel: int = SENTINELS[0]):
    """(result, error, wrote outside, the arrays as the kernel left them) of the guarded kernel on `edited`,
    each array in margins of `sentinel`."""
    parents, views = [], []
    reach = _reach(edited)
    for a in edited:
        if isinstance(a, np.ndarray):
            parent, view, pad = _in_margins(a, reach, sentinel)
            parents.append((parent, pad))
            views.append(view)
        else:
            views.append(a)
    got, err = _run(fn, tuple(views))
    return got, err, not all(_margins_intact(q, pad, sentinel) for q, pad in parents), views


def _refused_in_a_child(cases: list, tmp_path) -> list[tuple[str, bool] | None]:
    """Run the cases the checked form refused in a child process, one by one, once in each of SENTINELS' margins
    (a read past an array must not pass for a value either): (the guarded kernel's error type, or '' if one
    run returned; wrote outside in either run) for each, None for the case that ended the child and those after it (a
    missing guard can land outside the margins and crash a process: then it is this child's, and the case
    is named)."""
    import pickle
    import subprocess
    import sys

    from .conftest import ROOT

    path = tmp_path / "refused.pkl"
    path.write_bytes(pickle.dumps([(module, export, edited) for module, export, edited in cases]))
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.test_kernels_guarded", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    results: list[tuple[str, bool] | None] = [None] * len(cases)
    for line in proc.stdout.splitlines():
        if line.startswith("done "):
            _, i, kind, outside = line.split(" ")
            results[int(i)] = ("" if kind == "-" else kind, outside == "1")
    return results


def test_the_guards_refuse_whatever_bounds_checks_refuse(captured, tmp_path):
    calls, guarded = captured
    kernels_seen = {k for _, _, k, _, _ in calls}
    expected = {"batch_order", "prepare_inputs", "gather_block_table", "slot_mapping", "scatter", "positions_fit",
                "append_tokens", "kv_write", "kv_verify_dcp", "slot_mapping_dcp", "dcp_local_seq_lens",
                "null_history"}
    assert expected <= kernels_seen, sorted(expected - kernels_seen)
    failures, counts, refused = [], defaultdict(lambda: [0, 0]), []
    calls_of = defaultdict(int)
    for _, _, kernel, _, _ in calls:
        calls_of[kernel] += 1
    for n, (module, export, kernel, trace, args) in enumerate(calls):
        for k in range(-(-CASES_PER_KERNEL // calls_of[kernel])):
            seed = n * 1000 + k
            edited, labels = _edit(args, random.Random(seed)) if k else (args, ["as captured"])
            where = f"{kernel} ({export}) on {trace}, case {seed}: {'; '.join(labels)}"
            ref_args = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in edited)
            ref, ref_err = _run(_checked(module, kernel), ref_args)
            if ref_err is not None:  # run where a missing guard cannot take this process down
                failures += [f"{where}: a captured call raised {ref_err!r}"] if k == 0 else []
                refused.append((where, kernel, module, export, edited, ref_err))
                continue
            got, err, outside, views = _guarded_call(guarded[(module, export)], edited)
            counts[kernel][isinstance(err, IndexError)] += 1
            if k == 0 and err is not None:
                failures.append(f"{where}: a captured call raised {err!r}")
            if err is None and not (np.array_equal(np.asarray(got), np.asarray(ref)) and all(
                    np.array_equal(v, r) for v, r in zip(views, ref_args) if isinstance(v, np.ndarray))):
                failures.append(f"{where}: the guarded kernel's results differ from the checked form's")
            if outside:
                failures.append(f"{where}: the guarded kernel wrote outside its array")
    results = _refused_in_a_child([(m, e, a) for _, _, m, e, a, _ in refused], tmp_path)
    for (where, kernel, *_, ref_err), result in zip(refused, results):
        if result is None:
            failures.append(f"{where}: the checked form raised {ref_err!r}; the guarded kernel crashed the process "
                            "(or ran after the case that did)")
            break
        kind, outside = result
        counts[kernel][kind == "IndexError"] += 1
        if not kind:
            failures.append(f"{where}: the checked form raised {ref_err!r}, the guarded kernel did not")
        if outside:
            failures.append(f"{where}: the guarded kernel wrote outside its array")
    print("guarded kernels (calls returned, refused):", {k: tuple(v) for k, v in sorted(counts.items())})
    assert not failures, f"{len(failures)} failures; the first:\n" + "\n".join(failures[:5])
    assert all(v[0] and v[1] for v in counts.values()), "every kernel both accepts and refuses some edits"


if __name__ == "__main__":  # the child of _refused_in_a_child: python -m tests.test_kernels_guarded CASES
    import pickle
    import sys

    kernels = _loaded()
    for i, (module, export, edited) in enumerate(pickle.loads(open(sys.argv[1], "rb").read())):
        print(f"start {i}", flush=True)
        runs = [_guarded_call(getattr(kernels[module], export), edited, sentinel) for sentinel in SENTINELS]
        kinds = {type(err).__name__ if err is not None else "-" for _, err, _, _ in runs}
        kind = "-" if "-" in kinds else sorted(kinds)[0]
        print(f"done {i} {kind} {int(any(outside for _, _, outside, _ in runs))}", flush=True)
