"""The checked step parser: names every structural problem of a step line, and converts earlier vLLM forms.

Rules:
- This is the boundary: not an object, a wrong type, a block id outside the pool raise `TraceError` naming
  file:line, step, request, group and field. The cross-field rules (counts that do not add up, a request
  scheduled twice, ...) are `invariants.check_step`'s, called on the finished `Step` as every decoder calls
  it. Semantic checks that need worker state (unknown request, a position without a block) belong to the
  worker, which raises the same error type.
- This is the oracle of the typed decoder (typed.py): for every line, either both return equal `Step`s or
  the typed one steps aside and this one names the problem.
- Earlier vLLM field forms are converted on load: `resumed_from_preemption` (list of bools),
  `resumed_req_token_ids` (list aligned with `req_ids`), `block_ids` as one flat list for a single group.
- Token and block id lists stay Python lists (cheap to build from JSON); their types and ranges are checked
  in bulk, one call per step and field kind, and located exactly only when the bulk check fails.
"""

from __future__ import annotations

from kvmap.trace.checks import Where, dict_field, int_field, int_lists, str_list, type_name
from kvmap.trace.invariants import check_step
from kvmap.trace.records import (ASYNC_SPEC_KEYS, TOKEN_ID_LIMIT, AsyncSpecDecode, CachedRequestData, NewRequestData,
                                 SchedulerOutput, Step, TraceHeader)


def _group_lists(value: object, num_groups: int, where: Where, req_id: str, name: str) -> list[list[int]]:
    """`block_ids` / a `new_block_ids` entry: one list per group (or, legacy, one flat list for one group)."""
    if not isinstance(value, list):
        raise where.error(f"expected one list of block ids per KV cache group, got {type_name(value)}",
                          req_id=req_id, field=name)
    if num_groups == 1 and (not value or type(value[0]) is int):
        return [value]  # pre-#17945 form: a flat list for the single group
    if len(value) != num_groups:
        raise where.error(f"has {len(value)} group lists, the header declares {num_groups} KV cache groups",
                          req_id=req_id, field=name)
    return value


def parse_step(obj: object, header: TraceHeader, where: Where) -> Step:
    if not isinstance(obj, dict):
        raise where.error(f"a step line must be a JSON object, got {type_name(obj)}")
    if obj.get("kind") == "header":
        raise where.error("a second header line; a trace has exactly one header, on line 1")
    step_idx = int_field(obj.get("step"), where, "step", minimum=0)
    if step_idx != where.step:
        raise where.error(f"steps must be consecutive from 0: expected step {where.step}, got {step_idx}",
                          field="step", kind="step_order")
    so = dict_field(obj.get("scheduler_output"), where, "scheduler_output")
    id_lists: list[tuple[str | None, str, int | None, object]] = []  # token ids
    block_lists: list[tuple[str | None, str, int | None, object]] = []  # block ids
    new_reqs = _new_reqs(so, header, where, id_lists, block_lists)
    cached = _cached_reqs(so, header, where, id_lists, block_lists)
    limit = header.max_model_len
    nst = dict_field(so.get("num_scheduled_tokens"), where, "num_scheduled_tokens")
    if not all(type(v) is int and 0 < v <= limit for v in nst.values()):
        for r, v in nst.items():
            int_field(v, where, "num_scheduled_tokens", minimum=1, maximum=limit, req_id=r)
    total = int_field(so.get("total_num_scheduled_tokens"), where, "total_num_scheduled_tokens", minimum=0)
    spec = dict_field(so.get("scheduled_spec_decode_tokens") or {}, where, "scheduled_spec_decode_tokens")
    for r, drafts in spec.items():  # async scheduling writes -1 placeholders for drafts that live on the GPU
        id_lists.append((r, "scheduled_spec_decode_tokens", None, [d for d in drafts if d != -1]
                         if isinstance(drafts, list) else drafts))
    finished = str_list(so.get("finished_req_ids"), where, "finished_req_ids")
    preempted = str_list(so.get("preempted_req_ids"), where, "preempted_req_ids")
    sampled = obj.get("sampled_token_ids")
    if sampled is not None:
        sampled = dict_field(sampled, where, "sampled_token_ids")
        id_lists.extend((r, "sampled_token_ids", None, toks) for r, toks in sampled.items())
    drafts_out = obj.get("draft_token_ids")
    if drafts_out is not None:
        drafts_out = dict_field(drafts_out, where, "draft_token_ids")
        id_lists.extend((r, "draft_token_ids", None, toks) for r, toks in drafts_out.items())
    async_spec = _async_spec(obj, where, id_lists) if ASYNC_SPEC_KEYS.intersection(obj) else None
    int_lists(id_lists, where, maximum=TOKEN_ID_LIMIT, what="token id")
    int_lists(block_lists, where, maximum=header.num_gpu_blocks, what="block id")
    step = Step(step_idx, where.line, SchedulerOutput(new_reqs, cached, nst, total, spec, finished, preempted),
                sampled, drafts_out, async_spec)
    return check_step(step, header.num_speculative_tokens, where.path)


