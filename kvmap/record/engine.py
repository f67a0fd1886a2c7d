"""Offline recording: drive vLLM's real v1 scheduler (no model, no GPU) through the synchronous engine loop.

Rules (vllm-on-cpu.md):
- The "model" is a `config.json` for a tiny Llama in a temporary folder; no weights, no hub access.
- The KV cache config is built by hand, one group per workload group, all drawing from one block pool.
- The fake model is deterministic: the token at position p of request r is a hash of (seed, r, p). A partial
  prefill chunk samples nothing; a decode samples the accepted drafts plus one bonus token. Drafts are the
  true next tokens, each wrong with probability `draft_error_rate` (seeded per request and step).
- The loop is `EngineCore.step`'s: add arrived requests, `schedule()`, model output, `update_from_output()`,
  drafts; and one last `schedule()` to deliver the final finished ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from kvmap.errors import KvmapError
from kvmap.record.recorder import RecordingScheduler, TraceWriter, header_from_config
from kvmap.record.workload import Workload, prompt_tokens

INSTALL_HINT = ("vLLM is not installed. kvmap record needs vLLM's scheduler (no GPU needed): "
                "pip install torch==2.13.0 && pip install --no-deps vllm==0.33.0 && pip install -r "
                "requirements-record.txt (see README, 'Recording traces')")


@dataclass
class RecordSummary:
    path: str
    steps: int
    requests: int
    tokens: int
    preemptions: int
    prefix_hit_tokens: int


def _true_token(seed: int, req_id: str, position: int, vocab: int) -> int:
    h = hashlib.blake2b(f"{seed}/{req_id}/{position}".encode(), digest_size=8).digest()
    return 1 + int.from_bytes(h, "little") % (vocab - 1)


def require_vllm() -> None:
    """Fail early, with the install recipe, where vLLM is missing."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise KvmapError(INSTALL_HINT)


