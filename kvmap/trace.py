"""Read kvmap traces (docs: trace-format.md): a header line, then one vLLM `SchedulerOutput` per line.

Rules:
- Streaming: `Trace.steps()` yields one `Step` at a time; memory does not grow with the number of steps.
- `.jsonl` and gzip-compressed files (recognised by their magic bytes, whatever the name) are read alike.
- Records are named as vLLM names them. Unknown keys are ignored.
- This is the boundary: every structural problem (not JSON, a truncated line, a missing header, a wrong type,
  a block id outside the pool, counts that do not add up) raises `TraceError` naming file:line, step, request
  and field. Semantic checks that need worker state (unknown request, a position without a block) belong to
  the worker, which raises the same error type.
- Earlier vLLM field forms are converted on load: `resumed_from_preemption` (list of bools),
  `resumed_req_token_ids` (list aligned with `req_ids`), `block_ids` as one flat list for a single group.
- Token and block id lists stay Python lists (cheap to build from JSON); their types and ranges are checked
  in bulk with numpy, one call per step and field kind, and located exactly only when the bulk check fails.
- Two parsers, one result: `fast_step` checks a well-formed line in the current form with whole-list builtins
  (C loops) and steps aside (None) on anything else; `parse_step` then names the problem or converts the old
  form. A line is never accepted by one and rejected by the other (tests/test_trace_fast.py).
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain, compress
from pathlib import Path
from typing import Any

from kvmap.errors import TraceError

try:  # orjson decodes a step line about twice as fast; the standard library is the fallback
    from orjson import loads as _loads
except ImportError:  # pragma: no cover
    _loads = json.loads

FORMAT = "kvmap-vllm-trace/1"
TOKEN_ID_LIMIT = 2**31  # token rows are int32, as vLLM's
GROUP_KINDS = ("full_attention", "sliding_window", "chunked_local", "mamba")
PROTOCOLS = ("v1", "v2")


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    group_id: int
    kind: str  # full_attention | sliding_window | chunked_local | mamba
    block_size: int  # tokens per block in this group
    sliding_window: int | None = None  # tokens, sliding_window groups only
    attention_chunk_size: int | None = None  # tokens, chunked_local groups only


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_size: int | None = None
    dtype: str | None = None


@dataclass(frozen=True, slots=True)
class TraceHeader:
    model_runner_protocol: str  # "v1" | "v2"
    block_size: int
    num_gpu_blocks: int  # block ids are 0 .. num_gpu_blocks - 1, one pool for all groups
    kv_cache_groups: tuple[KVCacheGroup, ...]
    max_num_seqs: int  # also the number of worker request-state rows
    max_num_batched_tokens: int
    max_model_len: int
    num_speculative_tokens: int = 0
    null_block_id: int | None = None
    max_num_scheduled_tokens: int | None = None
    vllm_version: str | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    async_scheduling: bool | None = None
    scheduling_policy: str | None = None
    kv_cache_spec: KVCacheSpec = field(default_factory=KVCacheSpec)
    extra: dict[str, Any] = field(default_factory=dict)  # informational keys kvmap does not interpret

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_groups)

    @property
    def token_budget(self) -> int:
        return self.max_num_scheduled_tokens or self.max_num_batched_tokens


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]  # [prompt_len]
    block_ids: list[list[int]]  # [num_groups][num_blocks_g]: all blocks so far, prefix hits first
    num_computed_tokens: int  # prefix-cache hit length = position of the first scheduled token
    prefill_token_ids: list[int] | None  # v2 protocol: prompt + outputs before a preemption

    @property
    def token_ids(self) -> list[int]:
        """The tokens the worker's row starts with."""
        return self.prefill_token_ids if self.prefill_token_ids is not None else self.prompt_token_ids


