"""The one user-facing error type.

Rules: input from outside (trace files, workload files, options) is checked at the boundary and rejected with
a `KvmapError` that says where (file:line, step, request, group, field) and what. The CLI catches it once,
prints one line and exits with `exit_code` (2: unusable input or usage). Invariants inside kvmap stay
`assert`s: they are bugs, not user errors.
"""

from __future__ import annotations


class KvmapError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        step: int | None = None,
        req_id: str | None = None,
        group: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.line = line
        self.step = step
        self.req_id = req_id
        self.group = group
        self.field = field

    def located(self, **where: object) -> KvmapError:
        """Fill in location parts that the raiser did not know (never overwrites what it did know)."""
        for key, value in where.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        return self

    def __str__(self) -> str:
        where = []
        if self.path is not None:
            where.append(f"{self.path}:{self.line}" if self.line is not None else self.path)
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.req_id is not None:
            where.append(f"request {self.req_id!r}")
        if self.group is not None:
            where.append(f"group {self.group}")
        if self.field is not None:
            where.append(f"field {self.field}")
        prefix = ", ".join(where)
        return f"{prefix}: {self.message}" if prefix else self.message


class TraceError(KvmapError):
    """The trace file is malformed or inconsistent."""
