"""The numba worker's forward parts: the rules of graph_parts.py by their numba forms (forward/kernels.py),
over buffers allocated once.

Rules:
- Each `*_numba` part returns what its numpy form (`graph_parts.*_host`) returns, value for value
  (tests/test_forward_compiled.py and the dumps of tests/test_forward_wired.py hold both to the specs); its
  arrays are views of its buffers, valid until the next step.
- A kernel per rule and step (or group): `mrv2_sampler` (MRV2's sampler indices), `step_shape` (the dispatch
  inputs), `pad_tails` (a padded step), `common_split` (CommonAttentionMetadata and the split, once per distinct
  split rule), `paged_kv` (FlashInfer's arrays, per group). What has no numba form runs its numpy form: V1's
  sampler, the dispatcher's table lookups, chunked_local virtual batches (the whole attention part then),
  DCP's local lengths, FlashAttention's and Triton's metadata.
- The parts leave their objects to the first read where no later part's host function needs them (`Deferred`,
  deferred.py: the dump's `to_dict`, `explain`): the sampler's; the attention part's and the backends', when
  no FlashAttention/Triton group and no DCP rank needs them in the phase (`SplitBuffers.fused`): the attention
  part then runs FlashInfer's kernels too and hands what they wrote to the backends part as its payload.
  Otherwise the backends part runs FlashInfer's kernels over the attention part's objects. The kernels take
  whole buffers and a row count; the views the objects hold are taken when the objects are made.
- The host workers give their own core arrays (`ForwardStep.core`, core.py): no `BatchMappings` in the phase.
- A step's BatchDescriptor depends only on the configuration and (R, T, max_query_len, eligible): the
  dispatcher's answers are remembered by that shape as one int (`step_shape`'s key), with the padded tails'
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
from kvmap.forward.core import core_of
from kvmap.forward.deferred import Deferred
from kvmap.errors import KvmapError
from kvmap.layout import PAD_SLOT_ID

_KERNELS = "kvmap.forward.kernels"
DESCS_KEPT = 4096  # dispatch results remembered per replay (a step's shape recurs; cleared when full)


# ------------------------------------------------------------------------------------------ sampler

class SamplerBuffers(S.SamplerBuffers):
    """The numpy form's buffers and the kernels."""

    def __init__(self, cfg: ForwardConfig, max_num_tokens: int) -> None:
        super().__init__(cfg.max_num_seqs, cfg.num_speculative_tokens, max_num_tokens)
        self.k = load(_KERNELS)


def sampler_numba(cfg: ForwardConfig, step, buf: SamplerBuffers):
    """MRV2's indices by one kernel, the object made on first read (no later part reads it); V1: the numpy
    form."""
    r = step.rows
    if cfg.runner != "mrv2":
        return S.v1_numpy(r, cfg.num_speculative_tokens, buf)
    R = len(r.idx_mapping)
    L = buf.k.mrv2_sampler(r.query_start_loc, r.idx_mapping, r.num_draft_tokens, r.has_drafts,
                           S.NUM_NEW_SAMPLED_TOKENS, buf.cu_num_logits, buf.logits_indices,
                           buf.expanded_idx_mapping, buf.expanded_local_pos)
    return Deferred(lambda: S.MRV2Sampler(buf.cu_num_logits[: R + 1], buf.logits_indices[:L],
                                          buf.expanded_idx_mapping[:L], buf.expanded_local_pos[:L]))


# ------------------------------------------------------------------------------------------ cudagraph

class PaddingBuffers(gp.PaddingBuffers):
    """The dispatcher, the kernels, the padded tails' buffers and the dispatch answers remembered."""

    def __init__(self, cfg: ForwardConfig, max_num_tokens: int) -> None:
        super().__init__(cfg)
        self.k = load(_KERNELS)
        R, T = cfg.max_num_seqs, max_num_tokens
        self.mrv2 = cfg.runner == "mrv2"
        self.m = T + 1  # the shape key's radix (kernels.step_shape: T and max_query_len are at most T)
        if (R + 1) * self.m * self.m * 2 >= 1 << 63:
            raise KvmapError(f"max_num_seqs {R} and max_num_batched_tokens {T} are too large for the forward "
                             "parts' shape key (use --backend numpy)", field="max_num_batched_tokens")
        self.max_size = self.sizes[-1] if self.sizes else 0  # max_cudagraph_capture_size (0: eager)
        self.shape = np.zeros(3, dtype=np.int64)  # [T, max_query_len, decode_graph_eligible]
        self.descs: dict = {}  # shape key -> Dispatched: the configuration's (results are never written)
        self.query_start_loc = np.zeros(R + 1, dtype=np.int32)  # [num_reqs_padded + 1]
        self.seq_lens = np.zeros(R, dtype=np.int32)  # [num_reqs_padded]
        self.slot_mapping = np.zeros((len(cfg.groups), T), dtype=np.int64)  # [G, num_slots]
        self.is_padding = np.zeros(T, dtype=bool)  # [num_tokens_padded]
        self.positions = np.zeros(T if cfg.runner == "v1" else 0, dtype=np.int64)  # [num_tokens_padded] (V1)


