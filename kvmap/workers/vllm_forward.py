"""The forward-pass parts vLLM's own builders make (`attention`, `backends`), for the vLLM backends and the tests.

Job: call vLLM's attention-side code on one step's vLLM inputs and hand the results back in kvmap's forms
(kvmap/forward: `graph_parts.Attention`, `attention.CommonAttentionMetadata`, `flashinfer.FlashInferMetadata`),
so that `validate --deep` compares vLLM's values with the reference's. No vLLM rule is restated here: each value
comes out of a vLLM function, run on stand-ins made with `object.__new__` where a constructor needs a GPU
(forward-pass-probes/ shows each on this CPU). vLLM is imported inside the functions only (kvmap without vLLM
imports this module).

Rules:
- CommonAttentionMetadata: Model Runner V2's `DefaultModelState.prepare_attn` (-> `build_attn_metadata`) over
  the runner's own `InputBatch`, block tables and slot mappings, with the step's graph mode (`mrv2_prepare_attn`),
  or V1's `_build_attention_metadata` on its runner (workers/vllm_v1.py); the attention groups are recorders
  (`RecordGroup`) whose builder returns the metadata it is given; a mamba group has none.
- chunked_local groups: vLLM's `make_local_attention_virtual_batches` over the group's metadata whose table is
  kvmap's at vLLM's width (graph_parts: entries past a row's blocks 0, where vLLM's buffers are stale).
- The split: vLLM's `split_decodes_and_prefills` with the backend's `reorder_batch_threshold` and
  `require_uniform` (graph_parts.split_rule: the threshold rule of kvmap/forward/attention.py).
- FLASHINFER groups: vLLM's `FlashInferMetadataBuilder.build` on a builder without `__init__` (the native
  prefill and decode paths, FlashInfer's wrappers replaced by recorders of their `plan()` arguments), one per
  group, its buffers kept across steps as vLLM's are; `paged_kv_indptr`, `paged_kv_indices` and
  `paged_kv_last_page_len` from its buffers, `seq_lens_cpu` by FlashInfer's `get_seq_lens` of those, the plans
  as recorded. Where vLLM's builder cannot run a step (vllm#49980: a chunked_local group's virtual batches
  outnumber max_num_seqs) or FlashInfer does not import, the group's metadata is kvmap's numpy form; so is
  every FLASH_ATTN and TRITON_ATTN group's (on vLLM's CommonAttentionMetadata).
- CUDA graphs: Model Runner V2's `CudaGraphManager` (`mrv2_manager`) and V1's `CudagraphDispatcher`
  (`v1_dispatcher`), each built on a stand-in `VllmConfig` (`vllm_config`) for the forward config's mode and
  capture sizes (the header's or the options': graph_parts.capture_sizes), answering as after capture.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np

from kvmap.forward import attention as A
from kvmap.forward import flashinfer as FI
from kvmap.forward import graph_parts as gp
from kvmap.forward.config import ForwardConfig


def flashinfer_import_error() -> str | None:
    """Why vLLM's FlashInfer backend does not import here (None: it does)."""
    try:
        import vllm.v1.attention.backends.flashinfer  # noqa: F401
    except Exception as e:  # flashinfer-python missing or built for another torch
        return f"{type(e).__name__}: {e}".splitlines()[0][:160]
    return None


class RecordGroup:
    """An attention group whose builder returns the CommonAttentionMetadata it is given."""

    def __init__(self, g: int) -> None:
        self.layer_names = [f"layer{g}"]

    def get_metadata_builder(self, _ubatch_idx=0):
        return SimpleNamespace(supports_update_block_table=False)

    def build_metadata(self, cm, _ubatch_idx=0, **_kw):
        return cm


