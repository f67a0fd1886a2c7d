"""The shadow model's last phase of a step: what the model returned.

Rules: sampled tokens are appended to the shadow request (a partial prefill chunk samples nothing; at most
1 + drafts tokens), recorded rejection counts must match the drafts and the sampled tokens, and the
num_computed_tokens the next step must send follows (rolled back by rejected drafts; under async scheduling
without recorded corrections only a lower bound, with slack for the in-flight drafts).
`self` is the `shadow.Validator`.
"""

from __future__ import annotations

from kvmap.trace import Step


def check(self, step: Step) -> None:
    """What the model returned: sampled tokens appended, the num_computed_tokens the next step must send."""
    so = step.scheduler_output
    h = self.h
    scheduled = so.num_scheduled_tokens
    sampled = step.sampled_token_ids
    proposals = step.draft_token_ids or {}
    for r, n in scheduled.items():
        req = self.reqs.get(r)
        if req is None or r in self.uncertain:
            continue
        nc = req.expected_nc or 0
        drafts = len(so.scheduled_spec_decode_tokens.get(r, []))
        out = sampled.get(r) if sampled is not None else None
        partial = nc + n - drafts < len(req.tokens)
        rejected = step.async_spec.num_rejected_tokens.get(r) if step.async_spec else None
        if out and drafts and rejected is not None and rejected != drafts - (len(out) - 1):
            self.add("rejected_mismatch", f"num_rejected_tokens {rejected}, but {len(out)} sampled tokens for "
                     f"{drafts} drafts mean {drafts - (len(out) - 1)} were rejected", step, req_id=r,
                     field="num_rejected_tokens")
        if out is not None:
            if partial and out:
                self.add("partial_sampled", f"sampled {len(out)} tokens from a partial prefill chunk", step,
                         req_id=r, field="sampled_token_ids")
            if len(out) > 1 + drafts:
                self.add("too_many_sampled", f"{len(out)} sampled tokens for {drafts} drafts", step, req_id=r,
                         field="sampled_token_ids")
            if not partial:
                del req.tokens[nc + n - drafts:]
                req.tokens.extend(out)
                if len(req.tokens) > h.max_model_len:
                    self.add("max_model_len", f"sampled tokens take the request to {len(req.tokens)} tokens, "
                             f"past max_model_len {h.max_model_len}", step, req_id=r, field="sampled_token_ids")
        if sampled is None or (not partial and not out) or (h.async_scheduling and step.async_spec is None):
            req.expected_nc = nc + n
            req.nc_slack = drafts
        elif out is not None and drafts:
            req.expected_nc = nc + n - (drafts - max(len(out) - 1, 0))
            req.nc_slack = 0
        else:
            req.expected_nc = nc + n
            req.nc_slack = 0
        req.last_drafts_proposed = list(proposals[r]) if r in proposals else None

