"""A part's result whose objects are made when first read, outside the timed phase.

Rule: a part may return `Deferred(make)` when the step's arrays are computed (the timed work is done) and only
the objects around them remain: `ForwardInputs` calls `make()` on the first read of the part (an attribute, or
`to_dict` for the dump) and keeps the result. `make` reads the step's buffers: it runs within the step, as every
reader of a part does (results are views valid until the next step). No later part may read a deferred one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Deferred:
    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make  # () -> the part's result