@dataclass(slots=True)
class CachedRequestData:
    req_ids: list[str]  # running requests (running-queue order), then v1 resumed ones
    resumed_req_ids: set[str]  # v1: new_block_ids replace the row instead of appending
    new_block_ids: list[list[list[int]] | None]  # [num_cached] -> None | [num_groups][new blocks]
    num_computed_tokens: list[int]  # [num_cached], before this step's tokens
    all_token_ids: dict[str, list[int]]  # v1: full token list of requests not scheduled last step
    num_output_tokens: list[int] | None  # [num_cached]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens this step (drafts included), scheduler order
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]  # req_id -> draft ids to verify
    finished_req_ids: list[str]  # free before this step
    preempted_req_ids: list[str]  # preempted while scheduling this step


@dataclass(slots=True)
class Step:
    step: int
    line: int  # 1-based line in the file
    scheduler_output: SchedulerOutput
    sampled_token_ids: dict[str, list[int]] | None  # req_id -> tokens the model returned; None: not recorded
    draft_token_ids: dict[str, list[int]] | None  # req_id -> drafts proposed after this step


# ---------------------------------------------------------------------------------------------- helpers


class _Where:
    """Location of the value being checked, for error messages."""

    __slots__ = ("path", "line", "step")

    def __init__(self, path: str, line: int, step: int | None) -> None:
        self.path, self.line, self.step = path, line, step

    def error(self, message: str, *, req_id: str | None = None, group: int | None = None,
              field: str | None = None) -> TraceError:
        return TraceError(message, path=self.path, line=self.line, step=self.step, req_id=req_id,
                          group=group, field=field)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _int(value: object, where: _Where, name: str, *, minimum: int | None = None, maximum: int | None = None,
         req_id: str | None = None) -> int:
    if type(value) is not int:
        raise where.error(f"expected an integer, got {_type_name(value)} {value!r:.40}", field=name,
                          req_id=req_id)
    if minimum is not None and value < minimum:
        raise where.error(f"must be >= {minimum}, got {value}", field=name, req_id=req_id)
    if maximum is not None and value > maximum:
        raise where.error(f"must be <= {maximum}, got {value}", field=name, req_id=req_id)
    return value


