"""The numba worker's forward parts: the rules of graph_parts.py by their numba forms (forward/kernels.py), in
one pass over the step's arrays, into buffers allocated once (`NumbaForward.run`).

Rules:
- The pass returns what the parts' numpy forms (`graph_parts.*_host`, PARTS in inputs.py) return, value for
  value (tests/test_forward_compiled.py and the dumps of tests/test_forward_wired.py hold both to the specs);
  its arrays are views of its buffers, valid until the next step.
- It reads the step's arrays (`StepArrays`, core.py: the worker's own, or its mappings' on a DCP worker),
  not a `ForwardStep`: `make_step` builds one only where a numpy form needs it (V1's sampler with a spec
  config, chunked_local virtual batches, FlashAttention's and Triton's metadata, DCP's local lengths).
- Kernels: `step_rows` once a step (MRV2's sampler indices, the step's shape key, the first split rule over
  the unpadded rows), `pad_tails` on a padded step, `common_split` for every other split rule and for every
  rule again on a FULL step (its attention counts are the padded ones), `paged_kv` per FlashInfer group.
- The parts' objects are made on first read (`Deferred`, deferred.py: the dump's `to_dict`, `explain`) unless
  a numpy form needs them in the phase (`SplitBuffers.fused` false: a FlashAttention/Triton group, a DCP
  rank, a chunked_local group). The kernels take whole buffers and a row count; the views the objects hold
  are taken when the objects are made.
- A step's BatchDescriptor depends only on the configuration and (R, T, max_query_len, eligible): the
  dispatcher's answers are remembered by that shape as one int (`step_rows`' key), with the padded tails'
  views of the buffers (shared between steps: results are never written, inputs.py).
- Buffers hold max_num_seqs request rows and max_num_tokens token rows: a step never has more (the padded
  counts come from capture sizes within both); the kernels check their bounds.
"""

from __future__ import annotations

import numpy as np

from kvmap.aot import load
from kvmap.forward import attention as A
from kvmap.forward import flash_attn as FA
from kvmap.forward import flashinfer as FI
from kvmap.forward import graph_parts as gp
from kvmap.forward import padded_tails as P
from kvmap.forward import sampler as S
from kvmap.forward.config import ForwardConfig
from kvmap.forward.core import StepArrays
from kvmap.forward.deferred import Deferred
from kvmap.forward.inputs import ForwardInputs, ForwardStep
from kvmap.errors import KvmapError
from kvmap.layout import PAD_SLOT_ID

_KERNELS = "kvmap.forward.kernels"
DESCS_KEPT = 4096  # dispatch results remembered per replay (a step's shape recurs; cleared when full)
_NO_SPLIT = (-1, False, np.zeros(0, dtype=np.int64))  # step_rows' split arguments when no group attends


class SamplerBuffers(S.SamplerBuffers):
    """The sampler's outputs (the numpy form's buffers: V1's indices are its numpy form)."""

    def __init__(self, cfg: ForwardConfig, max_num_tokens: int) -> None:
        super().__init__(cfg.max_num_seqs, cfg.num_speculative_tokens, max_num_tokens)

    def mrv2(self, R: int, L: int) -> S.MRV2Sampler:
        """MRV2's sampler part over the kernel's rows: R requests, L logits rows."""
        return S.MRV2Sampler(self.cu_num_logits[: R + 1], self.logits_indices[:L], self.expanded_idx_mapping[:L],
                             self.expanded_local_pos[:L])