def vllm_cm(cm: A.CommonAttentionMetadata, torch, CM):
    """vLLM's `CommonAttentionMetadata` (class `CM`) holding copies of kvmap's host arrays."""
    t = torch.from_numpy
    return CM(query_start_loc=t(cm.query_start_loc.copy()), query_start_loc_cpu=t(cm.query_start_loc.copy()),
              seq_lens=t(cm.seq_lens.copy()), num_reqs=cm.num_reqs, num_actual_tokens=cm.num_actual_tokens,
              max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
              block_table_tensor=t(np.ascontiguousarray(cm.block_table_tensor)),
              slot_mapping=t(cm.slot_mapping.copy()), is_prefilling=t(cm.is_prefilling.copy()),
              seq_lens_cpu_upper_bound=t(cm.seq_lens_cpu_upper_bound.copy()))


def _np(t) -> np.ndarray:
    return t.cpu().numpy()


def kvmap_cm(v) -> A.CommonAttentionMetadata:
    """kvmap's host form of vLLM's `CommonAttentionMetadata` `v` (copies)."""
    return A.CommonAttentionMetadata(
        _np(v.query_start_loc_cpu).copy(), _np(v.seq_lens).copy(), int(v.num_reqs), int(v.num_actual_tokens),
        int(v.max_query_len), int(v.max_seq_len), _np(v.block_table_tensor).copy(), _np(v.slot_mapping).copy(),
        None if v.is_prefilling is None else _np(v.is_prefilling).copy(), _np(v.seq_lens_cpu_upper_bound).copy(),
        bool(v.causal))


