"""Typed field checks for the trace boundary: each raises a located `TraceError` naming the field.

Rules: a check returns the value it accepted (or raises); bulk checks (`int_lists`) test whole lists at once
and only look at entries one by one to name the culprit when the bulk test fails. A boolean is never an
integer (`type(v) is int`, not `isinstance`).
"""

from __future__ import annotations

import json
from itertools import chain

from kvmap.errors import TraceError



def _int(digits: str) -> int | float:
    return int(digits) if len(digits) <= 4300 else float("inf")  # the value of a number no int can be here


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def stdlib_loads(text: str | bytes) -> object:
    """`json.loads` accepting and refusing what the typed decoder does, failing only as orjson does (with a
    `JSONDecodeError`): NaN and Infinity are not JSON; an integer past the standard library's 4300 digits is
    infinity, as 1e400 is (a field kvmap reads then fails its type check; one it skips is skipped); deep
    nesting is refused."""
    try:
        return json.loads(text, parse_int=_int, parse_constant=_not_json)
    except json.JSONDecodeError:
        raise
    except (RecursionError, ValueError) as e:  # UnicodeDecodeError too: json_error names the byte
        raise json.JSONDecodeError(str(e), "", 0) from None


try:  # orjson decodes a step line about twice as fast; the standard library is the fallback
    from orjson import JSONDecodeError as _OrjsonError
    from orjson import loads as _orjson_loads

    def loads(text: str | bytes) -> object:
        """orjson's, but a number past a double's range (1e400, 310 digits and more) is JSON: such a line is
        the standard library's, as the typed decoder skips such numbers in the members it does not read."""
        try:
            return _orjson_loads(text)
        except _OrjsonError as e:
            if not str(e).startswith("number is infinity"):
                raise
        return stdlib_loads(text)
except ImportError:  # pragma: no cover
    loads = stdlib_loads

_INT = {int}


class Where:
    """Location of the value being checked, for error messages."""

    __slots__ = ("path", "line", "step")

    def __init__(self, path: str, line: int, step: int | None) -> None:
        self.path, self.line, self.step = path, line, step

    def error(self, message: str, *, req_id: str | None = None, group: int | None = None,
              field: str | None = None, kind: str = "schema") -> TraceError:
        return TraceError(message, path=self.path, line=self.line, step=self.step, req_id=req_id,
                          group=group, field=field, kind=kind)


def type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def shown(value: object, width: int = 40) -> str:
    """A wrong value as an error shows it: its JSON type and text. A whole number past 64-bit integers is said to
    be one: the JSON library hands such an integer literal over as a float."""
    if value is None:
        return "null"
    if type(value) is float and value.is_integer() and abs(value) >= 2.0 ** 63:
        return f"a number past 64-bit integers ({value:.4g})"
    return f"{type_name(value)} {value!r:.{width}}"


def int_field(value: object, where: Where, name: str, *, minimum: int | None = None, maximum: int | None = None,
         req_id: str | None = None) -> int:
    if type(value) is not int:
        raise where.error(f"expected an integer, got {shown(value)}", field=name,
                          req_id=req_id)
    if minimum is not None and value < minimum:
        raise where.error(f"must be >= {minimum}, got {value}", field=name, req_id=req_id)
    if maximum is not None and value > maximum:
        raise where.error(f"must be <= {maximum}, got {value}", field=name, req_id=req_id)
    return value


def str_list(value: object, where: Where, name: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(type(v) is str for v in value):
        raise where.error(f"expected a list of request ids (strings), got {value!r:.60}", field=name)
    return value


def dict_field(value: object, where: Where, name: str) -> dict:
    if not isinstance(value, dict):
        raise where.error(f"expected an object, got {type_name(value)}", field=name)
    return value


def int_lists(items: list[tuple[str | None, str, int | None, object]], where: Where, *,
               minimum: int = 0, maximum: int | None = None, what: str = "id") -> None:
    """Check that every value in `items` is a list of ints within [minimum, maximum).

    `items` holds (req_id, field, group, value). One builtin pass over the ints checks them all; only when that fails
    is each list looked at on its own, to name the culprit.
    """
    if not items:
        return
    lists = [v for _, _, _, v in items]
    ok = all(type(v) is list for v in lists)
    if ok:
        flat = list(chain.from_iterable(lists))
        if flat:
            ok = set(map(type, flat)) == _INT  # never a bool: `true` is not block 1
            if ok:
                lo, hi = min(flat), max(flat)
                ok = lo >= minimum and (maximum is None or hi < maximum)
    if ok:
        return
    for req_id, name, group, value in items:
        if type(value) is not list:
            raise where.error(f"expected a list of integers, got {type_name(value)}", req_id=req_id,
                              field=name, group=group)
        for i, v in enumerate(value):
            if type(v) is not int:
                raise where.error(f"entry {i} is {shown(v, 30)}, expected an integer",
                                  req_id=req_id, field=name, group=group)
            if v < minimum or (maximum is not None and v >= maximum):
                bound = f"[{minimum}, {maximum})" if maximum is not None else f">= {minimum}"
                raise where.error(f"{what} {v} at entry {i} is outside {bound}", req_id=req_id, field=name,
                                  group=group, kind="block_range" if what == "block id" else "schema")
    raise where.error("a value is not a list of integers in range")  # pragma: no cover