class Dispatched:
    """A step shape's dispatch answer and, where it pads, the padded tails' views of the buffers (the same
    views whenever the shape recurs: the kernel rewrites them each step)."""

    __slots__ = ("desc", "R", "T", "n", "views")

    def __init__(self, cfg: ForwardConfig, buf: PaddingBuffers, R: int) -> None:
        T, max_q, eligible = buf.shape.tolist()  # the step's, as the kernel wrote them
        desc = self.desc = buf.dispatcher.dispatch(R, T, max_q, eligible == 1)
        self.R = R
        self.T, self.n = T, P.num_slots(cfg.runner, desc, True)  # [num_slots] of the padded slot_mapping
        Rp, Tp = desc.num_reqs_padded, desc.num_tokens_padded
        self.views = None if Tp == T and Rp == R else (  # (query_start_loc, seq_lens, slot_mapping, is_padding,
            buf.query_start_loc[: Rp + 1], buf.seq_lens[:Rp], buf.slot_mapping[:, : self.n],  # positions)
            buf.is_padding[:Tp], None if buf.mrv2 else buf.positions[:Tp])


def cudagraph_numba(cfg: ForwardConfig, step, buf: PaddingBuffers) -> gp.Padding:
    r, m = step.rows, core_of(step)
    qsl = r.query_start_loc
    key = buf.k.step_shape(qsl, r.num_computed_tokens, r.prefill_len, r.idx_mapping, r.num_draft_tokens, buf.mrv2,
                           buf.m, buf.shape)  # (R, T, max_query_len, decode_graph_eligible) as one int
    d = buf.descs.get(key)
    if d is None:
        if len(buf.descs) >= DESCS_KEPT:
            buf.descs.clear()
        d = buf.descs[key] = Dispatched(cfg, buf, len(r.idx_mapping))
    v = d.views
    if v is None:  # nothing padded: the arrays themselves
        tails = P.PaddedTails(qsl, r.seq_lens, m.slot_mapping, m.tables, None, None if buf.mrv2 else m.positions)
    else:
        buf.k.pad_tails(qsl, r.seq_lens, m.slot_mapping, m.positions, d.R, d.T, d.desc.num_reqs_padded,
                        d.desc.num_tokens_padded, d.n, PAD_SLOT_ID, buf.query_start_loc, buf.seq_lens,
                        v[2], buf.positions, buf.is_padding)
        tails = P.PaddedTails(v[0], v[1], v[2], m.tables, v[3], v[4])
    return gp.Padding(d.desc, tails, buf.max_size)


# ------------------------------------------------------------------------------------------ attention

class SplitBuffers(gp.SplitRules):
    """Each group's split rule, the kernels, the metadata's buffers and FlashInfer's."""

    def __init__(self, cfg: ForwardConfig) -> None:
        super().__init__(cfg)
        self.k = load(_KERNELS)
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
        self.thresholds = [self.rules[g][0] if gp._attends(grp) else None for g, grp in enumerate(cfg.groups)]
        self.local = [False] * len(cfg.groups)  # [G] (a chunked_local group takes the numpy form)
        names = gp.backend_names(cfg)
        # FlashInfer's arrays computed here, the objects of both parts deferred, when no backend needs the
        # objects in the phase (no FlashAttention/Triton group) and no DCP rank adjusts the KV lengths
        self.fused = cfg.dcp_size == 1 and not self.any_local and not {"FLASH_ATTN", "TRITON_ATTN"} & set(names)
        self.flashinfer = [(g, cfg.groups[g].kernel_block_size, FI.NumbaBuffers(self.k))
                           for g, name in enumerate(names) if name == "FLASHINFER"]  # [(g, page_size, buffers)]


