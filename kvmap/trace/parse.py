"""The checked step parser: names every structural problem of a step line, and converts earlier vLLM forms.

Rules:
- This is the boundary: not an object, a wrong type, a block id outside the pool, counts that do not add up
  raise `TraceError` naming file:line, step, request, group and field. Semantic checks that need worker state
  (unknown request, a position without a block) belong to the worker, which raises the same error type.
- Earlier vLLM field forms are converted on load: `resumed_from_preemption` (list of bools),
  `resumed_req_token_ids` (list aligned with `req_ids`), `block_ids` as one flat list for a single group.
- Token and block id lists stay Python lists (cheap to build from JSON); their types and ranges are checked
  in bulk, one call per step and field kind, and located exactly only when the bulk check fails.
"""

from __future__ import annotations

from kvmap.trace.checks import Where, dict_field, int_field, int_lists, str_list, type_name
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


def _duplicate(ids: list[str]) -> str | None:
    """The first request id that repeats, if any."""
    if len(set(ids)) == len(ids):
        return None
    seen: set[str] = set()
    return next(r for r in ids if r in seen or seen.add(r))


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
    G = header.num_groups
    id_lists: list[tuple[str | None, str, int | None, object]] = []  # token ids
    block_lists: list[tuple[str | None, str, int | None, object]] = []  # block ids

    # -- scheduled_new_reqs
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
        blocks = _group_lists(r.get("block_ids"), G, where, req_id, "block_ids")
        for g, b in enumerate(blocks):
            block_lists.append((req_id, "block_ids", g, b))
        nc = int_field(r.get("num_computed_tokens"), where, "num_computed_tokens", minimum=0,
                  maximum=header.max_model_len, req_id=req_id)
        new_reqs.append(NewRequestData(req_id, prompt, blocks, nc, prefill))

    # -- scheduled_cached_reqs (column-oriented)
    c = so.get("scheduled_cached_reqs") or {}
    c = dict_field(c, where, "scheduled_cached_reqs")
    req_ids = str_list(c.get("req_ids"), where, "scheduled_cached_reqs.req_ids")
    n = len(req_ids)
    if "resumed_req_ids" in c or "resumed_from_preemption" not in c:
        resumed = set(str_list(c.get("resumed_req_ids"), where, "scheduled_cached_reqs.resumed_req_ids"))
    else:  # before #27756: a list of booleans aligned with req_ids
        flags = c["resumed_from_preemption"]
        if not isinstance(flags, list) or len(flags) != n or not all(type(f) is bool for f in flags):
            raise where.error(f"expected {n} booleans", field="scheduled_cached_reqs.resumed_from_preemption")
        resumed = {r for r, f in zip(req_ids, flags) if f}
    stray = [r for r in resumed if r not in req_ids]
    if stray:
        raise where.error("resumed but not in scheduled_cached_reqs.req_ids", req_id=stray[0],
                          field="scheduled_cached_reqs.resumed_req_ids")
    nc_list = c.get("num_computed_tokens", [])
    if not isinstance(nc_list, list) or len(nc_list) != n:
        raise where.error(f"expected a list of {n} integers (one per req_ids entry)",
                          field="scheduled_cached_reqs.num_computed_tokens")
    limit = header.max_model_len
    if n and not all(type(v) is int and 0 <= v <= limit for v in nc_list):
        for r, v in zip(req_ids, nc_list):
            int_field(v, where, "scheduled_cached_reqs.num_computed_tokens", minimum=0, maximum=limit, req_id=r)
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
        all_tok = dict_field(c.get("all_token_ids") or {}, where, "scheduled_cached_reqs.all_token_ids")
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
    nst = dict_field(so.get("num_scheduled_tokens"), where, "num_scheduled_tokens")
    vals = list(nst.values())
    if not all(type(v) is int and 0 < v <= limit for v in vals):
        for r, v in nst.items():
            int_field(v, where, "num_scheduled_tokens", minimum=1, maximum=limit, req_id=r)
    total = int_field(so.get("total_num_scheduled_tokens"), where, "total_num_scheduled_tokens", minimum=0)
    if sum(vals) != total:
        raise where.error(f"is {total} but num_scheduled_tokens adds up to {sum(vals)}",
                          field="total_num_scheduled_tokens", kind="total_mismatch")
    dup = _duplicate([r.req_id for r in new_reqs] + req_ids)
    if dup is not None:
        twice = "in both scheduled_new_reqs and scheduled_cached_reqs" if dup in req_ids and any(
            r.req_id == dup for r in new_reqs) else "twice in its list"
        raise where.error(f"scheduled {twice}", req_id=dup, field="num_scheduled_tokens",
                          kind="duplicate_request")
    if len(nst) != len(new_reqs) + n:
        scheduled = {r.req_id for r in new_reqs}.union(req_ids)
        extra = [r for r in nst if r not in scheduled]
        missing = [r for r in scheduled if r not in nst]
        culprit = (extra or missing)[0]
        raise where.error(
            f"num_scheduled_tokens has {len(nst)} requests but {len(new_reqs)} new + {n} cached are scheduled"
            + (" (not in scheduled_new_reqs or scheduled_cached_reqs)" if extra else
               " (scheduled but missing from num_scheduled_tokens)"),
            req_id=culprit, field="num_scheduled_tokens")
    for r in new_reqs:
        if r.req_id not in nst:
            raise where.error("scheduled as new but missing from num_scheduled_tokens", req_id=r.req_id,
                              field="num_scheduled_tokens")
    for r in req_ids:
        if r not in nst:
            raise where.error("scheduled as cached but missing from num_scheduled_tokens", req_id=r,
                              field="num_scheduled_tokens")

    spec = dict_field(so.get("scheduled_spec_decode_tokens") or {}, where, "scheduled_spec_decode_tokens")
    for r, drafts in spec.items():
        if r not in nst:
            raise where.error("has drafts but is not scheduled", req_id=r, field="scheduled_spec_decode_tokens")
        if isinstance(drafts, list) and len(drafts) >= nst[r]:
            raise where.error(f"{len(drafts)} drafts do not fit in {nst[r]} scheduled tokens", req_id=r,
                              field="scheduled_spec_decode_tokens")
        # async scheduling writes -1 placeholders for drafts that live on the GPU
        id_lists.append((r, "scheduled_spec_decode_tokens", None, [d for d in drafts if d != -1]
                         if isinstance(drafts, list) else drafts))

    finished = str_list(so.get("finished_req_ids"), where, "finished_req_ids")
    preempted = str_list(so.get("preempted_req_ids"), where, "preempted_req_ids")

    # -- model output
    sampled = obj.get("sampled_token_ids")
    if sampled is not None:
        sampled = dict_field(sampled, where, "sampled_token_ids")
        for r, toks in sampled.items():
            if r not in nst:
                raise where.error("has sampled tokens but was not scheduled", req_id=r, field="sampled_token_ids")
            id_lists.append((r, "sampled_token_ids", None, toks))
    drafts_out = obj.get("draft_token_ids")
    if drafts_out is not None:
        drafts_out = dict_field(drafts_out, where, "draft_token_ids")
        for r, toks in drafts_out.items():
            id_lists.append((r, "draft_token_ids", None, toks))

    async_spec = _async_spec(obj, where, spec, set(req_ids), id_lists) if ASYNC_SPEC_KEYS.intersection(obj) else None

    int_lists(id_lists, where, maximum=TOKEN_ID_LIMIT, what="token id")
    int_lists(block_lists, where, maximum=header.num_gpu_blocks, what="block id")

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
        async_spec=async_spec,
    )