def _str_list(value: object, where: _Where, name: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(type(v) is str for v in value):
        raise where.error(f"expected a list of request ids (strings), got {value!r:.60}", field=name)
    return value


def _dict(value: object, where: _Where, name: str) -> dict:
    if not isinstance(value, dict):
        raise where.error(f"expected an object, got {_type_name(value)}", field=name)
    return value


def _int_lists(items: list[tuple[str | None, str, int | None, object]], where: _Where, *,
               minimum: int = 0, maximum: int | None = None, what: str = "id") -> None:
    """Check that every value in `items` is a list of ints within [minimum, maximum).

    `items` holds (req_id, field, group, value). One numpy conversion checks them all; only when that fails
    is each list looked at on its own, to name the culprit.
    """
    if not items:
        return
    import numpy as np  # here, not at the top: validate and --help stay free of numpy's ~0.1 s import

    lists = [v for _, _, _, v in items]
    ok = all(type(v) is list for v in lists)
    if ok:
        flat = list(chain.from_iterable(lists))
        if flat:
            try:
                arr = np.array(flat)
                ok = arr.dtype.kind in "iu" and arr.ndim == 1
                if ok:
                    lo, hi = int(arr.min()), int(arr.max())
                    ok = lo >= minimum and (maximum is None or hi < maximum)
            except (ValueError, TypeError, OverflowError):
                ok = False
    if ok:
        return
    for req_id, name, group, value in items:
        if type(value) is not list:
            raise where.error(f"expected a list of integers, got {_type_name(value)}", req_id=req_id,
                              field=name, group=group)
        for i, v in enumerate(value):
            if type(v) is not int:
                raise where.error(f"entry {i} is {_type_name(v)} {v!r:.30}, expected an integer",
                                  req_id=req_id, field=name, group=group)
            if v < minimum or (maximum is not None and v >= maximum):
                bound = f"[{minimum}, {maximum})" if maximum is not None else f">= {minimum}"
                raise where.error(f"{what} {v} at entry {i} is outside {bound}", req_id=req_id, field=name,
                                  group=group)
    raise where.error("a value is not a list of integers in range")  # pragma: no cover


# ---------------------------------------------------------------------------------------------- header


def parse_header(obj: object, where: _Where) -> TraceHeader:
    if not isinstance(obj, dict) or obj.get("kind") != "header":
        raise where.error("not a kvmap trace: line 1 must be the header object with \"kind\": \"header\"")
    if obj.get("format") != FORMAT:
        raise where.error(f"unsupported format {obj.get('format')!r}, expected {FORMAT!r}", field="format")
    protocol = obj.get("model_runner_protocol")
    if protocol not in PROTOCOLS:
        raise where.error(f"must be one of {PROTOCOLS}, got {protocol!r}", field="model_runner_protocol")
    for key in ("block_size", "num_gpu_blocks", "kv_cache_groups", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len"):
        if key not in obj:
            raise where.error("missing required header key", field=key)
    block_size = _int(obj["block_size"], where, "block_size", minimum=1)
    num_gpu_blocks = _int(obj["num_gpu_blocks"], where, "num_gpu_blocks", minimum=1)
    groups_raw = obj["kv_cache_groups"]
    if not isinstance(groups_raw, list) or not groups_raw:
        raise where.error("expected a non-empty list of groups", field="kv_cache_groups")
    groups = []
    for i, g in enumerate(groups_raw):
        name = f"kv_cache_groups[{i}]"
        g = _dict(g, where, name)
        kind = g.get("kind")
        if kind not in GROUP_KINDS:
            raise where.error(f"kind must be one of {GROUP_KINDS}, got {kind!r}", field=f"{name}.kind")
        if kind == "mamba":
            raise where.error("mamba groups hold state, not per-token KV; kvmap does not replay them yet",
                              field=f"{name}.kind")
        gid = _int(g.get("group_id", i), where, f"{name}.group_id")
        if gid != i:
            raise where.error(f"group_id {gid} must equal its index {i}", field=f"{name}.group_id")
        bs = _int(g.get("block_size", block_size), where, f"{name}.block_size", minimum=1)
        window = g.get("sliding_window")
        if kind == "sliding_window":
            window = _int(window, where, f"{name}.sliding_window", minimum=1)
        elif window is not None:
            window = None  # informational on other kinds (vLLM's FullAttentionSpec may carry it)
        chunk = g.get("attention_chunk_size")
        if kind == "chunked_local":
            chunk = _int(chunk, where, f"{name}.attention_chunk_size", minimum=1)
        groups.append(KVCacheGroup(gid, kind, bs, window, chunk))
    spec_raw = obj.get("kv_cache_spec") or {}
    spec_raw = _dict(spec_raw, where, "kv_cache_spec")
    spec = KVCacheSpec(**{k: spec_raw.get(k) for k in ("num_layers", "num_kv_heads", "head_size", "dtype")})
    known = {"kind", "format", "model_runner_protocol", "block_size", "num_gpu_blocks", "kv_cache_groups",
             "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_speculative_tokens",
             "null_block_id", "max_num_scheduled_tokens", "vllm_version", "enable_prefix_caching",
             "enable_chunked_prefill", "async_scheduling", "scheduling_policy", "kv_cache_spec"}
    null_block_id = obj.get("null_block_id")
    if null_block_id is not None:
        _int(null_block_id, where, "null_block_id", minimum=0)
        if null_block_id >= num_gpu_blocks:
            raise where.error(f"{null_block_id} is outside the pool of {num_gpu_blocks}", field="null_block_id")
    max_sched = obj.get("max_num_scheduled_tokens")
    if max_sched is not None:
        _int(max_sched, where, "max_num_scheduled_tokens", minimum=1)
    return TraceHeader(
        model_runner_protocol=protocol,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        kv_cache_groups=tuple(groups),
        max_num_seqs=_int(obj["max_num_seqs"], where, "max_num_seqs", minimum=1),
        max_num_batched_tokens=_int(obj["max_num_batched_tokens"], where, "max_num_batched_tokens", minimum=1),
        max_model_len=_int(obj["max_model_len"], where, "max_model_len", minimum=1),
        num_speculative_tokens=_int(obj.get("num_speculative_tokens") or 0, where, "num_speculative_tokens",
                                    minimum=0),
        null_block_id=null_block_id,
        max_num_scheduled_tokens=max_sched,
        vllm_version=obj.get("vllm_version"),
        enable_prefix_caching=obj.get("enable_prefix_caching"),
        enable_chunked_prefill=obj.get("enable_chunked_prefill"),
        async_scheduling=obj.get("async_scheduling"),
        scheduling_policy=obj.get("scheduling_policy"),
        kv_cache_spec=spec,
        extra={k: v for k, v in obj.items() if k not in known},
    )


# ---------------------------------------------------------------------------------------------- steps


def _group_lists(value: object, num_groups: int, where: _Where, req_id: str, name: str) -> list[list[int]]:
    """`block_ids` / a `new_block_ids` entry: one list per group (or, legacy, one flat list for one group)."""
    if not isinstance(value, list):
        raise where.error(f"expected one list of block ids per KV cache group, got {_type_name(value)}",
                          req_id=req_id, field=name)
    if num_groups == 1 and (not value or type(value[0]) is int):
        return [value]  # pre-#17945 form: a flat list for the single group
    if len(value) != num_groups:
        raise where.error(f"has {len(value)} group lists, the header declares {num_groups} KV cache groups",
                          req_id=req_id, field=name)
    return value


def parse_step(obj: object, header: TraceHeader, where: _Where) -> Step:
    if not isinstance(obj, dict):
        raise where.error(f"a step line must be a JSON object, got {_type_name(obj)}")
    if obj.get("kind") == "header":
        raise where.error("a second header line; a trace has exactly one header, on line 1")
    step_idx = _int(obj.get("step"), where, "step", minimum=0)
    if step_idx != where.step:
        raise where.error(f"steps must be consecutive from 0: expected step {where.step}, got {step_idx}",
                          field="step")
    so = _dict(obj.get("scheduler_output"), where, "scheduler_output")
    G = header.num_groups
    id_lists: list[tuple[str | None, str, int | None, object]] = []  # token ids
    block_lists: list[tuple[str | None, str, int | None, object]] = []  # block ids

    # -- scheduled_new_reqs
    new_raw = so.get("scheduled_new_reqs", [])
    if not isinstance(new_raw, list):
        raise where.error(f"expected a list, got {_type_name(new_raw)}", field="scheduled_new_reqs")
    new_reqs = []
    for i, r in enumerate(new_raw):
        r = _dict(r, where, f"scheduled_new_reqs[{i}]")
        req_id = r.get("req_id")
        if type(req_id) is not str:
            raise where.error(f"expected a string request id, got {req_id!r:.30}",
                              field=f"scheduled_new_reqs[{i}].req_id")
        prompt = r.get("prompt_token_ids")
        prefill = r.get("prefill_token_ids")
        if prompt is None and prefill is None:
            raise where.error("no prompt_token_ids (prompt embeddings are not replayable)", req_id=req_id,
                              field="prompt_token_ids")
        if prompt is None:
            prompt = prefill
        id_lists.append((req_id, "prompt_token_ids", None, prompt))
        if prefill is not None:
            id_lists.append((req_id, "prefill_token_ids", None, prefill))
        blocks = _group_lists(r.get("block_ids"), G, where, req_id, "block_ids")
        for g, b in enumerate(blocks):
            block_lists.append((req_id, "block_ids", g, b))
        nc = _int(r.get("num_computed_tokens"), where, "num_computed_tokens", minimum=0,
                  maximum=header.max_model_len, req_id=req_id)
        new_reqs.append(NewRequestData(req_id, prompt, blocks, nc, prefill))

    # -- scheduled_cached_reqs (column-oriented)
    c = so.get("scheduled_cached_reqs") or {}
    c = _dict(c, where, "scheduled_cached_reqs")
    req_ids = _str_list(c.get("req_ids"), where, "scheduled_cached_reqs.req_ids")
    n = len(req_ids)
    if "resumed_req_ids" in c or "resumed_from_preemption" not in c:
        resumed = set(_str_list(c.get("resumed_req_ids"), where, "scheduled_cached_reqs.resumed_req_ids"))
    else:  # before #27756: a list of booleans aligned with req_ids
        flags = c["resumed_from_preemption"]
        if not isinstance(flags, list) or len(flags) != n or not all(type(f) is bool for f in flags):
            raise where.error(f"expected {n} booleans", field="scheduled_cached_reqs.resumed_from_preemption")
        resumed = {r for r, f in zip(req_ids, flags) if f}
    nc_list = c.get("num_computed_tokens", [])
    if not isinstance(nc_list, list) or len(nc_list) != n:
        raise where.error(f"expected a list of {n} integers (one per req_ids entry)",
                          field="scheduled_cached_reqs.num_computed_tokens")
    limit = header.max_model_len
    if n and not all(type(v) is int and 0 <= v <= limit for v in nc_list):
        for r, v in zip(req_ids, nc_list):
            _int(v, where, "scheduled_cached_reqs.num_computed_tokens", minimum=0, maximum=limit, req_id=r)
    nb_raw = c.get("new_block_ids", [None] * n)
    if not isinstance(nb_raw, list) or len(nb_raw) != n:
        raise where.error(f"expected a list of {n} entries (one per req_ids entry)",
                          field="scheduled_cached_reqs.new_block_ids")
    new_block_ids: list[list[list[int]] | None] = []
    for r, entry in zip(req_ids, nb_raw):
        if entry is None:
            new_block_ids.append(None)
            continue
        lists = _group_lists(entry, G, where, r, "new_block_ids")
        for g, b in enumerate(lists):
            block_lists.append((r, "new_block_ids", g, b))
        new_block_ids.append(lists)
    if "all_token_ids" in c or "resumed_req_token_ids" not in c:
        all_tok = _dict(c.get("all_token_ids") or {}, where, "scheduled_cached_reqs.all_token_ids")
    else:  # before #27756: a list aligned with req_ids, None for requests that were not resumed
        legacy = c["resumed_req_token_ids"]
        if not isinstance(legacy, list) or len(legacy) != n:
            raise where.error(f"expected {n} entries", field="scheduled_cached_reqs.resumed_req_token_ids")
        all_tok = {r: t for r, t in zip(req_ids, legacy) if t is not None}
    for r, toks in all_tok.items():
        id_lists.append((r, "all_token_ids", None, toks))
    num_out = c.get("num_output_tokens")
    if num_out is not None and (not isinstance(num_out, list) or len(num_out) != n):
        raise where.error(f"expected {n} entries", field="scheduled_cached_reqs.num_output_tokens")

    # -- counts
    nst = _dict(so.get("num_scheduled_tokens"), where, "num_scheduled_tokens")
    vals = list(nst.values())
    if not all(type(v) is int and 0 < v <= limit for v in vals):
        for r, v in nst.items():
            _int(v, where, "num_scheduled_tokens", minimum=1, maximum=limit, req_id=r)
    total = _int(so.get("total_num_scheduled_tokens"), where, "total_num_scheduled_tokens", minimum=0)
    if sum(vals) != total:
        raise where.error(f"is {total} but num_scheduled_tokens adds up to {sum(vals)}",
                          field="total_num_scheduled_tokens")
    if len(nst) != len(new_reqs) + n:
        scheduled = {r.req_id for r in new_reqs}.union(req_ids)
        extra = [r for r in nst if r not in scheduled]
        missing = [r for r in scheduled if r not in nst]
        culprit = (extra or missing or [None])[0]
        raise where.error(
            f"num_scheduled_tokens has {len(nst)} requests but {len(new_reqs)} new + {n} cached are scheduled"
            + (" (not in scheduled_new_reqs or scheduled_cached_reqs)" if extra else
               " (scheduled but missing from num_scheduled_tokens)" if missing else " (a request repeats)"),
            req_id=culprit, field="num_scheduled_tokens")
    for r in new_reqs:
        if r.req_id not in nst:
            raise where.error("scheduled as new but missing from num_scheduled_tokens", req_id=r.req_id,
                              field="num_scheduled_tokens")
    for r in req_ids:
        if r not in nst:
            raise where.error("scheduled as cached but missing from num_scheduled_tokens", req_id=r,
                              field="num_scheduled_tokens")

    spec = _dict(so.get("scheduled_spec_decode_tokens") or {}, where, "scheduled_spec_decode_tokens")
    for r, drafts in spec.items():
        if r not in nst:
            raise where.error("has drafts but is not scheduled", req_id=r, field="scheduled_spec_decode_tokens")
        if isinstance(drafts, list) and len(drafts) >= nst[r]:
            raise where.error(f"{len(drafts)} drafts do not fit in {nst[r]} scheduled tokens", req_id=r,
                              field="scheduled_spec_decode_tokens")
        # async scheduling writes -1 placeholders for drafts that live on the GPU
        id_lists.append((r, "scheduled_spec_decode_tokens", None, [d for d in drafts if d != -1]
                         if isinstance(drafts, list) else drafts))

    finished = _str_list(so.get("finished_req_ids"), where, "finished_req_ids")
    preempted = _str_list(so.get("preempted_req_ids"), where, "preempted_req_ids")

    # -- model output
    sampled = obj.get("sampled_token_ids")
    if sampled is not None:
        sampled = _dict(sampled, where, "sampled_token_ids")
        for r, toks in sampled.items():
            if r not in nst:
                raise where.error("has sampled tokens but was not scheduled", req_id=r, field="sampled_token_ids")
            id_lists.append((r, "sampled_token_ids", None, toks))
    drafts_out = obj.get("draft_token_ids")
    if drafts_out is not None:
        drafts_out = _dict(drafts_out, where, "draft_token_ids")
        for r, toks in drafts_out.items():
            id_lists.append((r, "draft_token_ids", None, toks))

    _int_lists(id_lists, where, maximum=TOKEN_ID_LIMIT, what="token id")
    _int_lists(block_lists, where, maximum=header.num_gpu_blocks, what="block id")

    return Step(
        step=step_idx,
        line=where.line,
        scheduler_output=SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData(req_ids, resumed, new_block_ids, nc_list, all_tok, num_out),
            num_scheduled_tokens=nst,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=spec,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
        ),
        sampled_token_ids=sampled,
        draft_token_ids=drafts_out,
    )


# ---------------------------------------------------------------------------------------------- fast path

_INT, _STR, _LIST = {int}, {str}, {list}


def _strs(values: object) -> bool:
    return values is None or (type(values) is list and (not values or set(map(type, values)) == _STR))


def fast_step(obj: object, header: TraceHeader, where: _Where) -> Step | None:
    """`parse_step` for a well-formed line in the current vLLM form, with whole-list checks in C.

    Returns the Step `parse_step` would return, or None whenever anything is off (a problem, a legacy field
    form, a value `parse_step` accepts only after a closer look): the caller then runs `parse_step`, which
    names the problem or converts the old form. tests/test_trace_fast.py holds the two to the same results.
    """
    if type(obj) is not dict or obj.get("kind") == "header" or obj.get("step") != where.step \
            or type(obj.get("step")) is not int:
        return None
    so = obj.get("scheduler_output")
    if type(so) is not dict:
        return None
    G = header.num_groups
    limit = header.max_model_len
    tok_hi = TOKEN_ID_LIMIT - 1
    blk_hi = header.num_gpu_blocks - 1
    token_lists: list = []
    block_lists: list = []

    new_raw = so.get("scheduled_new_reqs", [])
    if type(new_raw) is not list:
        return None
    new_reqs = []
    for r in new_raw:
        if type(r) is not dict:
            return None
        req_id, prompt, prefill = r.get("req_id"), r.get("prompt_token_ids"), r.get("prefill_token_ids")
        blocks, nc = r.get("block_ids"), r.get("num_computed_tokens")
        if type(req_id) is not str or type(nc) is not int or not 0 <= nc <= limit or type(blocks) is not list \
                or len(blocks) != G or (G == 1 and (not blocks or type(blocks[0]) is int)):
            return None
        if prompt is None:
            if prefill is None:
                return None
            prompt = prefill
        token_lists.append(prompt)
        if prefill is not None:
            token_lists.append(prefill)
        block_lists += blocks
        new_reqs.append(NewRequestData(req_id, prompt, blocks, nc, prefill))

    c = so.get("scheduled_cached_reqs") or {}
    if type(c) is not dict or "resumed_from_preemption" in c and "resumed_req_ids" not in c \
            or "resumed_req_token_ids" in c and "all_token_ids" not in c:
        return None
    req_ids = c.get("req_ids")
    resumed = c.get("resumed_req_ids")
    if req_ids is None:
        req_ids = []
    elif type(req_ids) is not list:  # its entries are strings: each one is a key of num_scheduled_tokens
        return None
    if not _strs(resumed):
        return None
    n = len(req_ids)
    nc_list = c.get("num_computed_tokens", [])
    nb_raw = c.get("new_block_ids", [None] * n)
    if type(nc_list) is not list or len(nc_list) != n or type(nb_raw) is not list or len(nb_raw) != n:
        return None
    grown = list(compress(nb_raw, nb_raw))  # the entries with new blocks, skipping the Nones in C
    if len(grown) != n - nb_raw.count(None):
        return None  # an empty entry: legacy or wrong, parse_step decides
    for entry in grown:
        if type(entry) is not list or len(entry) != G or (G == 1 and type(entry[0]) is int):
            return None
        block_lists += entry
    all_tok = c.get("all_token_ids") or {}
    num_out = c.get("num_output_tokens")
    if type(all_tok) is not dict or (num_out is not None and (type(num_out) is not list or len(num_out) != n)):
        return None
    token_lists += all_tok.values()

    nst = so.get("num_scheduled_tokens")
    total = so.get("total_num_scheduled_tokens")
    if type(nst) is not dict or type(total) is not int:
        return None
    if len(nst) != len(new_reqs) + n:
        return None
    keys = nst.keys()
    if list(keys) != req_ids:  # usually equal: the running requests, in order, and nothing new
        try:
            if not keys >= set(req_ids) or any(r.req_id not in nst for r in new_reqs):
                return None
        except TypeError:  # an unhashable entry
            return None
    spec = so.get("scheduled_spec_decode_tokens") or {}
    if type(spec) is not dict:
        return None
    for r, drafts in spec.items():
        if r not in nst or type(drafts) is not list or len(drafts) >= nst[r]:
            return None
        token_lists.append([d for d in drafts if d != -1] if -1 in drafts else drafts)
    finished, preempted = so.get("finished_req_ids"), so.get("preempted_req_ids")
    if not (_strs(finished) and _strs(preempted)):
        return None

    sampled, drafts_out = obj.get("sampled_token_ids"), obj.get("draft_token_ids")
    if sampled is not None:
        if type(sampled) is not dict or not (sampled.keys() == keys or sampled.keys() <= keys):
            return None
        token_lists += sampled.values()
    if drafts_out is not None:
        if type(drafts_out) is not dict:
            return None
        token_lists += drafts_out.values()
    # every int, in one pass of type() over all of them; then each kind's range
    if (token_lists or block_lists) and set(map(type, chain(token_lists, block_lists))) != _LIST:
        return None
    tok, blk = list(chain.from_iterable(token_lists)), list(chain.from_iterable(block_lists))
    vals = list(nst.values())
    types = set(map(type, chain(nc_list, vals, tok, blk)))
    if types and types != _INT:
        return None
    if (n and (min(nc_list) < 0 or max(nc_list) > limit)) or (vals and (min(vals) < 1 or max(vals) > limit)) \
            or (tok and (min(tok) < 0 or max(tok) > tok_hi)) or (blk and (min(blk) < 0 or max(blk) > blk_hi)) \
            or sum(vals) != total:
        return None
    return Step(
        step=where.step,
        line=where.line,
        scheduler_output=SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData(req_ids, set(resumed or ()), nb_raw, nc_list, all_tok,
                                                    num_out),
            num_scheduled_tokens=nst,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=spec,
            finished_req_ids=finished or [],
            preempted_req_ids=preempted or [],
        ),
        sampled_token_ids=sampled,
        draft_token_ids=drafts_out,
    )


