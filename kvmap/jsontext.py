"""JSON text of a document holding numpy arrays and streamed lists, made piece by piece: exactly the bytes
`json.dumps(doc, indent=1)` makes of the same document with every array as its `tolist()` and every `Stream` as
the list of its items, without ever holding that document (a saved run of 200k steps: 145 MiB as lists).

Rules:
- Only what may be long is streamed: an ndarray (integer or boolean, any number of dimensions) is turned into
  text `CHUNK` rows at a time straight from its own memory (an array mapped from disk lets each chunk go again:
  ondisk.py); a `Stream` (an iterable of lists of JSON values) one list at a time; a dict holding either is
  walked key by key (its keys are strings). Every other value is
  `json.dumps`'s own text, re-indented to its depth (a JSON string holds no raw newline: every newline in that
  text starts an indented line).
- json's form with an indent: `[]` and `{}` when empty, else each item on its own line, indented one step more
  than its container, items separated by ",", keys by ": "; integers as `int.__repr__`, every other scalar as
  `json.dumps` writes it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Callable

import numpy as np

from kvmap.ondisk import release

CHUNK = 1024  # rows of an array turned into text at once


class Stream:
    """A JSON array written as it is produced: `parts` yields lists of its items, in order (empty lists too)."""

    def __init__(self, parts: Iterable[list]) -> None:
        self.parts = parts


def iter_json(doc: object, indent: int = 1) -> Iterator[str]:
    """The text of `doc` (module rules), in pieces; no newline at the end."""
    return _value(doc, 0, indent)


def _streamed(v: object) -> bool:
    return isinstance(v, (np.ndarray, Stream)) or isinstance(v, dict) and any(_streamed(x) for x in v.values())


def _value(v: object, level: int, ind: int) -> Iterator[str]:
    if isinstance(v, np.ndarray):
        yield from _array(v, level, ind)
    elif isinstance(v, Stream):
        yield from _stream(v, level, ind)
    elif isinstance(v, dict) and _streamed(v):
        yield from _dict(v, level, ind)
    else:
        yield _plain(v, level, ind)


def _plain(v: object, level: int, ind: int) -> str:
    """json's text of `v` with its `[` or `{` at depth `level`."""
    text = json.dumps(v, indent=ind)
    return text.replace("\n", "\n" + " " * (ind * level)) if level else text


def _dict(d: dict, level: int, ind: int) -> Iterator[str]:
    first = "{\n" + " " * (ind * (level + 1))
    for k, (key, v) in enumerate(d.items()):
        assert isinstance(key, str), key  # json would turn 1 into "1": only string keys are walked
        yield (first if k == 0 else ",\n" + " " * (ind * (level + 1))) + json.dumps(key) + ": "
        yield from _value(v, level + 1, ind)
    yield "\n" + " " * (ind * level) + "}"


def _array(a: np.ndarray, level: int, ind: int) -> Iterator[str]:
    """`a.tolist()`'s text, CHUNK rows at a time."""
    if a.ndim == 0 or a.dtype.kind not in "iub":
        yield _plain(a.tolist(), level, ind)  # a scalar or a float array: json's own text
        return
    if not len(a):
        yield "[]"
        return
    fmt: Callable[[object], str] = str if a.dtype.kind in "iu" else json.dumps
    pad = "\n" + " " * (ind * (level + 1))
    for i in range(0, len(a), CHUNK):
        yield ("[" if i == 0 else ",") + pad + _items(a[i : i + CHUNK].tolist(), level, ind, fmt)
        release(a)  # an array on disk: the chunk's pages go (ondisk.py)
    yield "\n" + " " * (ind * level) + "]"


def _items(lst: list, level: int, ind: int, fmt: Callable[[object], str]) -> str:
    """The items of non-empty `lst` (whose `[` stands at depth `level`), joined by "," and a new line each."""
    sep = ",\n" + " " * (ind * (level + 1))
    if isinstance(lst[0], list):
        return sep.join([_list(x, level + 1, ind, fmt) for x in lst])
    return sep.join(map(fmt, lst))


def _list(lst: list, level: int, ind: int, fmt: Callable[[object], str]) -> str:
    if not lst:
        return "[]"
    return "[\n" + " " * (ind * (level + 1)) + _items(lst, level, ind, fmt) + "\n" + " " * (ind * level) + "]"


def _stream(s: Stream, level: int, ind: int) -> Iterator[str]:
    """The items of every part, as json writes them one step deeper than the list's `[`."""
    first = True
    pad = "\n" + " " * (ind * level)
    for part in s.parts:
        if not part:
            continue
        text = json.dumps(part, indent=ind)[2 + ind : -2]  # without "[\n", the first item's indent, "\n]"
        yield ("[" if first else ",") + pad + " " * ind + (text.replace("\n", pad) if level else text)
        first = False
    yield "[]" if first else pad + "]"
