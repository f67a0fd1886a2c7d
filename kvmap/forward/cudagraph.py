"""CUDA-graph dispatch and padding of one step, per runner, as vLLM 0.33 chooses them.

Job: from the resolved `cudagraph_mode` and `cudagraph_capture_sizes` (trace header, or the defaults of
`default_capture_sizes`), say per step which graph runs (`FULL`, `PIECEWISE`, `NONE`), `num_tokens_padded` and
`num_reqs_padded`. What the padded tails hold: padded_tails.py.

Rules (issue 26 forward-pass notes, section 4.1-4.4):
- Capture sizes: `VllmConfig._set_cudagraph_sizes` (vllm/config/vllm.py); V1 with FULL decode graphs and
  spec decode rounds them to multiples of 1+k (`adjust_cudagraph_sizes_for_spec_decode`); MRV2 does not.
- V1 (`CudagraphDispatcher`, vllm/v1/cudagraph_dispatcher.py): pad to the smallest capture size >= T;
  uniform decode is shape only (`max_query_len == 1+k and T == max_query_len * R`); try the FULL key
  (mixed FULL: num_reqs = min(size, max_num_seqs); separate decode routine: num_reqs = min(size // (1+k),
  max_num_seqs), sizes in [1+k, (1+k) * max_num_seqs]), then the PIECEWISE key, else NONE unpadded.
- MRV2 (`CudaGraphManager._init_candidates` + `dispatch`, vllm/v1/worker/gpu/cudagraph_utils.py): per mode
  the descriptors of the smallest captured size >= T, FULL before PIECEWISE, the first compatible one wins;
  decode descriptors round the size up to a multiple of 1+k; the uniform token count is `max_query_len`
  when the batch is `decode_graph_eligible` and T == max_query_len * R (it need not equal 1+k).
- `num_tokens_padded = max(T, desc.num_tokens)`, `num_reqs_padded = desc.num_reqs or R`; a NONE step is
  unpadded. LoRA capture cases, varlen decode graphs, dynamic speculative decoding and microbatching are not
  modelled (no LoRA, one microbatch).
- Data parallelism: dp_padding.py.
- Each rule has a scalar spec (`*_spec`, plain loops over the sizes) and one fast form (`Dispatcher`: lookup
  tables built once with numpy, O(1) per step), held together by tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MODES", "RUNNERS", "BatchDescriptor", "Dispatcher", "adjust_sizes_for_spec_decode",
           "decode_graph_eligible", "default_capture_sizes", "dispatch", "dispatch_spec", "resolve_capture_sizes"]

MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")  # vLLM's CUDAGraphMode names
RUNNERS = ("mrv2", "v1")


def _decode_mode(mode: str) -> str:
    return {"FULL_DECODE_ONLY": "FULL", "FULL_AND_PIECEWISE": "FULL"}.get(mode, mode)


def _mixed_mode(mode: str) -> str:
    return {"FULL_DECODE_ONLY": "NONE", "FULL_AND_PIECEWISE": "PIECEWISE"}.get(mode, mode)


def _separate_routine(mode: str) -> bool:
    return mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def check(runner: str, mode: str) -> None:
    """Internal arguments (the caller checks user input at the boundary)."""
    assert runner in RUNNERS, runner
    assert mode in MODES, mode


# ------------------------------------------------------------------------------------------ capture sizes

def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int = 0,
                          *, blackwell: bool = False, performance_mode: str = "balanced") -> list[int]:
    """vLLM's default `cudagraph_capture_sizes` (`_set_cudagraph_sizes`, no dynamic speculative decoding), before
    V1's spec-decode rounding (`resolve_capture_sizes`). `blackwell`: device-capability family 100 (ceiling
    1024, else 512)."""
    ceiling = 1024 if blackwell else 512
    q = 1 + num_speculative_tokens
    top = min(max_num_seqs * q * 2, ceiling)
    decode_sizes: list[int] = []
    if q > 1:
        reqs = min(max_num_seqs, ceiling)
        counts = [n for n in (1, 2, 4) if n <= reqs] + list(range(8, min(reqs + 1, 256), 8))
        counts = sorted(set(counts + list(range(256, reqs + 1, 16)) + [reqs]))
        decode_sizes = sorted({n * q for n in counts if n * q <= top})
    elif max_num_seqs <= top:
        decode_sizes = [max_num_seqs]
    top = min(max_num_batched_tokens, top)
    if performance_mode == "interactivity":
        sizes = list(range(1, min(top, 32) + 1))
    else:
        sizes = [n for n in (1, 2, 4) if n <= top]
    if top >= 8:
        sizes += list(range(8, min(top + 1, 256), 8))
    if top >= 256:
        sizes += list(range(256, top + 1, 16))
    if max_num_batched_tokens <= top and max_num_batched_tokens not in sizes:
        sizes.append(max_num_batched_tokens)
    sizes += [s for s in decode_sizes if s <= max_num_batched_tokens]
    return sorted(set(sizes))


def adjust_sizes_for_spec_decode(sizes: list[int], decode_query_len: int) -> list[int]:
    """V1 only (`adjust_cudagraph_sizes_for_spec_decode`): sizes rounded up to multiples of 1+k, those above
    the largest size dropped."""
    if not sizes or decode_query_len <= 1:
        return list(sizes)
    top = max(sizes)
    q = decode_query_len
    out = sorted({-(-s // q) * q for s in sizes if -(-s // q) * q <= top})
    if not out and q <= top:
        out = [q]
    if not out:
        raise ValueError(f"no cudagraph size is left after rounding to multiples of {q}")
    return out


def resolve_capture_sizes(runner: str, mode: str, sizes: list[int] | None, max_num_seqs: int,
                          max_num_batched_tokens: int, num_speculative_tokens: int = 0, *,
                          blackwell: bool = False) -> list[int]:
    """The sizes a runner captures: none for NONE; the given sizes (deduplicated, <= max_num_batched_tokens)
    or the defaults; then V1's spec-decode rounding when the decode mode is FULL and k > 0."""
    check(runner, mode)
    if mode == "NONE":
        return []
    if sizes is None:
        out = default_capture_sizes(max_num_seqs, max_num_batched_tokens, num_speculative_tokens,
                                    blackwell=blackwell)
    else:
        out = sorted({s for s in sizes if s <= max_num_batched_tokens})
    if runner == "v1" and _decode_mode(mode) == "FULL" and num_speculative_tokens > 0:
        out = adjust_sizes_for_spec_decode(out, 1 + num_speculative_tokens)
    return out