# ---------------------------------------------------------------------------------------------- files


def _open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        try:  # ISA-L's inflate, a drop-in GzipFile (same errors): 1.6-2.8x faster than zlib on the bundled traces
            from isal.igzip import open as gzip_open
        except ImportError:
            gzip_open = gzip.open
        return io.TextIOWrapper(gzip_open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


class Trace:
    """A trace file: its header (read at once) and its steps (streamed on demand, any number of times)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = str(path)
        if not self.path.exists():
            raise TraceError("no such file", path=self.name)
        if self.path.is_dir():
            raise TraceError("is a directory, not a trace file", path=self.name)
        with self._lines() as lines:
            first = next(lines, None)
            if first is None:
                raise TraceError("empty file: a trace starts with a header line", path=self.name, line=1)
            self.header = parse_header(self._json(first, 1, None), _Where(self.name, 1, None))
        self._typed: object = False  # the typed decoder, built on the first steps() (None without msgspec)

    @contextmanager
    def _lines(self) -> Iterator[Iterator[str]]:
        """The file's raw lines, opened (and gunzipped) for one pass."""
        try:
            f = _open_text(self.path)
        except OSError as e:
            raise TraceError(f"cannot read: {e.strerror or e}", path=self.name) from None
        with f:
            raw = f.buffer.fileobj if hasattr(f.buffer, "fileobj") else f.buffer  # the file's own bytes
            self._position = raw.tell
            try:
                yield _read_lines(f, self.name)
            finally:
                self._position = None

    _position = None

    def size_bytes(self) -> int:
        """The file's size on disk (compressed, for gzip): the unit of `bytes_read`."""
        return self.path.stat().st_size

    def bytes_read(self) -> int:
        """How far the pass now open has read into the file (read-ahead included), for progress bars."""
        try:
            return self._position() if self._position is not None else 0
        except (OSError, ValueError):
            return 0

    def _json(self, raw: str, line: int, step: int | None) -> object:
        try:
            return _loads(raw)
        except json.JSONDecodeError as e:  # orjson's error is a subclass
            what = "truncated line" if e.pos >= len(raw.rstrip()) else "not valid JSON"
            raise TraceError(f"{what} ({e.msg} at column {e.colno})", path=self.name, line=line,
                             step=step) from None

    def steps(self, start: int = 0, stop: int | None = None) -> Iterator[Step]:
        """Yield steps `start <= step < stop`. Earlier lines are skipped unparsed: a worker that needs their
        state must read from 0 (replay does, and records only the window)."""
        if self._typed is False:
            from kvmap.trace_typed import typed_decoder

            self._typed = typed_decoder(self.header)
        typed = self._typed
        with self._lines() as lines:
            next(lines)
            for i, raw in enumerate(lines):
                if stop is not None and i >= stop:
                    return
                if i < start:
                    continue
                line = i + 2
                if typed is not None:  # one pass, every value checked as it is built; None: the checked path
                    step = typed(raw, line, i)
                    if step is not None:
                        yield step
                        continue
                where = _Where(self.name, line, i)
                if not raw.strip():
                    raise where.error("blank line (a trace has one JSON object on every line)")
                obj = self._json(raw, line, i)
                yield fast_step(obj, self.header, where) or parse_step(obj, self.header, where)

    def raw_steps(self) -> Iterator[tuple[int, str]]:
        """(line number, raw text) of every step line, for tools that parse leniently (validate)."""
        with self._lines() as lines:
            next(lines)
            for i, raw in enumerate(lines):
                yield i + 2, raw


def _read_lines(f: io.TextIOBase, name: str) -> Iterator[str]:
    try:
        yield from f
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile, OSError) as e:
        raise TraceError(f"cannot decode the file ({type(e).__name__}: {e})", path=name) from None


def open_trace(path: str | Path) -> Trace:
    return Trace(path)
