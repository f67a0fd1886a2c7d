"""The fast step parser: a well-formed line in the current vLLM form, checked with whole-list builtins.

Rules: `fast_step` returns exactly the `Step` that `parse.parse_step` would return, or None whenever anything
is off (a problem, a legacy form, a value the checked parser accepts only after a closer look); the caller then
runs `parse_step`, which names the problem. A line is never accepted by one and rejected by the other
(tests/test_trace_fast.py).
"""

from __future__ import annotations

from itertools import chain, compress

from kvmap.trace.checks import Where
from kvmap.trace.records import (ASYNC_SPEC_KEYS, TOKEN_ID_LIMIT, AsyncSpecDecode, CachedRequestData, NewRequestData,
                                 SchedulerOutput, Step, TraceHeader)

_INT, _STR, _LIST = {int}, {str}, {list}


def _strs(values: object) -> bool:
    return values is None or (type(values) is list and (not values or set(map(type, values)) == _STR))


def fast_step(obj: object, header: TraceHeader, where: Where) -> Step | None:
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
    if not _strs(resumed) or (resumed and not (_strs(req_ids) and set(resumed) <= set(req_ids))):
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
            listed = set(req_ids)
            if not keys >= listed or any(r.req_id not in nst for r in new_reqs) \
                    or len(listed.union(r.req_id for r in new_reqs)) != len(nst):  # a request listed twice
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
    async_spec = None
    if ASYNC_SPEC_KEYS.intersection(obj):
        async_spec = _async_spec(obj, spec, set(req_ids), token_lists)
        if async_spec is None:
            return None
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
        async_spec=async_spec,
    )


def _async_spec(obj: dict, spec: dict, cached: set, token_lists: list) -> AsyncSpecDecode | None:
    """The async spec-decode keys when they are well formed (the real drafts join `token_lists`), else None."""
    real = obj.get("spec_draft_token_ids") or {}
    rejected = obj.get("num_rejected_tokens") or {}
    corr = obj.get("num_computed_tokens_correction") or {}
    if type(real) is not dict or type(rejected) is not dict or type(corr) is not dict:
        return None
    for r, toks in real.items():
        if type(toks) is not list or len(toks) != len(spec.get(r, (0,) * (len(toks) + 1))):
            return None
    counts = list(rejected.values()) + list(corr.values())
    if counts and (set(map(type, counts)) != _INT or min(counts) < 0):
        return None
    if any(k > len(spec.get(r, ())) for r, k in rejected.items()) or not cached.issuperset(corr):
        return None
    token_lists += real.values()
    return AsyncSpecDecode(real, rejected, corr)