def build_scheduler(w: Workload):
    """A vLLM scheduler configured as the workload says. Imports vLLM (and sets its environment) here."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if w.protocol == "v2" else "0"
    try:
        import torch
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, \
            resolve_kv_cache_block_sizes
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, \
            SlidingWindowSpec
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as e:
        raise KvmapError(f"{INSTALL_HINT} ({e})") from None

    model_dir = tempfile.mkdtemp(prefix="kvmap-model-")
    layers = sum(g.num_layers for g in w.kv_cache_groups)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128,
                   "num_attention_heads": max(2, w.tensor_parallel_size), "num_key_value_heads": 1,
                   "num_hidden_layers": layers, "vocab_size": w.vocab_size,
                   "max_position_embeddings": w.max_model_len, "torch_dtype": "float16", "rms_norm_eps": 1e-5}, f)
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=w.max_model_len)
    sc = SchedulerConfig(max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.max_num_batched_tokens,
                         max_model_len=w.max_model_len, enable_chunked_prefill=w.enable_chunked_prefill,
                         async_scheduling=False, is_encoder_decoder=False)
    cc = CacheConfig(block_size=w.block_size, enable_prefix_caching=w.enable_prefix_caching)
    kw = {}
    if w.num_speculative_tokens:
        from vllm.config import SpeculativeConfig

        kw["speculative_config"] = SpeculativeConfig(method="ngram", num_speculative_tokens=w.num_speculative_tokens,
                                                     prompt_lookup_max=4, prompt_lookup_min=2)
    if w.decode_context_parallel_size > 1 or w.tensor_parallel_size > 1:
        # DCP: each manager block id then spans block_size * dcp tokens (SingleTypeKVCacheManager.block_size)
        kw["parallel_config"] = ParallelConfig(tensor_parallel_size=w.tensor_parallel_size,
                                               decode_context_parallel_size=w.decode_context_parallel_size,
                                               cp_kv_cache_interleave_size=w.cp_kv_cache_interleave_size)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, device_config=DeviceConfig(device="cpu"),
                    **kw)
    groups, n = [], 0
    for g in w.kv_cache_groups:
        names = [f"model.layers.{n + i}.self_attn" for i in range(g.num_layers)]
        n += g.num_layers
        if g.kind == "mamba":
            # a state group: one state block per request (mamba_cache_mode "none", vLLM's default without prefix
            # caching), whose block size vLLM sets to max_model_len; replicated on every DCP rank
            spec = MambaSpec(block_size=w.max_model_len, shapes=((2, 8),), dtypes=(torch.float16,),
                             mamba_cache_mode="none")
        elif g.kind == "sliding_window":
            spec = SlidingWindowSpec(block_size=w.block_size, num_kv_heads=1, head_size=8, dtype=torch.float16,
                                     sliding_window=g.sliding_window)
        else:
            spec = FullAttentionSpec(block_size=w.block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
        groups.append(KVCacheGroupSpec(names, spec))
    kvc = KVCacheConfig(num_blocks=w.num_gpu_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    cc.num_gpu_blocks = w.num_gpu_blocks
    bs, hbs = resolve_kv_cache_block_sizes(kvc, vc)
    scheduler = sc.get_scheduler_cls()(vllm_config=vc, kv_cache_config=kvc,
                                       structured_output_manager=StructuredOutputManager(vc),
                                       block_size=bs, hash_block_size=hbs)
    hasher = None
    if w.enable_prefix_caching:
        from vllm.utils.hashing import get_hash_fn_by_name

        hash_fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hbs, hash_fn)
    return vc, kvc, scheduler, hasher


def record(w: Workload, out_path: str, on_step: Callable[[int], None] | None = None) -> RecordSummary:
    """Record workload `w` to `out_path` through `RecordingScheduler`."""
    vc, kvc, scheduler, hasher = build_scheduler(w)
    header = header_from_config(vc, kvc, [g.kernel_block_size for g in w.kv_cache_groups], workload=w.name,
                                description=w.description)
    rec = RecordingScheduler(scheduler, TraceWriter(out_path, header))
    try:
        tokens, hits = drive(w, rec, hasher, on_step)
    finally:
        rec.close()
    return RecordSummary(out_path, rec._writer.steps, len(w.request_list()), tokens, rec.num_preemptions, hits)


def drive(w: Workload, rec, hasher, on_step: Callable[[int], None] | None = None) -> tuple[int, int]:
    """The synchronous engine loop over `rec` (a scheduler, normally wrapped by RecordingScheduler).
    Returns (tokens scheduled, prefix-hit tokens)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request

    pending = sorted(w.request_list(), key=lambda r: r.arrival_step)
    clock = tokens = hits = steps = 0
    k = w.num_speculative_tokens
    while pending or rec.has_requests():
        while pending and pending[0].arrival_step <= clock:
            r = pending.pop(0)
            rec.add_request(Request(r.req_id, prompt_tokens(w, r),
                                    SamplingParams(max_tokens=r.max_tokens, ignore_eos=True), None,
                                    block_hasher=hasher))
        clock += 1
        if not rec.has_requests():
            continue
        if steps >= w.max_steps:
            raise KvmapError(f"still running after max_steps={w.max_steps} steps", field="max_steps")
        out = rec.schedule()
        steps += 1
        tokens += out.total_num_scheduled_tokens
        hits += sum(nr.num_computed_tokens for nr in out.scheduled_new_reqs)
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for r in req_ids:
            req = rec.requests[r]
            if req.num_computed_tokens < req.num_tokens:  # partial prefill chunk
                sampled.append([])
                continue
            drafts = out.scheduled_spec_decode_tokens.get(r, [])
            # position of the first draft: the request computed up to here before this step's drafts
            first = req.num_computed_tokens - len(drafts)
            toks = []
            for j, d in enumerate(drafts):
                true = _true_token(w.seed, r, first + j, w.vocab_size)
                if d != true:
                    break
                toks.append(true)
            toks.append(_true_token(w.seed, r, first + len(toks), w.vocab_size))
            sampled.append(toks)
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=[list(s) for s in sampled])
        rec.update_from_output(out, mro)
        if k:
            d_ids, d_toks = [], []
            for r, s in zip(req_ids, sampled):
                req = rec.requests.get(r)
                if not s or req is None or req.is_finished():
                    continue
                rng = random.Random(f"{w.seed}/{r}/{steps}")
                nxt = req.num_tokens
                d = [_true_token(w.seed, r, nxt + j, w.vocab_size) for j in range(k)]
                d = [t if rng.random() >= w.draft_error_rate else 1 + t % (w.vocab_size - 1) for t in d]
                d_ids.append(r)
                d_toks.append(d)
            rec.update_draft_token_ids(DraftTokenIds(d_ids, d_toks))
        if on_step:
            on_step(steps)
    rec.schedule()  # the last finished ids arrive with one more (empty) step
    return tokens, hits
