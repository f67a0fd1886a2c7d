"""What a step line that did not parse still says: its well-formed parts, read leniently, for the validator's
shadow model to follow (shadow.py `Validator.salvage` applies them).

Rules: only what is well-formed is read (ids that are strings, block lists of lists of ints, token lists of
ints); anything else is left out, never guessed. Nothing here knows the shadow model: `read_bad_line` takes the
decoded object and returns plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BadLine", "read_bad_line"]


@dataclass(frozen=True, slots=True)
class BadLine:
    finished: list[str]  # finished_req_ids that are strings
    preempted: list[str]  # preempted_req_ids that are strings
    new_ids: frozenset[str]  # scheduled_new_reqs' req_ids that are strings
    resumed: frozenset[str]  # scheduled_cached_reqs.resumed_req_ids that are strings
    cached: list[str]  # scheduled_cached_reqs.req_ids that are strings
    appended: list[tuple[str, list[list[int]]]]  # (req_id, new_block_ids per group), not resumed, well-formed
    sampled: dict[str, list[int]]  # sampled_token_ids whose list is well-formed
    sampled_bad: frozenset[str]  # sampled_token_ids present with a malformed value


def read_bad_line(obj: object) -> BadLine:
    so = _get(obj, "scheduler_output")
    c = _get(so, "scheduled_cached_reqs")
    resumed = frozenset(_strs(_get(c, "resumed_req_ids")))
    appended = [(r, new) for r, new in zip(_list(_get(c, "req_ids")), _list(_get(c, "new_block_ids")))
                if isinstance(r, str) and r not in resumed and isinstance(new, list)
                and all(isinstance(b, list) and all(type(x) is int for x in b) for b in new)]
    raw = _get(obj, "sampled_token_ids")
    sampled = raw if isinstance(raw, dict) else {}
    good = {r: t for r, t in sampled.items() if isinstance(t, list) and all(type(x) is int for x in t)}
    return BadLine(
        finished=_strs(_get(so, "finished_req_ids")), preempted=_strs(_get(so, "preempted_req_ids")),
        new_ids=frozenset(_strs([_get(nr, "req_id") for nr in _list(_get(so, "scheduled_new_reqs"))])),
        resumed=resumed, cached=_strs(_get(c, "req_ids")), appended=appended, sampled=good,
        sampled_bad=frozenset(r for r, t in sampled.items() if t is not None and r not in good))


def _get(obj: object, key: str) -> object:
    return obj.get(key) if isinstance(obj, dict) else None


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _strs(value: object) -> list[str]:
    """The strings of a list that may be malformed (a bad line's well-formed part)."""
    return [v for v in value if type(v) is str] if isinstance(value, list) else []
