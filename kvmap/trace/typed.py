"""Typed decoding of a step line: JSON text straight to checked values in one pass (msgspec), for `Trace.steps`.

Rules:
- One more fast path in front of `fast_step`, with the same contract: it returns the `Step` that `parse_step`
  would return, or None whenever anything is off, and the caller then runs the checked path (orjson,
  `fast_step`, `parse_step`), which names the problem or converts a legacy form. So every check and message
  of the checked parser stays; tests/test_trace_fast.py holds all three to the same results.
- The types carry the header's bounds (token ids in [0, 2**31), block ids in the pool, counts within
  max_model_len, one list per KV cache group), so the decoder checks every int as it builds it: no second
  pass over the ids, and unknown keys (most of a vLLM SchedulerOutput) are skipped without building them.
- What a type cannot say (a list as long as another, keys of one dict present in another, sums, a legacy
  key's presence) is checked afterwards, per step, as `fast_step` checks it.
- msgspec is optional: without it `typed_decoder` returns None and the checked path does everything.
"""

# no `from __future__ import annotations`: msgspec reads the Struct annotations, local to typed_decoder, at once
from collections.abc import Callable
from typing import Annotated, Any, Optional, Union

from kvmap.trace.records import (TOKEN_ID_LIMIT, AsyncSpecDecode, CachedRequestData, NewRequestData,
                                 SchedulerOutput, Step, TraceHeader)

try:
    import msgspec
except ImportError:  # pragma: no cover
    msgspec = None


def typed_decoder(header: TraceHeader) -> Callable[[str | bytes, int, int], Step | None] | None:
    """A decoder for this header's step lines: `decode(raw, line, step) -> Step | None` (None: use the checked
    path). None when msgspec is not installed."""
    if msgspec is None:
        return None
    M, S, UNSET, UnsetType = msgspec.Meta, msgspec.Struct, msgspec.UNSET, msgspec.UnsetType
    G = header.num_groups
    limit = header.max_model_len
    Tok = Annotated[int, M(ge=0, lt=TOKEN_ID_LIMIT)]
    Blk = Annotated[int, M(ge=0, lt=header.num_gpu_blocks)]
    Computed = Annotated[int, M(ge=0, le=limit)]
    Count = Annotated[int, M(ge=1, le=limit)]
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
        scheduled_spec_decode_tokens: Optional[dict[str, list[int]]] = None
        finished_req_ids: Optional[list[str]] = None
        preempted_req_ids: Optional[list[str]] = None

    class Line(S):
        step: int
        scheduler_output: Sched
        sampled_token_ids: Optional[dict[str, list[Tok]]] = None
        draft_token_ids: Optional[dict[str, list[Tok]]] = None
        kind: Union[str, None, UnsetType] = UNSET  # a non-string: the checked path
        # async speculative decoding (trace-format.md): the real drafts, rejections, corrections
        spec_draft_token_ids: Union[dict[str, list[Tok]], UnsetType] = UNSET
        num_rejected_tokens: Union[dict[str, Annotated[int, M(ge=0)]], UnsetType] = UNSET
        num_computed_tokens_correction: Union[dict[str, Annotated[int, M(ge=0)]], UnsetType] = UNSET

    decode_raw = msgspec.json.Decoder(Line).decode
    empty = Cached()
    DecodeError = msgspec.DecodeError  # ValidationError is a subclass

    def decode(raw: str | bytes, line: int, step: int) -> Step | None:
        try:
            d = decode_raw(raw)
        except DecodeError:
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
        n = len(req_ids)
        nc_list = c.num_computed_tokens
        nb = c.new_block_ids
        if nb is UNSET:
            nb = [None] * n
        if len(nc_list) != n or len(nb) != n or (c.num_output_tokens is not None and len(c.num_output_tokens) != n):
            return None
        nst = so.num_scheduled_tokens
        if len(nst) != len(new_reqs) + n:
            return None
        keys = nst.keys()
        if list(keys) != req_ids and (not keys >= set(req_ids) or any(r.req_id not in nst for r in new_reqs)):
            return None
        vals = nst.values()
        if sum(vals) != so.total_num_scheduled_tokens:
            return None
        spec = so.scheduled_spec_decode_tokens or {}
        for r, drafts in spec.items():
            count = nst.get(r)
            if count is None or len(drafts) >= count:
                return None
            for t in drafts:  # async scheduling writes -1 placeholders for drafts that live on the GPU
                if t != -1 and not 0 <= t < TOKEN_ID_LIMIT:
                    return None
        sampled = d.sampled_token_ids
        if sampled is not None and not (sampled.keys() == keys or sampled.keys() <= keys):
            return None
        async_spec = None
        if d.spec_draft_token_ids is not UNSET or d.num_rejected_tokens is not UNSET \
                or d.num_computed_tokens_correction is not UNSET:
            async_spec = _async_spec(d, spec, req_ids)
            if async_spec is None:
                return None
        resumed = c.resumed_req_ids
        if resumed and not set(resumed).issubset(req_ids):
            return None  # a resumed id must be one of the cached requests: the checked path names it
        # positional, in field order: cheaper than keywords on a per-line path
        return Step(step, line, SchedulerOutput(
            new_reqs,
            CachedRequestData(req_ids, set(resumed) if resumed else set(), nb, nc_list, c.all_token_ids or {},
                              c.num_output_tokens),
            nst, so.total_num_scheduled_tokens, spec, so.finished_req_ids or [], so.preempted_req_ids or [],
        ), sampled, d.draft_token_ids, async_spec)

    def _async_spec(d, spec: dict, req_ids: list[str]) -> AsyncSpecDecode | None:
        """The checks of parse_step's `_async_spec` that a type cannot state; None when one fails."""
        real = d.spec_draft_token_ids or {}
        rejected = d.num_rejected_tokens or {}
        corr = d.num_computed_tokens_correction or {}
        if any(r not in spec or len(toks) != len(spec[r]) for r, toks in real.items()):
            return None
        if any(k > len(spec.get(r, ())) for r, k in rejected.items()) or not set(req_ids).issuperset(corr):
            return None
        return AsyncSpecDecode(real, rejected, corr)

    return decode
