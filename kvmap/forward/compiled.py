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
  part then runs FlashInfer's kernels too and hands their arrays to the backends part as its payload.
  Otherwise the backends part runs FlashInfer's kernels over the attention part's objects.
- The host workers give their own core arrays (`ForwardStep.core`, core.py): no `BatchMappings` in the phase.
- A step's BatchDescriptor depends only on the configuration and (R, T, max_query_len, eligible): the
  dispatcher's answers are remembered (shared between steps: results are never written, inputs.py).
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
    """The dispatcher, the kernels and the padded tails' buffers."""

    def __init__(self, cfg: ForwardConfig, max_num_tokens: int) -> None:
        super().__init__(cfg)
        self.k = load(_KERNELS)
        R, T = cfg.max_num_seqs, max_num_tokens
        self.shape = np.zeros(3, dtype=np.int64)  # [T, max_query_len, decode_graph_eligible]
        self.descs: dict = {}  # (R, T, max_query_len, eligible) -> (BatchDescriptor, num_slots): the config's
        self.query_start_loc = np.zeros(R + 1, dtype=np.int32)  # [num_reqs_padded + 1]
        self.seq_lens = np.zeros(R, dtype=np.int32)  # [num_reqs_padded]
        self.slot_mapping = np.zeros((len(cfg.groups), T), dtype=np.int64)  # [G, num_slots]
        self.is_padding = np.zeros(T, dtype=bool)  # [num_tokens_padded]
        self.positions = np.zeros(T if cfg.runner == "v1" else 0, dtype=np.int64)  # [num_tokens_padded] (V1)


def cudagraph_numba(cfg: ForwardConfig, step, buf: PaddingBuffers) -> gp.Padding:
    r, m = step.rows, core_of(step)
    qsl, mrv2 = r.query_start_loc, cfg.runner == "mrv2"
    buf.k.step_shape(qsl, r.num_computed_tokens, r.prefill_len, r.idx_mapping, r.num_draft_tokens, mrv2, buf.shape)
    key = (len(r.idx_mapping), *buf.shape.tolist())  # (R, T, max_query_len, decode_graph_eligible)
    got = buf.descs.get(key)
    if got is None:
        if len(buf.descs) >= DESCS_KEPT:
            buf.descs.clear()
        desc = buf.dispatcher.dispatch(key[0], key[1], key[2], key[3] == 1)
        got = buf.descs[key] = desc, P.num_slots(cfg.runner, desc, True)
    desc, n = got
    R, T = key[0], key[1]
    tables = m.tables
    Rp, Tp = desc.num_reqs_padded, desc.num_tokens_padded
    if Tp == T and Rp == R:  # nothing padded: the arrays themselves
        tails = P.PaddedTails(qsl, r.seq_lens, m.slot_mapping, tables, None, None if mrv2 else m.positions)
    else:
        slots = buf.slot_mapping[:, :n]
        buf.k.pad_tails(qsl, r.seq_lens, m.slot_mapping, m.positions, R, T, Rp, Tp, n, PAD_SLOT_ID,
                        buf.query_start_loc, buf.seq_lens, slots, buf.positions, buf.is_padding)
        tails = P.PaddedTails(buf.query_start_loc[: Rp + 1], buf.seq_lens[:Rp], slots, tables, buf.is_padding[:Tp],
                              None if mrv2 else buf.positions[:Tp])
    return gp.Padding(desc, tails, buf.sizes[-1] if buf.sizes else 0)


# ------------------------------------------------------------------------------------------ attention

