"""The recorder's fake model and fake worker: what a model would sample and propose, with no model and no GPU.

Rules:
- Deterministic: the token at position p of request r is a hash of (seed, r, p) (`true_token`). Early stops
  (`stop_rate`): the token at an output position is a stop token when a second hash of (seed, request,
  position) falls below `stop_rate` (`model_token`).
- A step samples the drafts that match the model's tokens, up to the first that does not, plus one bonus token
  (`sample`); a partial prefill chunk samples nothing (the engine loops decide which).
- Drafts are the true next tokens, each wrong with probability `draft_error_rate`, seeded per request and step
  (`propose`).
- `FakeWorker` is the worker side of the async loop: it executes batches in schedule order with its own view of
  each request (tokens, worker-true computed count, its drafts); under async spec decoding the scheduler sends
  `-1` placeholders and an optimistic `num_computed_tokens`, so the worker verifies its own drafts and starts
  from its own count.
"""

from __future__ import annotations

import hashlib
import random

from kvmap.record.workload import Workload


def true_token(seed: int, req_id: str, position: int, vocab: int) -> int:
    h = hashlib.blake2b(f"{seed}/{req_id}/{position}".encode(), digest_size=8).digest()
    return 1 + int.from_bytes(h, "little") % (vocab - 1)


def model_token(w: Workload, req_id: str, position: int) -> int:
    """The fake model's token at `position`: `true_token`, or a stop token with probability `stop_rate`."""
    if w.stop_rate > 0:
        h = int.from_bytes(hashlib.blake2b(f"{w.seed}/stop/{req_id}/{position}".encode(), digest_size=8).digest(),
                           "little")
        if (h % 1_000_000) / 1_000_000 < w.stop_rate:
            stops = ([w.eos_token_id] if w.eos_token_id is not None else []) + list(w.stop_token_ids)
            return stops[(h // 1_000_000) % len(stops)]
    return true_token(w.seed, req_id, position, w.vocab_size)


def sample(w: Workload, req_id: str, first: int, drafts: list[int]) -> list[int]:
    """What a step samples for a request whose first draft (or next token) is at position `first`: the drafts
    that are the model's tokens, up to the first that is not, then one bonus token."""
    toks = []
    for j, d in enumerate(drafts):
        true = model_token(w, req_id, first + j)
        if d != true:
            break
        toks.append(true)
    toks.append(model_token(w, req_id, first + len(toks)))
    return toks


def propose(w: Workload, req_id: str, step: int, nxt: int) -> list[int]:
    """The k drafts proposed at `step` for the positions from `nxt` on: the model's tokens, each wrong with
    probability `draft_error_rate` (seeded per request and step)."""
    rng = random.Random(f"{w.seed}/{req_id}/{step}")
    d = [model_token(w, req_id, nxt + j) for j in range(w.num_speculative_tokens)]
    return [t if rng.random() >= w.draft_error_rate else 1 + t % (w.vocab_size - 1) for t in d]


class FakeWorker:
    """The worker side of the async loop: executes each scheduled batch in order, with its own view of every
    request (as a real worker: tokens so far, the worker-true computed count, the drafts it proposed)."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.drafts: dict[str, list[int]] = {}

    def execute(self, out, step: int) -> tuple[list[str], list[list[int]], dict[str, list[int]]]:
        """(req_ids, sampled per request, the real drafts verified) for one SchedulerOutput."""
        self._update(out)
        w = self.w
        req_ids = list(out.num_scheduled_tokens)
        sampled, used = [], {}
        for r in req_ids:
            n = out.num_scheduled_tokens[r]
            d = len(out.scheduled_spec_decode_tokens.get(r, ()))
            toks, start = self.tokens[r], self.computed[r]
            if start + n - d < len(toks):  # partial prefill chunk
                self.computed[r] = start + n
                sampled.append([])
                continue
            drafts = self.drafts.get(r, [])[:d]
            drafts += [0] * (d - len(drafts))
            if d:
                used[r] = drafts
            acc = sample(w, r, start + n - d, drafts)  # from the position of the first draft (the next token)
            self.computed[r] = start + n - (d - (len(acc) - 1))
            toks.extend(acc)
            sampled.append(acc)
            if w.num_speculative_tokens:  # the next step's drafts (they stay on "the GPU": the scheduler sees -1)
                self.drafts[r] = propose(w, r, step, len(toks))
        return req_ids, sampled, used

    def _update(self, out) -> None:
        """The worker's view after the scheduler's frees, preemptions (v2), new requests and resumes."""
        for r in out.finished_req_ids:
            for d in (self.tokens, self.computed, self.drafts):
                d.pop(r, None)
        if self.w.protocol == "v2":
            for r in out.preempted_req_ids or ():
                for d in (self.tokens, self.computed, self.drafts):
                    d.pop(r, None)
        for nr in out.scheduled_new_reqs:
            self.tokens[nr.req_id] = list(nr.prefill_token_ids or nr.prompt_token_ids)
            self.computed[nr.req_id] = nr.num_computed_tokens
            self.drafts.pop(nr.req_id, None)
        c = out.scheduled_cached_reqs
        resumed = set(c.resumed_req_ids)
        for i, r in enumerate(c.req_ids):
            if r in resumed:  # v1: the full token list comes with the resume; the count is exact again
                if r in c.all_token_ids:
                    self.tokens[r] = list(c.all_token_ids[r])
                self.computed[r] = c.num_computed_tokens[i]
                self.drafts.pop(r, None)