def _async_spec(obj: dict, where: Where, spec: dict, cached: set[str], id_lists: list) -> AsyncSpecDecode:
    """The async speculative-decoding keys: real drafts (one per placeholder), rejections, corrections."""
    real = dict_field(obj.get("spec_draft_token_ids") or {}, where, "spec_draft_token_ids")
    for r, toks in real.items():
        placeholders = spec.get(r)
        if placeholders is None or not isinstance(toks, list) or len(toks) != len(placeholders):
            raise where.error(f"needs one draft per scheduled placeholder ({len(placeholders or [])})",
                              req_id=r, field="spec_draft_token_ids")
        id_lists.append((r, "spec_draft_token_ids", None, toks))
    rejected = dict_field(obj.get("num_rejected_tokens") or {}, where, "num_rejected_tokens")
    for r, k in rejected.items():
        int_field(k, where, "num_rejected_tokens", minimum=0, maximum=len(spec.get(r, ())), req_id=r)
    corr = dict_field(obj.get("num_computed_tokens_correction") or {}, where, "num_computed_tokens_correction")
    for r, k in corr.items():
        int_field(k, where, "num_computed_tokens_correction", minimum=0, req_id=r)
        if r not in cached:
            raise where.error("a correction for a request that is not in scheduled_cached_reqs", req_id=r,
                              field="num_computed_tokens_correction")
    return AsyncSpecDecode(real, rejected, corr)