# ------------------------------------------------------------------------------------------ dispatch

@dataclass(slots=True)  # a step's result: not frozen (inputs.py)
class BatchDescriptor:
    """One step's graph choice. `cudagraph_mode` is the runtime mode: "FULL", "PIECEWISE" or "NONE"."""

    cudagraph_mode: str
    num_tokens: int  # T, scheduled tokens
    num_reqs: int  # R, scheduled requests
    num_tokens_padded: int  # T_pad >= T (T when NONE)
    num_reqs_padded: int  # R_pad >= R (R unless a FULL graph pads requests)
    uniform_decode: bool  # V1: shape-only uniform decode; MRV2: a uniform token count was found

    @property
    def pad_attn(self) -> bool:
        """Attention metadata uses the padded counts (both runners: FULL only)."""
        return self.cudagraph_mode == "FULL"


def decode_graph_eligible(num_scheduled_tokens: list[int], num_draft_tokens: list[int],
                          num_computed_prefill_tokens: list[int], prefill_len: list[int]) -> bool:
    """MRV2 (`gather_batch_req_state`): no prefilling row, or every prefilling row schedules exactly one new
    (non-draft) token over existing context."""
    for q, d, c, p in zip(num_scheduled_tokens, num_draft_tokens, num_computed_prefill_tokens, prefill_len):
        if c < p and not (q - d == 1 and c > 0):
            return False
    return True


def dispatch_spec(runner: str, mode: str, capture_sizes: list[int], max_num_seqs: int,
                  num_speculative_tokens: int, num_reqs: int, num_tokens: int, max_query_len: int,
                  decode_eligible: bool = True) -> BatchDescriptor:
    """The scalar spec of both runners' dispatch, by loops over the capture sizes. `decode_eligible` is MRV2's
    `decode_graph_eligible` (V1 ignores it)."""
    check(runner, mode)
    q = 1 + num_speculative_tokens
    if runner == "v1":
        uniform = max_query_len == q and num_tokens == max_query_len * num_reqs
        mode_rt, t_pad, r_pad = v1_rule(mode, sorted(capture_sizes), max_num_seqs, q, num_tokens, uniform)
    else:
        uniform_count = max_query_len if decode_eligible and num_reqs > 0 and num_tokens == max_query_len * num_reqs \
            else None
        uniform = uniform_count is not None
        mode_rt, t_pad, r_pad = mrv2_rule(mode, sorted(capture_sizes), max_num_seqs, q, num_reqs, num_tokens,
                                           uniform_count)
    return BatchDescriptor(mode_rt, num_tokens, num_reqs, max(num_tokens, t_pad),
                           num_reqs if r_pad is None else r_pad, uniform)