def attention_numba(cfg: ForwardConfig, step, buf: SplitBuffers):
    """The part; when `buf.fused`, also FlashInfer's arrays: `Deferred(make, (kv, n, [(g, page_size, buffers,
    nnz)]))`, the objects made on first read (the backends part makes its own from the payload). The kernels
    read rows 0..n of the tails and write the buffers whole-row; the objects' views are taken in `make`."""
    if buf.any_local:  # virtual batches: the numpy form
        return gp.attention_host(cfg, step, buf)
    pad: gp.Padding = step.parts["cudagraph"]
    desc, tails = pad.desc, pad.tails
    R = desc.num_reqs
    if R == 0:
        return gp._empty(cfg)
    r = step.rows
    n, t = (desc.num_reqs_padded, desc.num_tokens_padded) if desc.pad_attn else (R, desc.num_tokens)
    qsl, sl = tails.query_start_loc, tails.seq_lens  # [>= n + 1], [>= n] (the tails are the attention's counts)
    up = A.upper_bound(cfg.runner, sl, R, r.num_computed_tokens_correction)  # [>= n]: max_seq_len's source
    lens = r.num_prompt_tokens if buf.v1 else r.prefill_len
    for th, uniform, out in buf.calls:
        buf.k.common_split(qsl, up, r.num_computed_tokens, lens, r.idx_mapping, n, t, buf.v1, th, uniform,
                           buf.is_prefilling, out)

    def make() -> gp.Attention:
        return _attention(cfg, buf, tails, R, n, t, up)

    if not buf.fused:
        return make()
    kv = FI.kv_source(sl, up, cfg.num_speculative_tokens)  # [>= n] int32 (no DCP when fused)
    fi = [(g, ps, b, FI.fill_numba(b, kv, tails.block_tables[g], ps, n)) for g, ps, b in buf.flashinfer]
    return Deferred(make, (kv, n, fi))


def _attention(cfg: ForwardConfig, buf: SplitBuffers, tails, R: int, n: int, t: int, up) -> gp.Attention:
    """The part's objects over the kernels' results (`buf.out`, `buf.is_prefilling`) and the tails' rows 0..n."""
    qsl, sl = tails.query_start_loc, tails.seq_lens
    if len(sl) != n:
        qsl, sl, up = qsl[: n + 1], sl[:n], up[:n]
    pre = buf.is_prefilling[: n if buf.v1 else R]
    got = [(o[0], o[1], None if th is None else A.Split(*o[2:]))  # per rule
           for (th, _), o in zip(buf.distinct, buf.out.tolist())]
    common, splits = [None] * len(cfg.groups), [None] * len(cfg.groups)
    for g, i in enumerate(buf.rule_of):
        if i is not None:
            v, table = got[i], tails.block_tables[g]  # [R, W] (a padded row has no blocks: never read)
            common[g] = A.CommonAttentionMetadata(qsl, sl, n, t, v[0], v[1], table if len(table) <= n else
                                                  table[:n], tails.slot_mapping[g], pre, up)
            splits[g] = v[2]
    return gp.Attention(common, buf.thresholds, splits, buf.local)


# ------------------------------------------------------------------------------------------ backends

class BackendBuffers:
    """Each group's FlashInfer buffers."""

    def __init__(self, cfg: ForwardConfig) -> None:
        k = load(_KERNELS)
        self.flashinfer = [FI.NumbaBuffers(k) for _ in cfg.groups]  # [G]
        self.names = gp.backend_names(cfg)  # [G] the configuration's (never written)

    def build_flashinfer(self, g: int, *args) -> FI.FlashInferMetadata:
        return FI.build_numba(self.flashinfer[g], *args)


def backends_numba(cfg: ForwardConfig, step, buf: BackendBuffers):
    """The part, its FlashInfer metadata objects made on first read (`Deferred`): the kernels run now (here, or
    in the attention part when it is deferred, `SplitBuffers.fused`)."""
    att = step.parts["attention"]
    if type(att) is Deferred:  # FlashInfer's arrays are the attention part's payload
        def made() -> gp.Backends:
            a, md = att.get(), [None] * len(cfg.groups)
            kv, n, fi = att.payload
            for g, ps, b, nnz in fi:
                md[g] = FI.metadata_of(a.common[g], a.splits[g], ps, FI.views_numba(b, kv, n, nnz))
            return gp.Backends(md, buf.names, False)

        return Deferred(made)
    pending: list[int] = []  # the FlashInfer groups: a maker in `metadata` until read

    def flashinfer(g: int, *args):
        pending.append(g)
        return FI.paged_kv_numba(buf.flashinfer[g], *args)

    b = gp.backends_with(cfg, step, flashinfer, FA.build, buf.names)
    if not pending:
        return b

    def make() -> gp.Backends:
        for g in pending:
            b.metadata[g] = b.metadata[g]()
        return b

    return Deferred(make)
