"""`kvmap validate --deep`: replay through the backends against the reference, with the KV canary read back.

Rules: the reference replays first; any other backend that loads is compared step by step on the dump record
(the core mappings and the forward inputs, kvmap/forward, by the header's runner: the reference's scalar specs
against the backend's forms) and its KV cache is read back every step. A backend's summary names who built
each forward part it produced (`forward_parts`: its own code, e.g. vLLM's, for `native_forward_parts`, kvmap's
host forms for the rest; None for a backend of the core mappings only, compared on those). Problems name the
step, request, token and group of the first difference, with the chain `kvmap explain` prints for it. Each
pass runs inside `progress(label, backend)`, a context giving the pass's `on_step` (the CLI's progress bar at a
terminal; None: nothing drawn).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict

from kvmap.errors import KvmapError
from kvmap.trace import Trace
from kvmap.validate import multirank
from kvmap.validate.problems import Problem
from kvmap.workers.mappings import DUMP_KEYS

Progress = Callable[..., AbstractContextManager]  # (label, backend) -> a context giving on_step or None


def _no_progress(label: str, backend: str | None = None) -> AbstractContextManager:
    return nullcontext()


# forward dump keys with one entry per KV-cache group (graph_parts' Attention and Backends)
FORWARD_GROUP_KEYS = frozenset((
    "reorder_batch_threshold", "num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens",
    "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "max_num_splits", "dcp_context_kv_lens",
    "max_dcp_context_kv_len"))
# per-group forward keys whose entries follow the batch rows: key -> entry index - row (indptr: row b ends at b + 1)
FORWARD_ROW_KEYS = {"paged_kv_last_page_len": 0, "dcp_context_kv_lens": 0, "paged_kv_indptr": 1}


def first_difference(got: dict, want: dict) -> dict:
    """Locate the first difference of two dump records: field, and where known batch request, token, group."""
    key = next(k for k in want if got.get(k) != want[k])
    where: dict = {"field": key}
    g_val, w_val = got.get(key), want[key]
    qsl = want["query_start_loc"]
    if key == "slot_mapping" and "dcp_local_seq_lens" in want and len(g_val) == len(w_val):  # [cp][G][T]
        where["rank"] = next(r for r in range(len(w_val)) if g_val[r] != w_val[r])
        g_val, w_val = g_val[where["rank"]], w_val[where["rank"]]
    if (key in ("slot_mapping", "block_tables") or key in FORWARD_GROUP_KEYS) and isinstance(g_val, list) \
            and len(g_val) == len(w_val):
        where["group"] = next(g for g in range(len(w_val)) if g_val[g] != w_val[g])
        g_val, w_val = g_val[where["group"]], w_val[where["group"]]
    if isinstance(g_val, list) and isinstance(w_val, list):
        n = min(len(g_val), len(w_val))
        i = next((j for j in range(n) if g_val[j] != w_val[j]), n)
        b = i - FORWARD_ROW_KEYS.get(key, 0)  # the batch row of entry i
        if key in ("positions", "input_ids", "slot_mapping") and i < want["query_start_loc"][-1]:
            b = max(j for j in range(len(qsl) - 1) if qsl[j] <= i)
            where.update(batch_idx=b, req_id=want["req_ids"][b], token=i - qsl[b])
        elif (key in ("req_ids", "idx_mapping", "seq_lens", "block_tables") or key in FORWARD_ROW_KEYS) \
                and 0 <= b < len(want["req_ids"]):
            where.update(batch_idx=b, req_id=want["req_ids"][b])
        where["got"] = g_val[i] if i < len(g_val) else None
        where["want"] = w_val[i] if i < len(w_val) else None
    return where


def _chain(trace: Trace, step: int, where: dict) -> list[str]:
    """The reference chain `kvmap explain` prints for the token (or request) that differs."""
    from kvmap.explain import explain

    if "req_id" not in where:
        return []
    try:
        d = explain(trace, step, where["req_id"], where.get("token"), where.get("group"))
    except KvmapError:
        return []
    tok = d.get("token")
    if tok is None:
        return []
    return tok["links"] + [link for g in tok["groups"] for link in g["links"]]


def compare_backend(trace: Trace, backend: str, ref: list[dict], max_problems: int = 5,
                    on_step: Callable[[int], None] | None = None) -> tuple[dict, list[dict]]:
    """Replay `backend` against the reference dumps `ref` with the KV canary read back every step."""
    from kvmap.run.config import ReplayConfig
    from kvmap.run.replay import replay, v1_reorder
    from kvmap.workers.registry import make_worker

    order = trace.header.runner or "mrv2"  # the reference `ref` was replayed in this order
    worker = make_worker(backend, trace.header)
    if worker.native_batch_order != "mrv2":  # a runner with its own batch order: the reference in that order
        if worker.native_batch_order != order:
            order, ref = worker.native_batch_order, []
            replay(trace, ReplayConfig(backend="reference", write_kv=False, nvtx=False, warmup=0, forward=True,
                                       batch_order=order), on_mappings=ref.append)
    if order != "mrv2":  # V1: with the reorder threshold of the header's backends, as the reference's replay
        worker.use_batch_order(order, v1_reorder(trace.header) if order == "v1" else None)
    got: list[dict] = []
    problems: list[dict] = []
    try:
        kv = replay(trace, ReplayConfig(verify_kv=True, nvtx=False, warmup=0, forward=worker.computes_forward,
                                        batch_order=order), worker=worker,
                    on_mappings=got.append, on_step=on_step)
    except KvmapError as e:
        problems.append(asdict(Problem("conformance", f"{backend} failed: {e.message}", e.line, e.step, e.req_id,
                                       e.group, e.field)))
        return {"steps": len(got), "differing_steps": None, "error": e.message}, problems
    if not worker.computes_forward:  # a backend of the core mappings only: compared on those
        ref = [{k: w[k] for k in DUMP_KEYS if k in w} for w in ref]
    diffs = 0
    for g, w in zip(got, ref):
        if g == w:
            continue
        diffs += 1
        if diffs > max_problems:
            continue
        where = first_difference(g, w)
        what = f"{backend} differs from the reference in {where['field']}"
        if "got" in where:
            what += f": {where['got']!r} where the reference has {where['want']!r}"
        if "token" in where:
            what += f" (token {where['token']} of the request)"
        if "rank" in where:
            what += f" on DCP rank {where['rank']}"
        chain = _chain(trace, w["step"], where) if diffs == 1 else []
        if chain:
            what += "; the reference chain: " + "; ".join(chain)
        problems.append(asdict(Problem("conformance", what, None, w["step"], where.get("req_id"), where.get("group"),
                                       where["field"])))
    for d in got:  # the cross-rank invariants on every step of this backend's dump
        for msg, req_id, group, fld in multirank.dump_problems(trace.header, d, backend)[:1]:
            problems.append(asdict(Problem("cross_rank", msg, None, d["step"], req_id, group, fld)))
    multi = trace.header.decode_context_parallel_size > 1
    for e in kv.kv_examples[:max_problems]:
        rank = f" on DCP rank {e['rank']}" if multi else ""
        problems.append(asdict(Problem("kv_mismatch", f"{backend}: KV read-back at position {e['position']} "
                                       f"slot {e['slot']}{rank} found {e['found']}", None, e["step"], e["req_id"],
                                       e["group"])))
    return {"steps": len(got), "differing_steps": diffs, "kv_checked": kv.kv_checked,
            "kv_mismatches": kv.kv_mismatches, "forward_parts": _forward_parts(worker)}, problems


def _forward_parts(worker) -> dict | None:
    """{"native": parts the backend's own code built, "kvmap": parts kvmap's host forms computed}."""
    from kvmap.forward.inputs import PARTS

    if not worker.computes_forward:
        return None
    native = list(worker.native_forward_parts)
    return {"native": native, "kvmap": [p.name for p in PARTS if p.name not in native]}


def deep_check(trace: Trace, backends: list[str] | None = None, progress: Progress | None = None) -> dict:
    """Replay through `backends` (default: every built-in one that loads here) and compare each step with the
    reference; KV canary read back every step. A named backend that cannot load is a problem, not a skip."""
    from kvmap.run.config import ReplayConfig
    from kvmap.run.replay import replay
    from kvmap.workers.registry import BACKENDS

    progress = progress or _no_progress
    ref: list[dict] = []
    try:
        with progress("reference", "reference") as on_step:
            r = replay(trace, ReplayConfig(backend="reference", write_kv=False, nvtx=False, warmup=0, forward=True,
                                           batch_order=trace.header.runner or "mrv2"),
                       on_mappings=ref.append, on_step=on_step)
    except KvmapError as e:
        return {"backends": {}, "skipped": {}, "problems": [asdict(Problem(
            "schema", f"replay failed: {e.message}", e.line, e.step, e.req_id, e.group, e.field))]}
    compared: dict = {}
    skipped: dict = {}
    problems: list[dict] = []
    for backend in backends or [b for b in BACKENDS if b != "reference"]:
        try:
            with progress(f"{backend} vs the reference", backend) as on_step:
                summary, found = compare_backend(trace, backend, ref, on_step=on_step)
        except KvmapError as e:  # not installed, or needs an environment (triton on CPU: TRITON_INTERPRET=1)
            if backends:
                raise
            skipped[backend] = e.message
            continue
        compared[backend] = summary
        problems.extend(found)
    return {"reference_steps": r.steps_replayed, "backends": compared, "skipped": skipped, "problems": problems}