class SplitBuffers(gp.SplitRules):
    """Each group's split rule, the kernels, the metadata's buffers and FlashInfer's."""

    def __init__(self, cfg: ForwardConfig) -> None:
        super().__init__(cfg)
        self.k = load(_KERNELS)
        self.any_local = any(g.kind == "chunked_local" for g in cfg.groups)
        self.is_prefilling = np.zeros(cfg.max_num_seqs, dtype=bool)  # [num_reqs] (V1) or [R] (MRV2)
        self.out = np.zeros(6, dtype=np.int64)  # the kernel's scalars (kernels.common_split)
        # the configuration's, per step the same (results are never written, inputs.py)
        self.attending = [(g, self.rules[g]) for g, grp in enumerate(cfg.groups) if gp._attends(grp)]
        self.thresholds = [self.rules[g][0] if gp._attends(grp) else None for g, grp in enumerate(cfg.groups)]
        self.local = [False] * len(cfg.groups)  # [G] (a chunked_local group takes the numpy form)
        names = gp.backend_names(cfg)
        # FlashInfer's arrays computed here, the objects of both parts deferred, when no backend needs the
        # objects in the phase (no FlashAttention/Triton group) and no DCP rank adjusts the KV lengths
        self.fused = cfg.dcp_size == 1 and not self.any_local and not {"FLASH_ATTN", "TRITON_ATTN"} & set(names)
        self.flashinfer = [(g, cfg.groups[g].kernel_block_size, FI.NumbaBuffers(self.k))
                           for g, name in enumerate(names) if name == "FLASHINFER"]  # [(g, page_size, buffers)]


def attention_numba(cfg: ForwardConfig, step, buf: SplitBuffers):
    """The part; when `buf.fused`, also FlashInfer's arrays: `Deferred(make, [(g, page_size, arrays)])`, the
    objects made on first read (the backends part makes its own from the payload)."""
    if buf.any_local:  # virtual batches: the numpy form
        return gp.attention_host(cfg, step, buf)
    pad: gp.Padding = step.parts["cudagraph"]
    desc, tails = pad.desc, pad.tails
    if desc.num_reqs == 0:
        return gp._empty(cfg)
    r, v1, R = step.rows, cfg.runner == "v1", desc.num_reqs
    n, t = (desc.num_reqs_padded, desc.num_tokens_padded) if desc.pad_attn else (R, desc.num_tokens)
    qsl, sl = tails.query_start_loc, tails.seq_lens  # [n + 1], [n] (the tails are the attention's counts)
    if len(sl) != n:
        qsl, sl = qsl[: n + 1], sl[:n]
    pre = buf.is_prefilling[: n if v1 else R]
    lens = r.num_prompt_tokens if v1 else r.prefill_len
    up = A.upper_bound(cfg.runner, sl, R, r.num_computed_tokens_correction)  # [n]: max_seq_len's source
    got: list = [None] * len(cfg.groups)  # [G] (max_query_len, max_seq_len, split) of the group's rule
    memo: dict = {}  # (threshold, require_uniform) -> (max_query_len, max_seq_len, split)
    for g, rule in buf.attending:
        v = memo.get(rule)
        if v is None:
            th, uniform = rule
            buf.k.common_split(qsl, up, r.num_computed_tokens, lens, r.idx_mapping, n, t, v1,
                               -1 if th is None else th, uniform, pre, buf.out)
            o = buf.out.tolist()
            v = memo[rule] = o[0], o[1], None if th is None else A.Split(o[2], o[3], o[4], o[5])
        got[g] = v

    def make() -> gp.Attention:
        common, splits = [None] * len(cfg.groups), [None] * len(cfg.groups)
        for g, v in enumerate(got):
            if v is not None:
                table = tails.block_tables[g]  # [R, W] (a padded row has no blocks: never read, graph_parts.py)
                common[g] = A.CommonAttentionMetadata(qsl, sl, n, t, v[0], v[1], table if len(table) <= n else
                                                      table[:n], tails.slot_mapping[g], pre, up)
                splits[g] = v[2]
        return gp.Attention(common, buf.thresholds, splits, buf.local)

    if not buf.fused:
        return make()
    kv = np.asarray(FI.kv_source(sl, up, cfg.num_speculative_tokens), dtype=np.int32)  # [n] (no DCP when fused)
    fi = [(g, ps, FI.arrays_numba(b, kv, tails.block_tables[g], ps, n)) for g, ps, b in buf.flashinfer]
    return Deferred(make, fi)


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
            for g, ps, arrays in att.payload:
                md[g] = FI.metadata_of(a.common[g], a.splits[g], ps, arrays)
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