def flashinfer_builder(fi, h, page: int, cp: int, plans: dict, device, cls=None):
    """vLLM's FlashInfer builder without __init__ (which needs a GPU), `fi` its module: the native prefill and
    decode paths, the wrappers replaced by recorders of their plan() arguments into `plans`. `cls`: the builder
    class (vLLM's `FlashInferMetadataBuilder`, or a subclass)."""
    import torch
    from vllm.v1.utils import CpuGpuBuffer

    B = object.__new__(cls or fi.FlashInferMetadataBuilder)
    width = -(-(h.max_model_len + h.num_speculative_tokens) // page) + 1
    B.__dict__.update(
        reorder_batch_threshold=1, use_xqa=False, use_trtllm_gen_varlen_decode=False, page_size=page,
        attention_config=SimpleNamespace(use_trtllm_attention=False), num_qo_heads=8, num_kv_heads=2,
        dcp_world_size=cp, dcp_rank=0, cache_dtype="auto", q_data_type_prefill=torch.bfloat16,
        q_data_type_decode=torch.bfloat16, has_sinks=False, use_trtllm_decode_attention=False, use_dcp=cp > 1,
        global_hyperparameters=SimpleNamespace(has_same_window_lefts=True, has_same_all_params=True),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: "NHD"),
        _num_speculative_tokens=h.num_speculative_tokens, enable_cuda_graph=False, _decode_cudagraph_max_bs=0,
        use_fa2_native_decode=False, model_config=SimpleNamespace(dtype=torch.bfloat16), nvfp4_trtllm=False,
        sm_scale=0.125, window_left=-1, logits_soft_cap=None, kv_cache_dtype=torch.bfloat16,
        prefill_fixed_split_size=-1, decode_fixed_split_size=-1, disable_split_kv=False, head_dim=64,
        dcp_kv_cache_interleave_size=h.cp_kv_cache_interleave_size,
        paged_kv_indptr=CpuGpuBuffer(h.max_num_seqs + 1, dtype=torch.int32, device=device, pin_memory=False),
        paged_kv_indices=torch.zeros(h.max_num_seqs * width, dtype=torch.int32, device=device),
        paged_kv_last_page_len=CpuGpuBuffer(h.max_num_seqs, dtype=torch.int32, device=device, pin_memory=False))
    keep = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "seq_lens", "page_size",
            "qo_indptr_cpu", "paged_kv_indptr_cpu", "paged_kv_last_page_len_cpu", "kv_lens_cpu",
            "indptr", "indices", "last_page_len", "q_len_per_req", "num_qo_heads")

    def record(key):
        def plan(*_a, **kw):
            plans[key] = {k: (v.cpu().numpy().copy() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()
                          if k in keep}
        return plan

    prefill_cls = fi.BatchDCPPrefillWrapper if cp > 1 else fi.BatchPrefillWithPagedKVCacheWrapper
    prefill = type("RecPrefill", (prefill_cls,), {"__init__": lambda self: None, "plan": record("prefill")})
    B._get_prefill_wrapper = lambda causal=True: prefill()
    B._get_decode_wrapper = lambda n, use_cg, q_len=1: SimpleNamespace(is_cuda_graph_enabled=False,
                                                                      plan=record("decode"))
    return B


def rebind(B, fi, h, page: int, cp: int, plans: dict, device, cls=None):
    """The same builder (its buffers carry over between steps, as vLLM's do) with recorders into `plans`."""
    fresh = flashinfer_builder(fi, h, page, cp, plans, device, cls)
    for key in () if B is None else ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
        setattr(fresh, key, getattr(B, key))
    return fresh


def _plans_to_kvmap(fi, md, B, plans: dict, n: int, cp: int) -> FI.FlashInferMetadata:
    """kvmap's FlashInferMetadata from vLLM's build: its buffers and recorded plan() arguments."""
    import torch

    i32 = np.int32
    indptr = B.paged_kv_indptr.np[: n + 1].astype(i32)
    last = B.paged_kv_last_page_len.np[:n].astype(i32)
    indices = _np(B.paged_kv_indices[: int(indptr[-1])]).astype(i32)
    page = B.page_size
    seq = _np(fi.get_seq_lens(torch.from_numpy(indptr), torch.from_numpy(last), page)).astype(i32)
    prefill = decode = None
    if "prefill" in plans:
        p = plans["prefill"]
        qo, ip, lp, kv = ((p["qo_indptr_cpu"], p["paged_kv_indptr_cpu"], p["paged_kv_last_page_len_cpu"],
                           p["kv_lens_cpu"]) if cp > 1 else
                          (p["qo_indptr"], p["paged_kv_indptr"], p["paged_kv_last_page_len"], p["seq_lens"]))
        prefill = FI.PrefillPlan(qo.astype(i32), ip.astype(i32), lp.astype(i32), kv.astype(i32), p["page_size"])
    if "decode" in plans:
        d = plans["decode"]
        decode = FI.DecodePlan(d["indptr"].astype(i32), d["last_page_len"].astype(i32), d["seq_lens"].astype(i32),
                               d["page_size"], d["q_len_per_req"], d["num_qo_heads"] // B.num_qo_heads)
    return FI.FlashInferMetadata(int(md.num_decodes), int(md.num_prefills), int(md.num_decode_tokens),
                                 int(md.num_prefill_tokens), seq, indptr, indices, last, prefill, decode)


class VllmAttentionParts:
    """The `attention` and `backends` parts of one runner's steps from vLLM's builders (see the module's rules).
    `flashinfer_class`: the FlashInfer builder class (a subclass plants a broken copy in tests)."""

    def __init__(self, cfg: ForwardConfig, header, device) -> None:
        import torch
        from vllm.v1.attention.backends import utils as bu

        self.cfg, self.h, self.device, self.torch, self.bu = cfg, header, device, torch, bu
        self.rules = [gp.split_rule(cfg, grp) for grp in cfg.groups]  # [G] (threshold, require_uniform)
        self.attn_groups = [[RecordGroup(g)] if grp.kind != "mamba" else [] for g, grp in enumerate(cfg.groups)]
        self.flashinfer_error = flashinfer_import_error() if "FLASHINFER" in _names(cfg) else None
        self.flashinfer_class = None
        self.builders: dict[int, object] = {}  # group -> its FlashInfer builder (buffers kept across steps)
        self.vcms: list = []  # [G] this step's vLLM CommonAttentionMetadata (None: no metadata)

    @property
    def native_backends(self) -> bool:
        """vLLM builds the `backends` part: every group that has backend metadata is a FLASHINFER group and
        FlashInfer imports."""
        names = [g.attention_backend for g in self.cfg.groups if g.kind != "mamba"]
        return bool(names) and all(n == "FLASHINFER" for n in names) and self.flashinfer_error is None

    def attention(self, step, mds: dict) -> gp.Attention:
        """The attention part from vLLM's per-layer metadata `mds` (prepare_attn's result)."""
        cfg, bu = self.cfg, self.bu
        m = step.mappings()
        common, thresholds, splits, local, self.vcms = [], [], [], [], []
        for g, grp in enumerate(cfg.groups):
            is_local = grp.kind == "chunked_local"
            local.append(is_local)
            v = mds.get(f"layer{g}")
            if v is None:
                common.append(None)
                thresholds.append(None)
                splits.append(None)
                self.vcms.append(None)
                continue
            if is_local:  # ChunkedLocalAttentionBuilder: the virtual batches over the table at vLLM's width
                table = gp._local_table_host(cfg, grp, m, g, int(v.num_reqs))
                v = dataclasses.replace(v, block_table_tensor=self.torch.from_numpy(table).to(self.device))
                v, _ = bu.make_local_attention_virtual_batches(grp.attention_chunk_size, v, grp.kernel_block_size)
            self.vcms.append(v)
            common.append(kvmap_cm(v))
            t, uniform = self.rules[g]
            thresholds.append(t)
            splits.append(None if t is None else A.Split(*(int(x) for x in bu.split_decodes_and_prefills(
                v, decode_threshold=t, require_uniform=uniform))))
        return gp.Attention(common, thresholds, splits, local)

    def backends(self, step) -> gp.Backends:
        """FLASHINFER groups by vLLM's builder (else kvmap's numpy form); other backends kvmap's."""
        rank = step.mappings().ranks[0]

        def fi_build(g, cm, sp, *args):
            if self.flashinfer_error is not None or cm.num_reqs > self.h.max_num_seqs:  # vllm#49980
                return FI.build(cm, sp, *args)
            return self.flashinfer(g, self.vcms[g], rank)

        return gp.backends_with(self.cfg, step, fi_build, gp.FA.build)

    def flashinfer(self, g: int, v, rank: int) -> FI.FlashInferMetadata:
        import vllm.v1.attention.backends.flashinfer as fi

        cfg, plans = self.cfg, {}
        page = cfg.groups[g].kernel_block_size
        B = self.builders[g] = rebind(self.builders.get(g), fi, self.h, page, cfg.dcp_size, plans, self.device,
                                      self.flashinfer_class)
        B.dcp_rank, B.reorder_batch_threshold = rank, self.rules[g][0]
        md = B.build(0, v)
        return _plans_to_kvmap(fi, md, B, plans, int(v.num_reqs), cfg.dcp_size)

    def note(self) -> str:
        """What of the parts vLLM built is kvmap's all the same (for `backend_detail`)."""
        notes = ["the padded tails by kvmap's numpy forms"]
        names = sorted(n for n in _names(self.cfg) - {"FLASHINFER"} if n is not None)
        if "FLASHINFER" in _names(self.cfg):
            if self.flashinfer_error is not None:
                notes.append(f"FlashInfer metadata by kvmap's numpy form (vLLM's FlashInfer backend does not "
                             f"import here: {self.flashinfer_error})")
            else:
                notes.append("FlashInfer metadata by vLLM's FlashInferMetadataBuilder")
                if any(g.kind == "chunked_local" for g in self.cfg.groups):
                    notes.append("kvmap's on steps whose virtual batches outnumber max_num_seqs (vllm#49980)")
        if names:
            notes.append(f"{', '.join(names)} metadata by kvmap's numpy forms")
        return "; ".join(notes)


def forward_label(native: tuple[str, ...], note: str = "") -> str:
    """`backend_detail`'s note of which forward parts vLLM built and which kvmap's numpy forms computed."""
    from kvmap.forward.inputs import PARTS

    rest = ", ".join(p.name for p in PARTS if p.name not in native)
    label = "; forward inputs: " + (f"{', '.join(native)} by vLLM" if native else "")
    label += (", " if native and rest else "") + (f"{rest} by kvmap's numpy forms" if rest else "")
    return label + (f" ({note})" if note else "")


def vllm_config(mode: str, max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int,
                sizes: list[int] | None = None):
    """A stand-in `VllmConfig` with what the graph dispatchers read: a `CompilationConfig` in CUDA-graph `mode`
    (with `sizes` as its capture sizes when given; else the caller resolves them), one DP rank, no LoRA."""
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode

    k = num_speculative_tokens
    cc = CompilationConfig(cudagraph_mode=getattr(CUDAGraphMode, mode))
    if sizes is not None:
        cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = list(sizes), max(sizes, default=0)
    spec = SimpleNamespace(num_speculative_tokens=k, uses_dynamic_speculative_decoding=lambda: False,
                           parallel_drafting=False) if k else None
    return SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False), compilation_config=cc, speculative_config=spec,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        performance_mode="balanced", num_speculative_tokens=k, uniform_decode_query_len=1 + k, lora_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_size=1),
        cache_config=SimpleNamespace(use_kda_recoverssm=False))