class PaddingBuffers(gp.PaddingBuffers):
    """The dispatcher, the padded tails' buffers and the dispatch answers remembered."""

    def __init__(self, cfg: ForwardConfig, max_num_tokens: int) -> None:
        super().__init__(cfg)
        R, T = cfg.max_num_seqs, max_num_tokens
        self.mrv2 = cfg.runner == "mrv2"
        self.m = T + 1  # the shape key's radix (kernels.step_shape: T and max_query_len are at most T)
        if (R + 1) * self.m * self.m * 2 >= 1 << 63:
            raise KvmapError(f"max_num_seqs {R} and max_num_batched_tokens {T} are too large for the forward "
                             "parts' shape key (use --backend numpy)", field="max_num_batched_tokens")
        self.max_size = self.sizes[-1] if self.sizes else 0  # max_cudagraph_capture_size (0: eager)
        self.shape = np.zeros(4, dtype=np.int64)  # [T, max_query_len, decode_graph_eligible, L] (step_rows)
        self.descs: dict = {}  # shape key -> Dispatched: the configuration's (results are never written)
        self.query_start_loc = np.zeros(R + 1, dtype=np.int32)  # [num_reqs_padded + 1]
        self.seq_lens = np.zeros(R, dtype=np.int32)  # [num_reqs_padded]
        self.slot_mapping = np.zeros((len(cfg.groups), T), dtype=np.int64)  # [G, num_slots]
        self.is_padding = np.zeros(T, dtype=bool)  # [num_tokens_padded]
        self.positions = np.zeros(T if cfg.runner == "v1" else 0, dtype=np.int64)  # [num_tokens_padded] (V1)

    def dispatched(self, cfg: ForwardConfig, key: int, R: int) -> "Dispatched":
        """The answer for the shape `step_rows` just wrote (`shape`), remembered under its key."""
        if len(self.descs) >= DESCS_KEPT:
            self.descs.clear()
        d = self.descs[key] = Dispatched(cfg, self, R)
        return d


class Dispatched:
    """A step shape's dispatch answer and, where it pads, the padded tails' views of the buffers (the same
    views whenever the shape recurs: the kernel rewrites them each step)."""

    __slots__ = ("desc", "T", "Rp", "Tp", "n", "views", "pad_attn", "counts")

    def __init__(self, cfg: ForwardConfig, buf: PaddingBuffers, R: int) -> None:
        T, max_q, eligible = buf.shape[:3].tolist()  # the step's, as the kernel wrote them
        desc = self.desc = buf.dispatcher.dispatch(R, T, max_q, eligible == 1)
        self.T, self.n = T, P.num_slots(cfg.runner, desc, True)  # [num_slots] of the padded slot_mapping
        Rp, Tp = self.Rp, self.Tp = desc.num_reqs_padded, desc.num_tokens_padded
        self.pad_attn = desc.pad_attn
        self.counts = (Rp, Tp) if self.pad_attn else (R, T)  # (n, t): the attention's rows and tokens
        self.views = None if Tp == T and Rp == R else (  # (query_start_loc, seq_lens, slot_mapping, is_padding,
            buf.query_start_loc[: Rp + 1], buf.seq_lens[:Rp], buf.slot_mapping[:, : self.n],  # positions)
            buf.is_padding[:Tp], None if buf.mrv2 else buf.positions[:Tp])


