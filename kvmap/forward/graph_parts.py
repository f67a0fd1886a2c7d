"""Items 2-4 of the forward pass as parts (inputs.py PARTS): CUDA-graph padding, attention metadata, backends.

Job: compose the pure rules (cudagraph.py, padded_tails.py, attention.py, local_attention.py, flashinfer.py,
flash_attn.py) over one step's core mappings, in both forms: `*_host` (numpy, for the host workers) and `*_spec`
(scalar, for the reference worker). Each part's result says its dump keys (`to_dict`, vLLM's names).

Rules (docs/trace-format.md, "Forward-pass dump keys"):
- `cudagraph`: the step's `BatchDescriptor` (the resolved capture sizes: the header's or the options', with
  V1's spec-decode rounding) and the padded tails. Dispatch inputs: R, T and max_query_len of the step, and
  MRV2's `decode_graph_eligible` with `num_computed_prefill_tokens = min(num_computed_tokens, prefill_len)`.
  The host form skips the tails of an unpadded step (every tail is then the unpadded array itself).
- `attention`: one `CommonAttentionMetadata` per KV-cache group that attends (not mamba), over the group's
  gathered table (the kernel table under a kernel split; MRV2's sliding-window nulling is already in it);
  `is_prefilling` compares num_computed_tokens with MRV2's prefill_len or V1's num_prompt_tokens. A
  chunked_local group's metadata is its virtual batches (`make_local_attention_virtual_batches`, over the
  group's table at vLLM's width cdiv(max_model_len, kernel block size), entries past a row's blocks 0: vLLM's
  are stale there). The split per group with its backend's `reorder_batch_threshold` and `require_uniform`
  (FlashInfer's native decode); None where the backend does not split (FA, Triton), is unknown, or the group
  is a state group.
- `backends`: per group by its `attention_backend`: FLASHINFER -> flashinfer.build (page size = the kernel
  block size), FLASH_ATTN -> flash_attn.build (FA3, `max_num_splits`), TRITON_ATTN -> the pass-through; any
  other or unknown backend -> None (ForwardConfig.skipped says so for unknown ones). Under DCP the rank is the
  first computed one (the dump's `slot_mapping` rank).
- The host form does not copy the block tables into padded rows: every reader stops at a row's blocks and a
  padded row has none (seq_len 0). The spec pads them (`pad_tails_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvmap.forward import attention as A
from kvmap.forward import cudagraph as C
from kvmap.forward import flash_attn as FA
from kvmap.forward import flashinfer as FI
from kvmap.forward import local_attention as L
from kvmap.forward import padded_tails as P
from kvmap.forward.config import ForwardConfig, GroupForward
from kvmap.forward.core import core_of

FLASHINFER_DECODE = "native"  # the native decode path (a header key names no other yet)
FA_VERSION = 3  # FlashAttention 3 (Hopper's default): the version that sets max_num_splits under FULL graphs


def capture_sizes(cfg: ForwardConfig) -> list[int]:
    """The sizes the runner captures: the resolved ones, with V1's rounding to multiples of 1+k."""
    if cfg.eager:
        return []
    return C.resolve_capture_sizes(cfg.runner, cfg.cudagraph_mode, list(cfg.cudagraph_capture_sizes),
                                   cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.num_speculative_tokens)


def _tables(m) -> list[np.ndarray]:
    """[G] x [R, W_g] int32: the gathered tables the attention builders get (kernel tables under a split)."""
    return m.kernel_block_tables if m.kernel_block_tables is not None else m.block_tables


def _kernel_blocks(m, g: int) -> np.ndarray:
    """[R] valid kernel-block entries of group g's rows."""
    k = m.kernel_blocks_per_block[g] if m.kernel_blocks_per_block is not None else 1
    return m.num_blocks[g] * k


