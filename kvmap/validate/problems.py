"""Validation problems: the kinds (codes), one located problem, and the report `kvmap validate` returns.

Rules: every problem has a kind from `KINDS`, set where it is raised (a parse error carries its code on the
`TraceError`); renderers and `--json` read only these records. At most `KEPT_PROBLEMS` records are kept
(`KeptProblems`); beyond them only a count per kind, so that memory stays bounded on any input (a file of
blank lines has one problem a line).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from kvmap.errors import format_location

KINDS = {
    "json": "line is not JSON or is truncated",
    "schema": "a field has the wrong type or shape",
    "step_order": "step numbers are not consecutive from 0",
    "total_mismatch": "total_num_scheduled_tokens differs from the sum of num_scheduled_tokens",
    "block_range": "a block id is outside the pool",
    "budget_tokens": "more tokens than the header's token budget",
    "budget_seqs": "more requests than max_num_seqs (scheduled, or holding worker rows)",
    "max_model_len": "a position beyond max_model_len",
    "unknown_request": "a cached request the worker does not know",
    "scheduled_after_finish": "a request scheduled after it finished",
    "new_id_not_new": "a new request whose id is held by a preempted request (it must come back resumed)",
    "continuation_mismatch": "a streaming-input continuation (a live id sent as new) whose prompt does not extend "
                             "what the request held, whose num_computed_tokens pass the kept tokens, or whose "
                             "block row drops a held block",
    "preempted_scheduled": "a preempted request scheduled without being resumed",
    "preempted_in_step": "a request preempted and scheduled in the same step (v2: also re-added as new)",
    "resumed_no_blocks": "a resumed request without its replacement block row",
    "duplicate_request": "a request listed twice among the scheduled (new and cached, or twice in one list)",
    "computed_ahead": "num_computed_tokens runs ahead of what was computed",
    "computed_back": "num_computed_tokens goes back without a rollback or preemption to explain it",
    "tokens_unknown": "scheduled positions past the request's known tokens",
    "no_block": "a scheduled position has no block",
    "null_block": "a position the step reads or writes (its context included) maps to the null block",
    "double_allocation": "one block held by two live requests for different tokens or positions",
    "block_repeated": "one block at two logical positions of the same request's row",
    "group_conflict": "one block id held by two KV cache groups at once (every group draws from one block pool)",
    "finished_twice": "a request listed in finished_req_ids again after it finished (vLLM frees a request once; "
                      "replay ignores it, as vLLM's workers ignore finished ids they hold no row for)",
    "window_conflict": "a sliding-window block read inside the window by two requests for different tokens",
    "partial_sampled": "a partial prefill chunk sampled tokens",
    "too_many_sampled": "more sampled tokens than 1 + drafts",
    "rejected_mismatch": "num_rejected_tokens disagrees with the drafts and the sampled tokens",
    "drafts_mismatch": "scheduled drafts are not (a prefix of) the drafts proposed the step before",
    "too_many_drafts": "more scheduled drafts than the header's num_speculative_tokens",
    "header": "header values contradict each other",
    "conformance": "a backend's mappings differ from the reference (validate --deep)",
    "kv_mismatch": "a backend's KV read-back found another token's bits (validate --deep)",
    "row_width": "a block-table row wider than cdiv(max_model_len, block_size * cp)",
    "cascade": "a step claims common prefix blocks (num_common_prefix_blocks): cascade attention, which vLLM 0.33 "
               "removed; kvmap's forward inputs are those of vLLM 0.33 (common_prefix_len 0)",
    "cross_rank": "a cross-rank invariant fails: a token local on no DCP rank or several, local lengths that do "
                  "not sum to seq_len, a kernel row that is not its manager row expanded (validate --deep)",
}


@dataclass(slots=True)
class Problem:
    kind: str
    message: str
    line: int | None = None
    step: int | None = None
    req_id: str | None = None
    group: int | None = None
    field: str | None = None

    def where(self) -> str:
        return format_location(None, self.line, self.step, self.req_id, self.group, self.field)


KEPT_PROBLEMS = 10_000  # records kept; every problem beyond is counted by kind


class KeptProblems(list):
    """The first `cap` problems, in order; `not_kept` counts the rest by kind."""

    def __init__(self, cap: int = KEPT_PROBLEMS) -> None:
        super().__init__()
        self.cap, self.not_kept = cap, Counter()

    def append(self, p: Problem) -> None:
        if len(self) < self.cap:
            super().append(p)
        else:
            self.not_kept[p.kind] += 1

    def extend(self, problems) -> None:
        for p in problems:
            self.append(p)

    def found(self) -> int:
        """Every problem found, kept or not."""
        return len(self) + sum(self.not_kept.values())

    def by_kind(self) -> Counter:
        return Counter(p.kind for p in self) + self.not_kept


@dataclass
class ValidationReport:
    trace: str
    steps: int = 0
    requests: int = 0
    problems: KeptProblems = field(default_factory=KeptProblems)
    truncated: bool = False  # stopped at --max-problems
    info: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # e.g. the file ends early (a recording cut short)
    deep: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.problems, KeptProblems):  # a plain list of problems (tests, tools)
            kept = KeptProblems(max(KEPT_PROBLEMS, len(self.problems)))
            kept.extend(self.problems)
            self.problems = kept

    @property
    def valid(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"trace": self.trace, "valid": self.valid, "steps": self.steps, "requests": self.requests,
                "problems": [asdict(p) for p in self.problems], "by_kind": dict(self.problems.by_kind()),
                "problems_found": self.problems.found(), "problems_not_kept": dict(self.problems.not_kept),
                "truncated": self.truncated, "info": self.info, "warnings": self.warnings, "deep": self.deep}
