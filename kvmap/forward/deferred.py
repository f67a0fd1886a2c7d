"""A part's result whose objects are made when first read, outside the timed phase.

Rules:
- A part may return `Deferred(make, payload)` when the step's arrays are computed (the timed work is done)
  and only the objects around them remain: `ForwardInputs` calls `get()` on the first read of the part (an
  attribute, or `to_dict` for the dump), which makes the result once and keeps it. `make` reads the step's
  buffers: it runs within the step, as every reader of a part does (results are views valid until the next
  step).
- A later part's host function reads a deferred part only through its `payload` (what the part computed
  for the later ones, named by the part); a later part's own `make` may call `get()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_PENDING = object()


class Deferred:
    __slots__ = ("make", "payload", "_value")

    def __init__(self, make: Callable[[], Any], payload: Any = None) -> None:
        self.make = make  # () -> the part's result
        self.payload = payload  # what later parts read in the phase (None: nothing)
        self._value: Any = _PENDING

    def get(self) -> Any:
        """The part's result, made on the first call."""
        if self._value is _PENDING:
            self._value = self.make()
        return self._value
