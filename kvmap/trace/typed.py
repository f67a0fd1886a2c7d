"""The typed step decoder: JSON text straight to checked values in one pass (msgspec), for `Trace.decode`.

Rules:
- One of the two step decoders (the other is the checked parser, `parse.py`, its oracle). It returns the `Step`
  that `parse_step` would return, or None whenever anything is off, and the caller then runs `parse_step`,
  which names the problem or converts a legacy form. tests/test_fuzz_multi.py holds the two to the same
  results on lines with several fields edited at once.
- A line is UTF-8 throughout, the members it skips included (msgspec does not check what it skips): a line
  that is not goes to the checked path, which names the byte.
- The types carry the header's bounds (token ids in [0, 2**31), block ids in the pool, counts within
  max_model_len, one list per KV cache group), so the decoder checks every int as it builds it, and unknown
  keys (most of a vLLM SchedulerOutput) are skipped without building them.
- What a type cannot say (a list as long as another, keys of one dict present in another, sums) is
  `invariants.check_step`'s, the same function the checked parser calls. A legacy key's presence sends the line
  to the checked path.
- msgspec is optional: without it `typed_decoder` returns None and the checked path does everything.
"""

# no `from __future__ import annotations`: msgspec reads the Struct annotations, local to typed_decoder, at once
from collections.abc import Callable
from typing import Annotated, Any, Optional, Union

from kvmap.errors import TraceError
from kvmap.trace.invariants import check_step
from kvmap.trace.records import (TOKEN_ID_LIMIT, AsyncSpecDecode, CachedRequestData, NewRequestData,
                                 SchedulerOutput, Step, TraceHeader)

try:
    import msgspec
except ImportError:  # pragma: no cover
    msgspec = None


def _line_types(header: TraceHeader) -> tuple[type, type]:
    """(Line, Cached): the msgspec types of a step line and of its cached requests, with this header's bounds."""
    M, S, UNSET, UnsetType = msgspec.Meta, msgspec.Struct, msgspec.UNSET, msgspec.UnsetType
    G = header.num_groups
    limit = header.max_model_len
    Tok = Annotated[int, M(ge=0, lt=TOKEN_ID_LIMIT)]
    Blk = Annotated[int, M(ge=0, lt=header.num_gpu_blocks)]
    Computed = Annotated[int, M(ge=0, le=limit)]
    Count = Annotated[int, M(ge=1, le=limit)]
    Draft = Annotated[int, M(ge=-1, lt=TOKEN_ID_LIMIT)]  # async scheduling sends -1 placeholders
    Groups = Annotated[list[list[Blk]], M(min_length=G, max_length=G)]  # [num_groups][blocks]

    class NewReq(S):
        req_id: str
        block_ids: Groups
        num_computed_tokens: Computed
        prompt_token_ids: Optional[list[Tok]] = None
        prefill_token_ids: Optional[list[Tok]] = None

    class Cached(S):
        req_ids: Optional[list[str]] = None
        resumed_req_ids: Union[list[str], None, UnsetType] = UNSET
        new_block_ids: Union[list[Optional[Groups]], UnsetType] = UNSET
        num_computed_tokens: list[Computed] = []
        all_token_ids: Optional[dict[str, list[Tok]]] = None
        num_output_tokens: Optional[list[int]] = None  # parse_step takes any entries: others go there
        resumed_from_preemption: Any = UNSET  # legacy keys: their presence sends the line to the checked path
        resumed_req_token_ids: Any = UNSET

    class Sched(S):
        num_scheduled_tokens: dict[str, Count]
        total_num_scheduled_tokens: int
        scheduled_new_reqs: list[NewReq] = []
        scheduled_cached_reqs: Optional[Cached] = None
        scheduled_spec_decode_tokens: Optional[dict[str, list[Draft]]] = None
        finished_req_ids: Optional[list[str]] = None
        preempted_req_ids: Optional[list[str]] = None

    class Line(S):
        step: int
        scheduler_output: Sched
        sampled_token_ids: Optional[dict[str, list[Tok]]] = None
        draft_token_ids: Optional[dict[str, list[Tok]]] = None
        kind: Union[str, None, UnsetType] = UNSET  # a non-string: the checked path
        # async speculative decoding (docs/trace-format.md): the real drafts, rejections, corrections
        spec_draft_token_ids: Union[dict[str, list[Tok]], UnsetType] = UNSET
        num_rejected_tokens: Union[dict[str, Annotated[int, M(ge=0)]], UnsetType] = UNSET
        num_computed_tokens_correction: Union[dict[str, Annotated[int, M(ge=0)]], UnsetType] = UNSET

    return Line, Cached


def typed_decoder(header: TraceHeader) -> Callable[[str | bytes, int, int], Step | None] | None:
    """A decoder for this header's step lines: `decode(raw, line, step) -> Step | None` (None: use the checked
    path). None when msgspec is not installed."""
    if msgspec is None:
        return None
    Line, Cached = _line_types(header)
    UNSET = msgspec.UNSET
    k = header.num_speculative_tokens
    decode_raw = msgspec.json.Decoder(Line).decode
    empty = Cached()
    DecodeError = msgspec.DecodeError  # ValidationError is a subclass

    def decode(raw: str | bytes, line: int, step: int) -> Step | None:
        if type(raw) is bytes and not raw.isascii():
            try:  # msgspec skips unknown members without checking their UTF-8; the checked path names the byte
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return None
        try:
            d = decode_raw(raw)
        except (DecodeError, RecursionError):  # nested past msgspec's depth in a skipped member: the checked path
            return None
        if d.step != step or d.kind == "header":
            return None
        so = d.scheduler_output
        new_reqs = []
        for r in so.scheduled_new_reqs:
            prompt, prefill = r.prompt_token_ids, r.prefill_token_ids
            if prompt is None:
                if prefill is None:
                    return None
                prompt = prefill
            new_reqs.append(NewRequestData(r.req_id, prompt, r.block_ids, r.num_computed_tokens, prefill))
        c = so.scheduled_cached_reqs or empty
        if c.resumed_from_preemption is not UNSET and c.resumed_req_ids is UNSET \
                or c.resumed_req_token_ids is not UNSET and c.all_token_ids is None:
            return None  # a legacy form (or a null where the key decides): the checked path converts it
        req_ids = c.req_ids or []
        nb = c.new_block_ids
        resumed = c.resumed_req_ids
        step = Step(step, line, SchedulerOutput(  # positional, in field order: cheaper than keywords per line
            new_reqs,
            CachedRequestData(req_ids, set(resumed) if resumed else set(), [None] * len(req_ids) if nb is UNSET
                              else nb, c.num_computed_tokens, c.all_token_ids or {}, c.num_output_tokens),
            so.num_scheduled_tokens, so.total_num_scheduled_tokens, so.scheduled_spec_decode_tokens or {},
            so.finished_req_ids or [], so.preempted_req_ids or [],
        ), d.sampled_token_ids, d.draft_token_ids, _async_spec(d))
        try:
            return check_step(step, k)
        except TraceError:
            return None  # the checked path names it, with every earlier problem of the line first

    def _async_spec(d) -> AsyncSpecDecode | None:
        if d.spec_draft_token_ids is UNSET and d.num_rejected_tokens is UNSET \
                and d.num_computed_tokens_correction is UNSET:
            return None
        return AsyncSpecDecode(d.spec_draft_token_ids or {}, d.num_rejected_tokens or {},
                               d.num_computed_tokens_correction or {})

    return decode