def _local_width(cfg: ForwardConfig, grp: GroupForward) -> int:
    return -(-cfg.max_model_len // grp.kernel_block_size)  # vLLM's max_num_blocks_per_req


def _attends(grp: GroupForward) -> bool:
    return grp.kind != "mamba"


def v1_reorder_threshold(cfg: ForwardConfig) -> int | None:
    """V1's batch reorder threshold: the least `reorder_batch_threshold` any group's builder sets (None: none
    sets one, V1 keeps its persistent order; vllm/v1/worker/gpu_model_runner.py:6817-6835)."""
    ts = [t for t, _ in (split_rule(cfg, grp) for grp in cfg.groups) if t is not None]
    return min(ts) if ts else None


# ------------------------------------------------------------------------------------------ results

def _per_group(values: list, key) -> list:
    return [None if v is None else key(v) for v in values]


def _tolist(a) -> Any:
    return None if a is None else a.tolist()


@dataclass(slots=True)
class Padding:
    """The `cudagraph` part: the step's graph choice and padded tails."""

    desc: C.BatchDescriptor
    tails: P.PaddedTails  # block_tables: the unpadded tables in the host form (see the module's rules)
    max_cudagraph_capture_size: int  # 0 when eager

    def to_dict(self) -> dict:
        d = self.desc
        return {"cudagraph_mode": d.cudagraph_mode, "num_tokens_padded": d.num_tokens_padded,
                "num_reqs_padded": d.num_reqs_padded}


@dataclass(slots=True)
class Attention:
    """The `attention` part: [G] CommonAttentionMetadata (None: a state group) and [G] split."""

    common: list[A.CommonAttentionMetadata | None]  # [G]; chunked_local groups: their virtual batches
    thresholds: list[int | None]  # [G] reorder_batch_threshold (None: no split, or the backend unknown)
    splits: list[A.Split | None]  # [G]
    local: list[bool]  # [G] a chunked_local group (its metadata are the virtual batches)

    def to_dict(self) -> dict:
        cm = next((c for c, loc in zip(self.common, self.local) if c is not None and not loc), None)
        d: dict = {}  # the shared fields, the same in every full/sliding group: once (null: no request)
        d.update(num_actual_tokens=cm and cm.num_actual_tokens, max_query_len=cm and cm.max_query_len,
                 max_seq_len=cm and cm.max_seq_len, is_prefilling=cm and _tolist(cm.is_prefilling))
        d["reorder_batch_threshold"] = self.thresholds
        for k in ("num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens"):
            d[k] = [None if s is None else getattr(s, k) for s in self.splits]
        if any(self.local):
            loc = [c if is_loc else None for c, is_loc in zip(self.common, self.local)]
            d.update(local_query_start_loc=_per_group(loc, lambda c: c.query_start_loc.tolist()),
                     local_seqused_k=_per_group(loc, lambda c: c.seq_lens.tolist()),
                     local_block_table=_per_group(loc, lambda c: c.block_table_tensor.tolist()),
                     local_max_query_len=_per_group(loc, lambda c: c.max_query_len),
                     local_max_seq_len=_per_group(loc, lambda c: c.max_seq_len))
        return d


@dataclass(slots=True)
class Backends:
    """The `backends` part: [G] each group's backend metadata (None: unknown backend, or a state group)."""

    metadata: list[Any]  # [G] FlashInferMetadata | FlashAttentionMetadata | TritonAttentionMetadata | None
    names: list[str | None]  # [G] the groups' attention_backend (the keys present: by the configuration)
    dcp: bool

    def to_dict(self) -> dict:
        d: dict = {}
        fi = [x if isinstance(x, FI.FlashInferMetadata) else None for x in self.metadata]
        if "FLASHINFER" in self.names:
            d.update(paged_kv_indptr=_per_group(fi, lambda x: x.paged_kv_indptr.tolist()),
                     paged_kv_indices=_per_group(fi, lambda x: x.paged_kv_indices.tolist()),
                     paged_kv_last_page_len=_per_group(fi, lambda x: x.paged_kv_last_page_len.tolist()))
        fa = [x if isinstance(x, FA.FlashAttentionMetadata) else None for x in self.metadata]
        if "FLASH_ATTN" in self.names:
            d["max_num_splits"] = _per_group(fa, lambda x: x.max_num_splits)
            if self.dcp:
                d.update(dcp_context_kv_lens=_per_group(fa, lambda x: x.dcp_context_kv_lens.tolist()),
                         max_dcp_context_kv_len=_per_group(fa, lambda x: x.max_dcp_context_kv_len))
        return d


# ------------------------------------------------------------------------------------------ cudagraph

class PaddingBuffers:
    """What the host form keeps across steps: the dispatcher's lookup tables."""

    def __init__(self, cfg: ForwardConfig) -> None:
        self.sizes = capture_sizes(cfg)
        self.dispatcher = C.Dispatcher(cfg.runner, cfg.cudagraph_mode, self.sizes, cfg.max_num_seqs,
                                       cfg.num_speculative_tokens)


def _eligible_host(r, q: np.ndarray, T: int, R: int, max_q: int) -> bool:
    """MRV2's decode_graph_eligible, only where it decides (a uniform shape). q: [R] query lengths."""
    if T != max_q * R:
        return True  # not uniform whatever it says
    nc = r.num_computed_tokens
    prefilling = nc < r.prefill_len[r.idx_mapping]
    if not prefilling.any():
        return True
    return not (prefilling & ~((q - r.num_draft_tokens == 1) & (nc > 0))).any()


def cudagraph_host(cfg: ForwardConfig, step, buf: PaddingBuffers) -> Padding:
    r, m = step.rows, step.mappings()
    qsl = r.query_start_loc
    R, T = len(r.idx_mapping), int(qsl[-1])
    q = m.num_scheduled_tokens
    max_q = int(q.max()) if R else 0
    desc = buf.dispatcher.dispatch(R, T, max_q, cfg.runner == "v1" or _eligible_host(r, q, T, R, max_q))
    tables = _tables(m)
    if desc.num_tokens_padded == T and desc.num_reqs_padded == R:  # nothing padded: the arrays themselves
        tails = P.PaddedTails(qsl, r.seq_lens, m.slot_mapping, tables, None,
                              None if cfg.runner == "mrv2" else m.positions)
    else:
        t = P.pad_tails(cfg.runner, desc, qsl, r.seq_lens, m.slot_mapping, [], m.positions)
        tails = P.PaddedTails(t.query_start_loc, t.seq_lens, t.slot_mapping, tables, t.is_padding, t.positions)
    return Padding(desc, tails, buf.sizes[-1] if buf.sizes else 0)


def cudagraph_spec(cfg: ForwardConfig, step) -> Padding:
    r, m = step.rows, step.mappings()
    qsl = [int(x) for x in r.query_start_loc]
    R, T = len(qsl) - 1, qsl[-1]
    q = [qsl[b + 1] - qsl[b] for b in range(R)]
    idx = [int(x) for x in r.idx_mapping]
    pre = [int(r.prefill_len[i]) for i in idx]
    nc = [int(x) for x in r.num_computed_tokens]
    elig = C.decode_graph_eligible(q, [int(x) for x in r.num_draft_tokens],
                                   [min(c, p) for c, p in zip(nc, pre)], pre)
    sizes = capture_sizes(cfg)
    desc = C.dispatch_spec(cfg.runner, cfg.cudagraph_mode, sizes, cfg.max_num_seqs, cfg.num_speculative_tokens,
                           R, T, max(q, default=0), elig)
    tails = P.pad_tails_spec(cfg.runner, desc, r.query_start_loc, r.seq_lens, m.slot_mapping, _tables(m),
                             m.positions)
    return Padding(desc, tails, sizes[-1] if sizes else 0)


# ------------------------------------------------------------------------------------------ attention

def _local_table_host(cfg, grp, m, g: int, n: int) -> np.ndarray:
    """[n, W] group g's table at vLLM's width, 0 past each row's blocks and on padded rows."""
    W = _local_width(cfg, grp)
    src, nb = _tables(m)[g], _kernel_blocks(m, g)
    R = len(nb)
    w = min(W, src.shape[1])
    out = np.zeros((n, W), dtype=np.int32)
    out[:R, :w] = np.where(np.arange(w) < nb[:, None], src[:R, :w], 0)
    return out


def _local_table_spec(cfg, grp, m, g: int, n: int) -> np.ndarray:
    W = _local_width(cfg, grp)
    src, nb = _tables(m)[g], _kernel_blocks(m, g)
    rows = [[int(src[b, j]) if b < len(nb) and j < int(nb[b]) else 0 for j in range(W)] for b in range(n)]
    return np.array(rows, dtype=np.int32).reshape(n, W)


def split_rule(cfg: ForwardConfig, grp: GroupForward) -> tuple[int | None, bool]:
    """(reorder_batch_threshold, require_uniform) of the group's backend; (None, False): no split."""
    if not _attends(grp) or grp.attention_backend not in A.BACKENDS:
        return None, False
    t = A.reorder_batch_threshold(grp.attention_backend, cfg.num_speculative_tokens, cfg.dcp_size,
                                  runner=cfg.runner, flashinfer_decode=FLASHINFER_DECODE)
    return t, A.require_uniform(grp.attention_backend, FLASHINFER_DECODE)


def _empty(cfg: ForwardConfig) -> Attention:
    G = len(cfg.groups)
    return Attention([None] * G, [None] * G, [None] * G, [g.kind == "chunked_local" for g in cfg.groups])


def _with_group(cm: A.CommonAttentionMetadata, table: np.ndarray, slots: np.ndarray) -> A.CommonAttentionMetadata:
    """The shared metadata with one group's table and slots (vLLM's shallow copy per group)."""
    return A.CommonAttentionMetadata(cm.query_start_loc, cm.seq_lens, cm.num_reqs, cm.num_actual_tokens,
                                     cm.max_query_len, cm.max_seq_len, table, slots, cm.is_prefilling,
                                     cm.seq_lens_cpu_upper_bound, cm.causal)


class SplitRules:
    """What the host form keeps across steps: each group's split rule."""

    def __init__(self, cfg: ForwardConfig) -> None:
        self.rules = [split_rule(cfg, grp) for grp in cfg.groups]  # [G] (threshold, require_uniform)


def attention_host(cfg: ForwardConfig, step, buf: SplitRules) -> Attention:
    pad: Padding = step.parts["cudagraph"]
    if pad.desc.num_reqs == 0:
        return _empty(cfg)
    r, m = step.rows, step.mappings()
    lens = (r.prefill_len if cfg.runner == "mrv2" else r.num_prompt_tokens)[r.idx_mapping]
    cm0 = A.common_metadata(cfg.runner, pad.desc, pad.tails, 0, r.num_computed_tokens, lens,
                            r.num_computed_tokens_correction)
    common, thresholds, splits, local = [], [], [], []
    memo: dict = {}  # (threshold, require_uniform) -> split of the shared metadata
    for g, grp in enumerate(cfg.groups):
        is_local = grp.kind == "chunked_local"
        local.append(is_local)
        if not _attends(grp):
            common.append(None)
            thresholds.append(None)
            splits.append(None)
            continue
        cm = _with_group(cm0, pad.tails.block_tables[g], pad.tails.slot_mapping[g])
        if is_local:
            cm = L.virtual_batches(_with_group(cm, _local_table_host(cfg, grp, m, g, cm.num_reqs), cm.slot_mapping),
                                   grp.attention_chunk_size, grp.kernel_block_size)
        common.append(cm)
        t, uniform = buf.rules[g]
        thresholds.append(t)
        if t is None:
            splits.append(None)
        elif is_local:
            splits.append(A.split_decodes_and_prefills(cm.query_start_loc, cm.num_reqs, cm.num_actual_tokens,
                                                       cm.max_query_len, t, uniform))
        else:
            if (t, uniform) not in memo:
                memo[t, uniform] = A.split_decodes_and_prefills(cm.query_start_loc, cm.num_reqs,
                                                                 cm.num_actual_tokens, cm.max_query_len, t, uniform)
            splits.append(memo[t, uniform])
    return Attention(common, thresholds, splits, local)


def attention_spec(cfg: ForwardConfig, step) -> Attention:
    pad: Padding = step.parts["cudagraph"]
    if pad.desc.num_reqs == 0:
        return _empty(cfg)
    r, m = step.rows, step.mappings()
    by_row = r.prefill_len if cfg.runner == "mrv2" else r.num_prompt_tokens
    lens = [int(by_row[int(i)]) for i in r.idx_mapping]
    common, thresholds, splits, local = [], [], [], []
    for g, grp in enumerate(cfg.groups):
        local.append(grp.kind == "chunked_local")
        if not _attends(grp):
            common.append(None)
            thresholds.append(None)
            splits.append(None)
            continue
        cm = A.common_metadata_spec(cfg.runner, pad.desc, pad.tails, g, r.num_computed_tokens, lens,
                                    r.num_computed_tokens_correction)
        if local[-1]:
            cm = L.virtual_batches_spec(replace(cm, block_table_tensor=_local_table_spec(cfg, grp, m, g,
                                                                                          cm.num_reqs)),
                                        grp.attention_chunk_size, grp.kernel_block_size)
        common.append(cm)
        t, uniform = split_rule(cfg, grp)
        thresholds.append(t)
        splits.append(None if t is None else A.split_decodes_and_prefills_spec(
            cm.query_start_loc, cm.num_reqs, cm.num_actual_tokens, cm.max_query_len, t, uniform))
    return Attention(common, thresholds, splits, local)


# ------------------------------------------------------------------------------------------ backends

def backend_names(cfg: ForwardConfig) -> list[str | None]:
    """[G] the groups' attention_backend (None: a state group)."""
    return [g.attention_backend if _attends(g) else None for g in cfg.groups]


def backends_with(cfg: ForwardConfig, step, fi_build, fa_build, names: list | None = None) -> Backends:
    """The part by the given forms: fi_build(g, cm, split, page_size, k, dcp_size, rank, interleave) and
    fa_build(cm, mode, max_capture_size, fa_version, dcp_size, rank, interleave); `names`: backend_names(cfg)
    (a caller may keep it)."""
    pad: Padding = step.parts["cudagraph"]
    att: Attention = step.parts["attention"]
    rank, interleave = core_of(step).rank, cfg.cp_kv_cache_interleave_size
    out: list = []
    for g, (grp, cm, sp) in enumerate(zip(cfg.groups, att.common, att.splits)):
        name = grp.attention_backend
        if cm is None or name is None:
            out.append(None)
        elif name == "FLASHINFER":
            out.append(fi_build(g, cm, sp, grp.kernel_block_size, cfg.num_speculative_tokens, cfg.dcp_size, rank,
                                interleave))
        elif name == "FLASH_ATTN":
            out.append(fa_build(cm, cfg.cudagraph_mode, pad.max_cudagraph_capture_size, FA_VERSION, cfg.dcp_size,
                                rank, interleave))
        elif name == "TRITON_ATTN":
            out.append(FA.triton_attn(cm))
        else:
            out.append(None)
    return Backends(out, backend_names(cfg) if names is None else names, cfg.dcp_size > 1)


def _fi_numpy(g: int, *args) -> FI.FlashInferMetadata:
    return FI.build(*args)


def _fi_spec(g: int, *args) -> FI.FlashInferMetadata:
    return FI.build_spec(*args)


def backends_host(cfg: ForwardConfig, step, _buf) -> Backends:
    return backends_with(cfg, step, _fi_numpy, FA.build)


def backends_spec(cfg: ForwardConfig, step) -> Backends:
    return backends_with(cfg, step, _fi_spec, FA.build_spec)