def _new_reqs(so: dict, header: TraceHeader, where: Where, id_lists: list, block_lists: list) -> list[NewRequestData]:
    """`scheduled_new_reqs`, each value checked (its token and block lists join the bulk checks)."""
    new_raw = so.get("scheduled_new_reqs", [])
    if not isinstance(new_raw, list):
        raise where.error(f"expected a list, got {type_name(new_raw)}", field="scheduled_new_reqs")
    new_reqs = []
    for i, r in enumerate(new_raw):
        r = dict_field(r, where, f"scheduled_new_reqs[{i}]")
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
        blocks = _group_lists(r.get("block_ids"), header.num_groups, where, req_id, "block_ids")
        block_lists.extend((req_id, "block_ids", g, b) for g, b in enumerate(blocks))
        nc = int_field(r.get("num_computed_tokens"), where, "num_computed_tokens", minimum=0,
                       maximum=header.max_model_len, req_id=req_id)
        new_reqs.append(NewRequestData(req_id, prompt, blocks, nc, prefill))
    return new_reqs


def _cached_reqs(so: dict, header: TraceHeader, where: Where, id_lists: list,
                 block_lists: list) -> CachedRequestData:
    """`scheduled_cached_reqs` (column-oriented), each value checked; legacy forms converted."""
    c = dict_field(so.get("scheduled_cached_reqs") or {}, where, "scheduled_cached_reqs")
    req_ids = str_list(c.get("req_ids"), where, "scheduled_cached_reqs.req_ids")
    n = len(req_ids)
    if "resumed_req_ids" in c or "resumed_from_preemption" not in c:
        resumed = set(str_list(c.get("resumed_req_ids"), where, "scheduled_cached_reqs.resumed_req_ids"))
    else:  # before #27756: a list of booleans aligned with req_ids
        flags = c["resumed_from_preemption"]
        if not isinstance(flags, list) or len(flags) != n or not all(type(f) is bool for f in flags):
            raise where.error(f"expected {n} booleans", field="scheduled_cached_reqs.resumed_from_preemption")
        resumed = {r for r, f in zip(req_ids, flags) if f}
    nc_list = c.get("num_computed_tokens", [])
    if not isinstance(nc_list, list):
        raise where.error(f"expected a list of {n} integers (one per req_ids entry)",
                          field="scheduled_cached_reqs.num_computed_tokens")
    limit = header.max_model_len
    if not all(type(v) is int and 0 <= v <= limit for v in nc_list):
        for i, v in enumerate(nc_list):
            int_field(v, where, "scheduled_cached_reqs.num_computed_tokens", minimum=0, maximum=limit,
                      req_id=req_ids[i] if i < n else None)
    nb_raw = c.get("new_block_ids", [None] * n)
    if not isinstance(nb_raw, list):
        raise where.error(f"expected a list of {n} entries (one per req_ids entry)",
                          field="scheduled_cached_reqs.new_block_ids")
    new_block_ids: list[list[list[int]] | None] = []
    for i, entry in enumerate(nb_raw):
        if entry is None:
            new_block_ids.append(None)
            continue
        r = req_ids[i] if i < n else None
        lists = _group_lists(entry, header.num_groups, where, r, "new_block_ids")
        block_lists.extend((r, "new_block_ids", g, b) for g, b in enumerate(lists))
        new_block_ids.append(lists)
    if "all_token_ids" in c or "resumed_req_token_ids" not in c:
        all_tok = dict_field(c.get("all_token_ids") or {}, where, "scheduled_cached_reqs.all_token_ids")
    else:  # before #27756: a list aligned with req_ids, None for requests that were not resumed
        legacy = c["resumed_req_token_ids"]
        if not isinstance(legacy, list) or len(legacy) != n:
            raise where.error(f"expected {n} entries", field="scheduled_cached_reqs.resumed_req_token_ids")
        all_tok = {r: t for r, t in zip(req_ids, legacy) if t is not None}
    id_lists.extend((r, "all_token_ids", None, toks) for r, toks in all_tok.items())
    num_out = c.get("num_output_tokens")
    if num_out is not None and not isinstance(num_out, list):
        raise where.error(f"expected {n} entries", field="scheduled_cached_reqs.num_output_tokens")
    return CachedRequestData(req_ids, resumed, new_block_ids, nc_list, all_tok, num_out)


def _async_spec(obj: dict, where: Where, id_lists: list) -> AsyncSpecDecode:
    """The async speculative-decoding keys, each value checked: real drafts, rejections, corrections."""
    real = dict_field(obj.get("spec_draft_token_ids") or {}, where, "spec_draft_token_ids")
    id_lists.extend((r, "spec_draft_token_ids", None, toks) for r, toks in real.items())
    rejected = dict_field(obj.get("num_rejected_tokens") or {}, where, "num_rejected_tokens")
    for r, k in rejected.items():
        int_field(k, where, "num_rejected_tokens", minimum=0, req_id=r)
    corr = dict_field(obj.get("num_computed_tokens_correction") or {}, where, "num_computed_tokens_correction")
    for r, k in corr.items():
        int_field(k, where, "num_computed_tokens_correction", minimum=0, req_id=r)
    return AsyncSpecDecode(real, rejected, corr)