def forward_vllm_config(cfg: ForwardConfig):
    """The stand-in `VllmConfig` of a replay's forward config (its resolved capture sizes)."""
    return vllm_config(cfg.cudagraph_mode, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.num_speculative_tokens,
                       gp.capture_sizes(cfg))


def v1_dispatcher(vc):
    """V1's `CudagraphDispatcher` for the stand-in config `vc`, its keys initialized (attention compiled
    piecewise)."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    cc = vc.compilation_config
    cc.is_attention_compiled_piecewise = lambda: True
    d = CudagraphDispatcher(vc)
    d.initialize_cudagraph_keys(cc.cudagraph_mode, vc.uniform_decode_query_len)
    return d


def mrv2_manager(vc):
    """Model Runner V2's `CudaGraphManager` for the stand-in config `vc`, built with `object.__new__` (its
    candidates initialized; it answers as after capture: nothing is captured)."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    m = object.__new__(CudaGraphManager)
    m.vllm_config, m.max_num_reqs = vc, vc.scheduler_config.max_num_seqs
    m.compilation_config, m.cudagraph_mode = vc.compilation_config, vc.compilation_config.cudagraph_mode
    m.decode_query_len, m.varlen_decode, m.ubatch_runner, m.lora_capture_cases = vc.uniform_decode_query_len, \
        False, None, [0]
    m._lora_dispatch_map, m._max_lora_case = m._build_lora_dispatch_map()
    m.graphs, m._candidates, m._capture_descs = {}, {}, {}
    m._init_candidates()
    m._graphs_captured = True
    return m


def _names(cfg: ForwardConfig) -> set:
    return {g.attention_backend for g in cfg.groups}


def kernel_tables(worker, n: int) -> list:
    """[G] x [n, W_g * k_g] int32 device tensors: the worker's kernel-block tables (kvmap's layout rule: the vLLM
    backends run the manager's block size) with zero rows to `n` (vLLM's padded rows hold block 0)."""
    import torch

    return [torch.from_numpy(np.pad(t, ((0, n - len(t)), (0, 0)))).to(worker.ops.torch_device)
            for t in worker.kernel_tables]


def mrv2_prepare_attn(ib, cg_mode, block_tables, slot_mappings, attn_groups) -> dict:
    """Model Runner V2's `DefaultModelState.prepare_attn` on the runner's InputBatch `ib` (a stand-in model
    state: no multimodal inputs), as `execute_model` calls it; {layer name: CommonAttentionMetadata}."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    ms = object.__new__(DefaultModelState)
    ms.supports_mm_inputs, ms.encoder_cache = False, None  # max_model_len (a property) is read at capture only
    return ms.prepare_attn(ib, cg_mode, block_tables, slot_mappings, attn_groups,
                           SimpleNamespace(kv_cache_groups=[None] * len(attn_groups)))