def v1_rule(mode, sizes, max_num_seqs, q, num_tokens, uniform, allowed=("FULL", "PIECEWISE", "NONE")):
    """(runtime mode, padded tokens, desc.num_reqs | None) of `CudagraphDispatcher.dispatch` with `valid_modes`
    `allowed`, over ascending `sizes`."""
    if mode == "NONE" or not sizes or num_tokens > sizes[-1] or allowed == ("NONE",):
        return "NONE", num_tokens, None
    padded = next(s for s in sizes if s >= num_tokens)
    if uniform and _separate_routine(mode):
        want = (padded, min(padded // q, max_num_seqs), True)
    else:
        want = (padded, min(padded, max_num_seqs), False)
    full_keys = set()
    if _mixed_mode(mode) == "FULL":
        full_keys |= {(s, min(s, max_num_seqs), False) for s in sizes}
    if _decode_mode(mode) == "FULL" and _separate_routine(mode):
        for s in sizes:
            if q <= s <= q * max_num_seqs:
                assert s % q == 0, f"V1 capture size {s} is not a multiple of {q} (resolve_capture_sizes)"
                full_keys.add((s, min(s // q, max_num_seqs), True))
    if "FULL" in allowed and want in full_keys:
        return "FULL", padded, want[1]
    if "PIECEWISE" in allowed and _mixed_mode(mode) == "PIECEWISE":
        return "PIECEWISE", padded, None
    assert "NONE" in allowed, f"vLLM asserts: no {allowed} graph for {num_tokens} tokens"
    return "NONE", num_tokens, None


def _mrv2_descs(mode, sizes, max_num_seqs, q):
    """[(cg_mode, num_tokens, num_reqs | None, uniform_token_count | None)] per runtime mode, ascending."""
    full, piecewise = [], []
    if mode == "NONE" or not sizes:
        return full, piecewise
    top = sizes[-1]
    for s in sizes:
        if _separate_routine(mode):
            t = -(-s // q) * q
            if t <= max_num_seqs * q and t <= top and t // q <= max_num_seqs and (t, t // q) not in \
                    [(d[1], d[2]) for d in full if d[3] == q]:
                full.append(("FULL", t, t // q, q))
        mixed = _mixed_mode(mode)
        if mixed == "FULL":
            full.append(("FULL", s, min(s, max_num_seqs), None))
        elif mixed == "PIECEWISE":
            piecewise.append(("PIECEWISE", s, None, None))
    # vLLM sorts by num_tokens, descending and stable, then reverses
    full = list(reversed(sorted(full, key=lambda d: d[1], reverse=True)))
    return full, piecewise


def mrv2_rule(mode, sizes, max_num_seqs, q, num_reqs, num_tokens, uniform_count):
    """(runtime mode, desc.num_tokens, desc.num_reqs) of `CudaGraphManager.dispatch`."""
    candidates = []
    for descs in _mrv2_descs(mode, sizes, max_num_seqs, q):
        above = [d[1] for d in descs if d[1] >= num_tokens]
        if above:
            candidates += [d for d in descs if d[1] == min(above)]
    if num_tokens > 0:
        for cg_mode, t, r, u in candidates:
            if (u is None or u == uniform_count) and (r is None or r >= num_reqs) and t >= num_tokens:
                return cg_mode, t, r
    return "NONE", num_tokens, num_reqs


class Dispatcher:
    """The fast form: every token count's FULL and PIECEWISE candidates as lookup tables, built once per
    configuration by whole-array numpy ops; `dispatch` answers a step with O(1) lookups."""

    def __init__(self, runner: str, mode: str, capture_sizes: list[int], max_num_seqs: int,
                 num_speculative_tokens: int) -> None:
        check(runner, mode)
        self.runner, self.mode, self.max_num_seqs = runner, mode, max_num_seqs
        self._lists: dict | None = None  # the lookup arrays as lists, for `dispatch` (made on first use)
        self.q = q = 1 + num_speculative_tokens
        sizes = np.array(sorted(capture_sizes), dtype=np.int64)
        self.top = int(sizes[-1]) if len(sizes) and mode != "NONE" else 0
        n = np.arange(self.top + 1)
        # [top + 1] num_tokens -> smallest capture size >= num_tokens (the padded count)
        self.padded = sizes[np.searchsorted(sizes, n)] if self.top else np.zeros(1, dtype=np.int64)
        full = np.zeros(self.top + 1, dtype=bool)  # [top + 1] a FULL mixed graph of that padded size exists
        full_u = np.zeros(self.top + 1, dtype=np.int64)  # [top + 1] FULL decode graph: its num_reqs (0: none)
        self.pw = _mixed_mode(mode) == "PIECEWISE" and self.top > 0
        if self.top and runner == "v1":
            if _mixed_mode(mode) == "FULL":
                full[sizes] = True
            if _decode_mode(mode) == "FULL" and _separate_routine(mode):
                dec = sizes[(sizes >= q) & (sizes <= q * max_num_seqs)]
                assert not (dec % q).any(), "V1 capture sizes must be multiples of 1+k (resolve_capture_sizes)"
                full_u[dec] = np.minimum(dec // q, max_num_seqs)
            self.full_mixed, self.full_uniform = full, full_u
        elif self.top:
            fdescs, _ = _mrv2_descs(mode, sizes.tolist(), max_num_seqs, q)
            self._mrv2_tables(fdescs, n)

    def _mrv2_tables(self, fdescs, n) -> None:
        """Per num_tokens: the FULL group of the smallest FULL size >= n (at most one decode desc and one
        mixed desc, since sizes are deduplicated) as arrays."""
        top = self.top
        f_tok = np.array(sorted({d[1] for d in fdescs}), dtype=np.int64)
        self.f_tokens = np.zeros(top + 1, dtype=np.int64)  # [top + 1] num_tokens -> FULL group size (0: none)
        self.f_dec_reqs = np.zeros(top + 1, dtype=np.int64)  # [top + 1] its decode desc's num_reqs (0: none)
        self.f_mix_reqs = np.zeros(top + 1, dtype=np.int64)  # [top + 1] its mixed desc's num_reqs (0: none)
        if not len(f_tok):
            return
        idx = np.searchsorted(f_tok, n)
        ok = idx < len(f_tok)
        self.f_tokens[ok] = f_tok[idx[ok]]
        dec = {d[1]: d[2] for d in fdescs if d[3] is not None}
        mix = {d[1]: d[2] for d in fdescs if d[3] is None}
        dec_r = np.array([dec.get(int(t), 0) for t in f_tok], dtype=np.int64)
        mix_r = np.array([mix.get(int(t), 0) for t in f_tok], dtype=np.int64)
        self.f_dec_reqs[ok] = dec_r[idx[ok]]
        self.f_mix_reqs[ok] = mix_r[idx[ok]]

    def dispatch(self, num_reqs: int, num_tokens: int, max_query_len: int,
                 decode_eligible: bool = True) -> BatchDescriptor:
        """One step, by table lookups (as lists: no array is made per step)."""
        if self._lists is None:
            self._lists = {k: getattr(self, k).tolist() for k in ("padded", "full_mixed", "full_uniform", "f_tokens",
                                                                  "f_dec_reqs", "f_mix_reqs") if hasattr(self, k)}
        L, R, T, Q = self._lists, num_reqs, num_tokens, max_query_len
        if self.runner == "v1":
            uniform = Q == self.q and T == Q * R
            if not self.top or T > self.top:
                return BatchDescriptor("NONE", T, R, T, R, uniform)
            p = L["padded"][T]
            if uniform and _separate_routine(self.mode):
                want = min(p // self.q, self.max_num_seqs)
                if L["full_uniform"][p] == want:
                    return BatchDescriptor("FULL", T, R, p, want, uniform)
            elif L["full_mixed"][p]:
                return BatchDescriptor("FULL", T, R, p, min(p, self.max_num_seqs), uniform)
            if self.pw:
                return BatchDescriptor("PIECEWISE", T, R, p, R, uniform)
            return BatchDescriptor("NONE", T, R, T, R, uniform)
        uniform = bool(decode_eligible) and R > 0 and T == Q * R
        if not self.top or T <= 0 or T > self.top:
            return BatchDescriptor("NONE", T, R, T, R, uniform)
        f_t = L["f_tokens"][T]
        if f_t:
            if uniform and Q == self.q and L["f_dec_reqs"][T] >= R:
                return BatchDescriptor("FULL", T, R, f_t, L["f_dec_reqs"][T], uniform)
            if L["f_mix_reqs"][T] >= R:
                return BatchDescriptor("FULL", T, R, f_t, L["f_mix_reqs"][T], uniform)
        if self.pw:
            return BatchDescriptor("PIECEWISE", T, R, L["padded"][T], R, uniform)
        return BatchDescriptor("NONE", T, R, T, R, uniform)


def dispatch(runner: str, mode: str, capture_sizes: list[int], max_num_seqs: int, num_speculative_tokens: int,
             num_reqs: int, num_tokens: int, max_query_len: int, decode_eligible: bool = True) -> BatchDescriptor:
    """The entry point per step (builds a `Dispatcher`; keep one per replay to dispatch many steps)."""
    return Dispatcher(runner, mode, capture_sizes, max_num_seqs, num_speculative_tokens).dispatch(
        num_reqs, num_tokens, max_query_len, decode_eligible)
