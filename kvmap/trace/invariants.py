"""The cross-field rules of one step line: what no field's type can state, written once for every decoder.

Rules:
- `check_step` is the one owner of these rules. Both step decoders call it on the `Step` they built: the checked
  parser (`parse_step`) after checking every value's type and range, the typed decoder (`typed.py`) after
  msgspec has checked the same types and ranges. A third decoder, if one is ever written, calls it too.
- The rules: resumed ids are cached ids; the cached columns are as long as `req_ids`; the total is the sum of
  `num_scheduled_tokens`; no request is scheduled twice; `num_scheduled_tokens` lists exactly the scheduled
  requests; drafts belong to scheduled requests, number at most the header's `num_speculative_tokens` and
  leave room for one real token; sampled tokens belong to
  scheduled requests; the async spec-decode keys fit the drafts they describe.
- It raises the located `TraceError` of the first rule broken, in the order above, with the problem kind
  `kvmap validate` gives the same condition; a step that keeps every rule is returned unchanged.
- The common step (running requests only, `num_scheduled_tokens` in `req_ids` order) costs one list compare:
  a dict's keys cannot repeat, so equal lists mean no duplicate and the same set.
"""

from __future__ import annotations

from kvmap.errors import TraceError
from kvmap.trace.records import Step


def check_step(step: Step, num_speculative_tokens: int, path: str | None = None) -> Step:
    """`step` if it keeps every cross-field rule, else the located `TraceError` of the first one it breaks.
    `num_speculative_tokens`: the header's, the most drafts a request may have scheduled."""
    so = step.scheduler_output
    c = so.scheduled_cached_reqs
    req_ids = c.req_ids
    n = len(req_ids)
    if c.resumed_req_ids and not c.resumed_req_ids.issubset(req_ids):
        stray = min(r for r in c.resumed_req_ids if r not in req_ids)  # deterministic: a set has no order
        raise _error(step, path, "resumed but not in scheduled_cached_reqs.req_ids", stray,
                     "scheduled_cached_reqs.resumed_req_ids")
    if len(c.num_computed_tokens) != n:
        raise _error(step, path, f"expected a list of {n} integers (one per req_ids entry)",
                     field="scheduled_cached_reqs.num_computed_tokens")
    if len(c.new_block_ids) != n:
        raise _error(step, path, f"expected a list of {n} entries (one per req_ids entry)",
                     field="scheduled_cached_reqs.new_block_ids")
    if c.num_output_tokens is not None and len(c.num_output_tokens) != n:
        raise _error(step, path, f"expected {n} entries", field="scheduled_cached_reqs.num_output_tokens")
    nst = so.num_scheduled_tokens
    total = sum(nst.values())
    if total != so.total_num_scheduled_tokens:
        raise _error(step, path, f"is {so.total_num_scheduled_tokens} but num_scheduled_tokens adds up to {total}",
                     field="total_num_scheduled_tokens", kind="total_mismatch")
    if so.scheduled_new_reqs or len(nst) != n or list(nst) != req_ids:
        _check_scheduled(step, path)
    if so.scheduled_spec_decode_tokens or step.async_spec is not None:
        _check_drafts(step, num_speculative_tokens, path)
    sampled = step.sampled_token_ids
    if sampled and not sampled.keys() <= nst.keys():
        r = next(r for r in sampled if r not in nst)
        raise _error(step, path, "has sampled tokens but was not scheduled", r, "sampled_token_ids")
    return step


def _error(step: Step, path: str | None, message: str, req_id: str | None = None, field: str | None = None,
           kind: str = "schema") -> TraceError:
    return TraceError(message, path=path, line=step.line, step=step.step, req_id=req_id, field=field, kind=kind)


def _check_scheduled(step: Step, path: str | None) -> None:
    """No request scheduled twice, and `num_scheduled_tokens` names exactly the scheduled ones."""
    so = step.scheduler_output
    req_ids = so.scheduled_cached_reqs.req_ids
    new_ids = [r.req_id for r in so.scheduled_new_reqs]
    ids = new_ids + req_ids
    nst = so.num_scheduled_tokens
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(r for r in ids if r in seen or seen.add(r))
        twice = "in both scheduled_new_reqs and scheduled_cached_reqs" if dup in req_ids and dup in new_ids \
            else "twice in its list"
        raise _error(step, path, f"scheduled {twice}", dup, "num_scheduled_tokens", kind="duplicate_request")
    if len(nst) != len(ids):
        scheduled = set(ids)
        extra = [r for r in nst if r not in scheduled]
        missing = [r for r in ids if r not in nst]
        why = (" (not in scheduled_new_reqs or scheduled_cached_reqs)" if extra else
               " (scheduled but missing from num_scheduled_tokens)")
        raise _error(step, path, f"num_scheduled_tokens has {len(nst)} requests but {len(new_ids)} new + "
                     f"{len(req_ids)} cached are scheduled" + why, (extra or missing)[0], "num_scheduled_tokens")
    for kind, listed in (("new", new_ids), ("cached", req_ids)):
        for r in listed:
            if r not in nst:
                raise _error(step, path, f"scheduled as {kind} but missing from num_scheduled_tokens", r,
                             "num_scheduled_tokens")


def _check_drafts(step: Step, k: int, path: str | None) -> None:
    """Drafts belong to scheduled requests, number at most k and leave room for a real token; the async
    spec-decode keys fit them."""
    so = step.scheduler_output
    nst = so.num_scheduled_tokens
    spec = so.scheduled_spec_decode_tokens
    for r, drafts in spec.items():
        if r not in nst:
            raise _error(step, path, "has drafts but is not scheduled", r, "scheduled_spec_decode_tokens")
        if len(drafts) > k:
            raise _error(step, path, f"{len(drafts)} drafts, more than the header's num_speculative_tokens {k}", r,
                         "scheduled_spec_decode_tokens", kind="too_many_drafts")
        if len(drafts) >= nst[r]:
            raise _error(step, path, f"{len(drafts)} drafts do not fit in {nst[r]} scheduled tokens", r,
                         "scheduled_spec_decode_tokens")
    a = step.async_spec
    if a is None:
        return
    for r, toks in a.spec_draft_token_ids.items():
        placeholders = spec.get(r)
        if placeholders is None or len(toks) != len(placeholders):
            raise _error(step, path, f"needs one draft per scheduled placeholder ({len(placeholders or [])})", r,
                         "spec_draft_token_ids")
    for r, k in a.num_rejected_tokens.items():
        if k > len(spec.get(r, ())):
            raise _error(step, path, f"must be <= {len(spec.get(r, ()))}, got {k}", r, "num_rejected_tokens")
    cached = so.scheduled_cached_reqs.req_ids
    for r in a.num_computed_tokens_correction:
        if r not in cached:
            raise _error(step, path, "a correction for a request that is not in scheduled_cached_reqs", r,
                         "num_computed_tokens_correction")