class SplitBuffers(gp.SplitRules):
    """Each group's split rule, the metadata's buffers and FlashInfer's."""

    def __init__(self, cfg: ForwardConfig) -> None:
        super().__init__(cfg)
        k = load(_KERNELS)
        self.v1 = cfg.runner == "v1"
        self.any_local = any(g.kind == "chunked_local" for g in cfg.groups)
        self.is_prefilling = np.zeros(cfg.max_num_seqs, dtype=bool)  # [num_reqs] (V1) or [R] (MRV2)
        # the configuration's, per step the same (results are never written, inputs.py)
        attending = [self.rules[g] if gp._attends(grp) else None for g, grp in enumerate(cfg.groups)]  # [G]
        self.distinct = list(dict.fromkeys(rule for rule in attending if rule is not None))  # the split rules
        self.rule_of = [None if rule is None else self.distinct.index(rule) for rule in attending]  # [G]
        self.out = np.zeros((len(self.distinct), 6), dtype=np.int64)  # per rule: the kernel's scalars
        self.calls = [(-1 if th is None else th, uniform, self.out[i])  # per rule: common_split's arguments
                      for i, (th, uniform) in enumerate(self.distinct)]
        self.first = self.calls[0] if self.calls else _NO_SPLIT  # step_rows' rule
        self.thresholds = [self.rules[g][0] if gp._attends(grp) else None for g, grp in enumerate(cfg.groups)]
        self.local = [False] * len(cfg.groups)  # [G] (a chunked_local group takes the numpy form)
        names = self.names = gp.backend_names(cfg)  # [G] the configuration's (never written)
        # the objects of every part made on first read, FlashInfer's arrays computed here, when no backend
        # needs the objects in the phase (no FlashAttention/Triton group) and no DCP rank adjusts the KV lengths
        self.fused = cfg.dcp_size == 1 and not self.any_local and not {"FLASH_ATTN", "TRITON_ATTN"} & set(names)
        self.flashinfer = [(g, cfg.groups[g].kernel_block_size, FI.NumbaBuffers(k))
                           for g, name in enumerate(names) if name == "FLASHINFER"]  # [(g, page_size, buffers)]
        self.fi_of = {g: b for g, _, b in self.flashinfer}  # g -> FlashInfer buffers (the numpy-form path)
        # no group with a backend whose metadata kvmap computes: every step's part is this one (never written)
        self.no_backends = None if {"FLASHINFER", "FLASH_ATTN", "TRITON_ATTN"} & set(names) else \
            gp.Backends([None] * len(cfg.groups), names, cfg.dcp_size > 1)

    def attention(self, cfg: ForwardConfig, tails: P.PaddedTails, R: int, n: int, t: int, up) -> gp.Attention:
        """The part's objects over the kernels' results (`out`, `is_prefilling`) and the tails' rows 0..n."""
        qsl, sl = tails.query_start_loc, tails.seq_lens
        if len(sl) != n:
            qsl, sl, up = qsl[: n + 1], sl[:n], up[:n]
        pre = self.is_prefilling[: n if self.v1 else R]
        got = [(o[0], o[1], None if th is None else A.Split(*o[2:]))  # per rule
               for (th, _), o in zip(self.distinct, self.out.tolist())]
        common, splits = [None] * len(cfg.groups), [None] * len(cfg.groups)
        for g, i in enumerate(self.rule_of):
            if i is not None:
                v, table = got[i], tails.block_tables[g]  # [R, W] (a padded row has no blocks: never read)
                common[g] = A.CommonAttentionMetadata(qsl, sl, n, t, v[0], v[1], table if len(table) <= n else
                                                      table[:n], tails.slot_mapping[g], pre, up)
                splits[g] = v[2]
        return gp.Attention(common, self.thresholds, splits, self.local)

    def backends(self, cfg: ForwardConfig, att: gp.Attention, kv, n: int, fi: list) -> gp.Backends:
        """The part's FlashInfer objects over the arrays the pass computed (`fi`: [(g, page_size, buffers,
        nnz)])."""
        md = [None] * len(cfg.groups)
        for g, ps, b, nnz in fi:
            md[g] = FI.metadata_of(att.common[g], att.splits[g], ps, FI.views_numba(b, kv, n, nnz))
        return gp.Backends(md, self.names, False)


