"""validate's salvage of a step line that did not parse: its well-formed parts still inform the shadow model.

Rules: finished and preempted ids that parse are applied (so a bad field elsewhere on the line cannot cause
false double allocations later); cached ids the model does not know are reported as on a parsed line;
appended blocks and sampled tokens that parse are followed; requests whose state the line hid (added,
resumed, or with nothing usable) become uncertain until they finish or are added again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmap.validate.shadow import Validator


def salvage(v: Validator, obj: object, mentioned: set[str], line: int, step_idx: int) -> None:
    """A step line that did not parse: its well-formed parts still count (finished and preempted ids,
    cached ids the model does not know, appended blocks, sampled tokens); what it hid stops being
    checked: requests it added stay unchecked until they finish, the others skip their next
    num_computed_tokens check."""
    so = _get(obj, "scheduler_output")
    c = _get(so, "scheduled_cached_reqs")
    finished, preempted = _strs(_get(so, "finished_req_ids")), _strs(_get(so, "preempted_req_ids"))
    v._free(finished, preempted)
    new_ids = set(_strs([_get(nr, "req_id") for nr in _list(_get(so, "scheduled_new_reqs"))]))
    resumed = set(_strs(_get(c, "resumed_req_ids")))
    for r in _strs(_get(c, "req_ids")):
        if r not in v.reqs and r not in v.uncertain and r not in new_ids:
            v._unknown(None, r, line=line, step_idx=step_idx)
    appended: set[str] = set()
    for r, new in zip(_list(_get(c, "req_ids")), _list(_get(c, "new_block_ids"))):
        req = v.reqs.get(r) if isinstance(r, str) and r not in resumed else None
        if req is None or new is None:
            continue
        if (isinstance(new, list) and len(new) == len(req.blocks)
                and all(isinstance(b, list) and all(type(x) is int for x in b) for b in new)):
            for g, b in enumerate(new):
                req.blocks[g].extend(b)
            appended.add(r)
    sampled = _get(obj, "sampled_token_ids")
    for r in mentioned:
        req = v.reqs.get(r)
        if req is None or r in resumed or r in new_ids:
            v.uncertain.add(r)
            continue
        req.expected_nc = None  # resynchronise from the next value the scheduler sends
        toks = sampled.get(r) if isinstance(sampled, dict) else None
        if isinstance(toks, list) and all(type(t) is int for t in toks):
            req.tokens.extend(toks)
        elif toks is None and r not in appended:
            v.uncertain.add(r)



def _get(obj: object, key: str) -> object:
    return obj.get(key) if isinstance(obj, dict) else None


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _strs(value: object) -> list[str]:
    """The strings of a list that may be malformed (a bad line's well-formed part)."""
    return [v for v in value if type(v) is str] if isinstance(value, list) else []
