"""The one user-facing error type.

Rules: input from outside (trace files, workload files, options) is checked at the boundary and rejected with
a `KvmapError` that says where (file:line, step, request, group, field) and what. The CLI catches it once,
prints one line and exits with `exit_code` (2: unusable input or usage). Invariants inside kvmap stay
`assert`s: they are bugs, not user errors.
"""

from __future__ import annotations


def format_location(path: str | None = None, line: int | None = None, step: int | None = None,
                    req_id: str | None = None, group: int | None = None, field: str | None = None) -> str:
    """`file:line, step N, request 'r', group G, field F` with whatever parts are known; a command-line
    option (a field that starts with "-") is named `option --steps`."""
    where = []
    if path is not None:
        where.append(f"{path}:{line}" if line is not None else path)
    elif line is not None:
        where.append(f"line {line}")
    if step is not None:
        where.append(f"step {step}")
    if req_id is not None:
        where.append(f"request {req_id!r}")
    if group is not None:
        where.append(f"group {group}")
    if field is not None:
        where.append(f"option {field}" if field.startswith("-") else f"field {field}")
    return ", ".join(where)


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
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind  # a problem code (validate/problems.py KINDS), set where the error is raised
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
        prefix = format_location(self.path, self.line, self.step, self.req_id, self.group, self.field)
        return f"{prefix}: {self.message}" if prefix else self.message


class TraceError(KvmapError):
    """The trace file is malformed or inconsistent; `kind` defaults to "schema" (a wrong type or shape)."""

    def __init__(self, message: str, **where) -> None:
        where.setdefault("kind", "schema")
        super().__init__(message, **where)