class NumbaForward:
    """The numba worker's builder: `run` computes every part of a step (inputs.py PARTS) in one pass."""

    def __init__(self, config: ForwardConfig, max_num_tokens: int) -> None:
        self.config = config
        self.k = load(_KERNELS)
        self.sampler = SamplerBuffers(config, max_num_tokens)
        self.padding = PaddingBuffers(config, max_num_tokens)
        self.split = SplitBuffers(config)
        self.mrv2 = config.runner == "mrv2"

    def run(self, a: StepArrays, make_step) -> ForwardInputs:
        """The step's `ForwardInputs` from its arrays; `make_step() -> ForwardStep` where a numpy form needs one."""
        cfg, k, sb, pb, ab = self.config, self.k, self.sampler, self.padding, self.split
        qsl, nc, idx, sl, drafts, has_drafts, prefill_len, num_prompt_tokens, corr, slots, positions, tables, _ = a
        mrv2 = self.mrv2
        R = len(idx)
        up = sl if corr is None else A.upper_bound(cfg.runner, sl, R, corr)  # [R] seq_lens_cpu_upper_bound
        lens = prefill_len if mrv2 else num_prompt_tokens
        th, uniform, out = ab.first
        key = k.step_rows(qsl, nc, lens, idx, drafts, has_drafts, S.NUM_NEW_SAMPLED_TOKENS, mrv2, pb.m, pb.shape,
                          sb.cu_num_logits, sb.logits_indices, sb.expanded_idx_mapping, sb.expanded_local_pos, up,
                          th, uniform, ab.is_prefilling, out)
        d = pb.descs.get(key)
        if d is None:
            d = pb.dispatched(cfg, key, R)
        v = d.views
        if v is None:  # nothing padded: the arrays themselves
            tails = (qsl, sl, slots, tables, None, None if mrv2 else positions)
        else:
            k.pad_tails(qsl, sl, slots, positions, R, d.T, d.Rp, d.Tp, d.n, PAD_SLOT_ID, pb.query_start_loc,
                        pb.seq_lens, v[2], pb.positions, pb.is_padding)
            tails = (v[0], v[1], v[2], tables, v[3], v[4])
            up = v[1] if corr is None else A.upper_bound(cfg.runner, v[1], R, corr)  # [Rp], padded rows 0
        padding = Deferred(lambda: gp.Padding(d.desc, P.PaddedTails(*tails), pb.max_size))
        step = None  # made only where a numpy form reads it
        if mrv2:
            sampler = Deferred(lambda: sb.mrv2(R, int(pb.shape[3])))
        elif cfg.num_speculative_tokens == 0:
            sampler = S.v1_no_spec(qsl, sb)
        else:
            step = make_step()
            sampler = S.v1_numpy(step.rows, cfg.num_speculative_tokens, sb)
        if R == 0:
            return self._rest(step or make_step(), sampler, padding, gp._empty(cfg))
        n, t = d.counts
        if d.pad_attn or len(ab.calls) > 1:  # the other rules; every rule again over the padded counts
            for th, uniform, out in (ab.calls if d.pad_attn else ab.calls[1:]):
                k.common_split(tails[0], up, nc, lens, idx, n, t, ab.v1, th, uniform, ab.is_prefilling, out)
        attention = Deferred(lambda: ab.attention(cfg, padding.get().tails, R, n, t, up))
        if not ab.fused:
            return self._rest(step or make_step(), sampler, padding, attention)
        parts = {"sampler": sampler, "cudagraph": padding, "attention": attention, "backends": ab.no_backends}
        if ab.no_backends is None:
            kv = FI.kv_source(tails[1], up, cfg.num_speculative_tokens)  # [>= n] int32 (no DCP when fused)
            fi = [(g, ps, b, FI.fill_numba(b, kv, tails[3][g], ps, n)) for g, ps, b in ab.flashinfer]
            parts["backends"] = Deferred(lambda: ab.backends(cfg, attention.get(), kv, n, fi))
        return ForwardInputs(cfg.runner, parts)

    def _rest(self, step: ForwardStep, sampler, padding, attention) -> ForwardInputs:
        """The parts made now where a numpy form reads them: chunked_local virtual batches (the whole attention
        part), FlashAttention's and Triton's metadata, DCP's local lengths (FlashInfer's arrays by the kernel)."""
        cfg, ab = self.config, self.split
        step.parts["sampler"] = sampler
        step.parts["cudagraph"] = padding = padding.get()
        if ab.any_local and padding.desc.num_reqs:  # virtual batches: the numpy form
            attention = gp.attention_host(cfg, step, ab)
        elif type(attention) is Deferred:
            attention = attention.get()
        step.parts["attention"] = attention
        if ab.no_backends is not None:
            backends = ab.no_backends
        else:
            backends = gp.backends_with(cfg, step, lambda g, *args: FI.build_numba(ab.fi_of[g], *args), FA.build,
                                        ab.names)
        return ForwardInputs(cfg.runner, {"sampler": sampler, "cudagraph": padding, "attention": attention,
                                          "backends": backends})
