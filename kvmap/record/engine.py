"""Offline recording: drive vLLM's real v1 scheduler (no model, no GPU) through the synchronous engine loop.

Rules:
- The "model" is a `config.json` for a tiny Llama in a temporary folder, removed once the scheduler is built
  (success or failure); no weights, no hub access. Its hidden size is a multiple of its head count (one head
  per TP rank).
- Whatever vLLM refuses (its config checks' ValueError) or fails at while building the scheduler for a workload
  kvmap accepted is one `KvmapError` naming the workload file and quoting vLLM, never a traceback; so is a run
  that passes `max_steps`.
- The KV cache config is built by hand, one group per workload group, all drawing from one block pool; the
  cache's block size is then set as EngineCore sets it (max_model_len for a model of mamba groups only).
- What the model samples and the drafts it proposes are the fake model's (fake_model.py: deterministic,
  seeded, with early stops at `stop_rate`). A partial prefill chunk samples nothing.
- The loop is `EngineCore.step`'s: add arrived requests, `schedule()`, model output, `update_from_output()`,
  drafts; and one last `schedule()` to deliver the final finished ids.
- With `async_scheduling: true` the loop is `EngineCore.step_with_batch_queue`'s (vLLM 0.33, the
  `AsyncScheduler`): schedule while the batch queue (depth `max_concurrent_batches`) has room, block on the
  oldest batch only when it is full or nothing more can be scheduled, then `update_from_output()` that batch.
  The fake worker (fake_model.FakeWorker) executes batches in schedule order, as the real one does; the real
  drafts it verified are told to the recorder as `spec_draft_token_ids`. A request that stops early at step N
  is often already scheduled in N+1, whose output vLLM then discards.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from kvmap.errors import KvmapError
from kvmap.record.fake_model import FakeWorker, propose, sample
from kvmap.record.header import header_from_config
from kvmap.record.recorder import RecordingScheduler, TraceWriter
from kvmap.record.workload import Arrival, Workload, arrivals

INSTALL_HINT = ("vLLM is not installed. kvmap record needs vLLM's scheduler (no GPU needed): "
                "pip install torch==2.13.0 && pip install --no-deps vllm==0.33.0 && pip install -r "
                "requirements-record.txt (see docs/recording.md, 'Installing vLLM for the recorder')")


@dataclass
class RecordSummary:
    path: str
    steps: int
    requests: int
    tokens: int
    preemptions: int
    prefix_hit_tokens: int


def _sampling_params(w: Workload, max_tokens: int):
    from vllm.sampling_params import SamplingParams

    if w.eos_token_id is None and not w.stop_token_ids:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(w.stop_token_ids))
    if w.eos_token_id is not None:
        sp.update_from_generation_config({}, eos_token_id=w.eos_token_id)
    return sp


def require_vllm() -> None:
    """Fail early, with the install recipe, where vLLM is missing."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise KvmapError(INSTALL_HINT)


def build_scheduler(w: Workload):
    """A vLLM scheduler configured as the workload says. Imports vLLM (and sets its environment) here. Whatever
    vLLM refuses or fails at while building it is one `KvmapError` naming the workload file."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if w.protocol == "v2" else "0"
    try:  # vLLM imports torch: a missing one is named here too
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    except ImportError as e:
        raise KvmapError(f"{INSTALL_HINT} ({e})") from None
    with tempfile.TemporaryDirectory(prefix="kvmap-model-") as model_dir:  # read by ModelConfig only
        try:
            vc, cc, sc = _configs(w, model_dir)
            kvc, scheduler, hbs = _scheduler(w, vc, cc, sc)
        except ImportError as e:
            raise KvmapError(f"{INSTALL_HINT} ({e})") from None
        except KvmapError:
            raise
        except ValueError as e:  # vLLM's config checks (pydantic's ValidationError is a ValueError)
            raise _refused(w, e) from None
        except Exception as e:  # noqa: BLE001 - vLLM failing on a workload kvmap accepted: one line, not a traceback
            raise _failed(w, e) from None
    hasher = None
    if w.enable_prefix_caching:
        from vllm.utils.hashing import get_hash_fn_by_name

        hash_fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hbs, hash_fn)
    return vc, kvc, scheduler, hasher


def _configs(w: Workload, model_dir: str):
    """vLLM's (VllmConfig, CacheConfig, SchedulerConfig) for the workload, the fake model's config.json in
    `model_dir`. Its hidden size is a multiple of its head count (one head per TP rank, at least 2)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    heads = max(2, w.tensor_parallel_size)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": math.lcm(64, heads),
                   "intermediate_size": 128, "num_attention_heads": heads, "num_key_value_heads": 1,
                   "num_hidden_layers": sum(g.num_layers for g in w.kv_cache_groups), "vocab_size": w.vocab_size,
                   "max_position_embeddings": w.max_model_len, "torch_dtype": "float16", "rms_norm_eps": 1e-5}, f)
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=w.max_model_len)
    sc = SchedulerConfig(max_num_seqs=w.max_num_seqs, max_num_batched_tokens=w.max_num_batched_tokens,
                         max_model_len=w.max_model_len, enable_chunked_prefill=w.enable_chunked_prefill,
                         async_scheduling=w.async_scheduling, is_encoder_decoder=False)
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
    return vc, cc, sc


def _scheduler(w: Workload, vc, cc, sc):
    """(KVCacheConfig, the scheduler, its hash block size). The cache's block size is the smallest block size of
    the groups that take part in prefix caching (of all groups if none does), as EngineCore sets it once the KV
    cache is known: the workload's block_size, or max_model_len for a model of mamba groups only."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.structured_output import StructuredOutputManager

    groups = kv_cache_group_specs(w)
    kvc = KVCacheConfig(num_blocks=w.num_gpu_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    cc.num_gpu_blocks = w.num_gpu_blocks
    cacheable = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    cc.block_size = min(cacheable or [g.kv_cache_spec.block_size for g in groups])
    bs, hbs = resolve_kv_cache_block_sizes(kvc, vc)
    scheduler = sc.get_scheduler_cls()(vllm_config=vc, kv_cache_config=kvc,
                                       structured_output_manager=StructuredOutputManager(vc),
                                       block_size=bs, hash_block_size=hbs)
    return kvc, scheduler, hbs


# the workload keys vLLM's configuration checks can name, each with the other words its messages use for it
_VLLM_KEYS = {"max_num_batched_tokens": (), "max_num_seqs": (), "max_model_len": (), "block_size": (),
              "num_gpu_blocks": (), "enable_chunked_prefill": ("chunked prefill",),
              "enable_prefix_caching": ("prefix caching",), "async_scheduling": ("async scheduling",),
              "num_speculative_tokens": ("speculative",), "decode_context_parallel_size": ("decode context parallel",),
              "tensor_parallel_size": ("tensor parallel",), "cp_kv_cache_interleave_size": ("interleave",)}


def _refused(w: Workload, e: ValueError) -> KvmapError:
    """vLLM's own reason (pydantic's `Value error, ...` line when there is one), blaming the workload key it names
    first (async_scheduling for "Async scheduling ...")."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    why = next((x.split("Value error, ", 1)[1] for x in lines if "Value error, " in x), lines[0] if lines else repr(e))
    why = why.split(" [type=")[0]
    named = []  # (where in the message, key)
    for key, words in _VLLM_KEYS.items():
        m = re.search(rf"\b({'|'.join((key, *words))})\b", why, re.IGNORECASE)
        if m:
            named.append((m.start(), key))
    return KvmapError(f"vLLM refuses this configuration: {why}", path=w.source, field=min(named)[1] if named else None)


def _failed(w: Workload, e: Exception) -> KvmapError:
    """An error vLLM raised building the scheduler for a workload that passed kvmap's checks: its type, message
    and the vLLM line that raised it."""
    import traceback

    frames = reversed(traceback.extract_tb(e.__traceback__))
    where = next((f"{os.path.basename(fr.filename)}:{fr.lineno}" for fr in frames
                  if f"{os.sep}vllm{os.sep}" in fr.filename), None)
    msg = " ".join(str(e).split())
    what = f"{type(e).__name__}{': ' + msg if msg else ''}{f' (at {where})' if where else ''}"
    return KvmapError(f"vLLM cannot build a scheduler for this workload: {what}", path=w.source)


def kv_cache_group_specs(w: Workload) -> list:
    """vLLM's KVCacheGroupSpec of each of the workload's groups (layers named in order, tiny heads)."""
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheGroupSpec, \
        MambaSpec, SlidingWindowSpec

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
        elif g.kind == "chunked_local":
            spec = ChunkedLocalAttentionSpec(block_size=w.block_size, num_kv_heads=1, head_size=8,
                                             dtype=torch.float16, attention_chunk_size=g.attention_chunk_size)
        else:
            spec = FullAttentionSpec(block_size=w.block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
        groups.append(KVCacheGroupSpec(names, spec))
    return groups


def workload_forward(w: Workload) -> dict:
    """The forward-pass header keys a workload sets (none unless it sets them, so the bundled traces keep their
    bytes)."""
    out = {"runner": w.runner, "cudagraph_mode": w.cudagraph_mode,
           "cudagraph_capture_sizes": list(w.cudagraph_capture_sizes) if w.cudagraph_capture_sizes else None}
    if any(g.attention_backend for g in w.kv_cache_groups):
        out["attention_backends"] = [g.attention_backend for g in w.kv_cache_groups]
    return out


def record(w: Workload, out_path: str, on_step: Callable[[int], None] | None = None) -> RecordSummary:
    """Record workload `w` to `out_path` through `RecordingScheduler`."""
    vc, kvc, scheduler, hasher = build_scheduler(w)
    stops = {}
    if w.eos_token_id is not None:
        stops["eos_token_id"] = w.eos_token_id
    if w.stop_token_ids:
        stops["stop_token_ids"] = list(w.stop_token_ids)
    header = header_from_config(vc, kvc, [g.kernel_block_size for g in w.kv_cache_groups], forward=workload_forward(w),
                                **stops, workload=w.name, description=w.description)
    rec = RecordingScheduler(scheduler, TraceWriter(out_path, header), async_scheduling=w.async_scheduling,
                             num_speculative_tokens=w.num_speculative_tokens)
    try:
        if w.async_scheduling:
            tokens, hits = drive_async(w, rec, hasher, vc.max_concurrent_batches, on_step)
        else:
            tokens, hits = drive(w, rec, hasher, on_step)
    finally:
        rec.close()
    return RecordSummary(out_path, rec._writer.steps, len(w.request_list()), tokens, rec.num_preemptions, hits)


def _add(w: Workload, rec, a: Arrival, hasher) -> None:
    """One `add_request`: a new request, a session's next chunk (the same id, resumable: the scheduler queues it
    or continues the waiting session), or a session's end (the same id, not resumable)."""
    from vllm.v1.request import Request

    kw = {"resumable": True} if a.resumable else {}
    rec.add_request(Request(a.req_id, a.prompt, _sampling_params(w, a.max_tokens), None, block_hasher=hasher,
                            **kw))


def _too_long(w: Workload) -> KvmapError:
    return KvmapError(f"still running after max_steps={w.max_steps} steps: a longer workload needs a larger "
                      f"max_steps; a request the scheduler never finishes needs fewer tokens or more blocks",
                      path=w.source, field="max_steps")


def drive(w: Workload, rec, hasher, on_step: Callable[[int], None] | None = None) -> tuple[int, int]:
    """The synchronous engine loop over `rec` (a scheduler, normally wrapped by RecordingScheduler).
    Returns (tokens scheduled, prefix-hit tokens)."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    pending = arrivals(w)
    clock = tokens = hits = steps = 0
    k = w.num_speculative_tokens
    while pending or rec.has_requests():
        while pending and pending[0].step <= clock:
            _add(w, rec, pending.pop(0), hasher)
        clock += 1
        if not rec.has_requests():
            continue
        if steps >= w.max_steps:
            raise _too_long(w)
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
            sampled.append(sample(w, r, req.num_computed_tokens - len(drafts), drafts))
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=[list(s) for s in sampled])
        rec.update_from_output(out, mro)
        if k:
            d_ids, d_toks = [], []
            for r, s in zip(req_ids, sampled):
                req = rec.requests.get(r)
                if not s or req is None or req.is_finished():
                    continue
                d_ids.append(r)
                d_toks.append(propose(w, r, steps, req.num_tokens))
            rec.update_draft_token_ids(DraftTokenIds(d_ids, d_toks))
        if on_step:
            on_step(steps)
    rec.schedule()  # the last finished ids arrive with one more (empty) step
    return tokens, hits


def drive_async(w: Workload, rec, hasher, depth: int,
                on_step: Callable[[int], None] | None = None) -> tuple[int, int]:
    """The async engine loop (`EngineCore.step_with_batch_queue`, vLLM 0.33) over `rec`, with a batch queue of
    `depth`. Returns (tokens scheduled, prefix-hit tokens)."""
    from collections import deque

    from vllm.v1.outputs import ModelRunnerOutput

    pending = arrivals(w)
    clock = tokens = hits = steps = 0
    worker = FakeWorker(w)
    queue: deque = deque()

    def step_with_batch_queue() -> None:
        nonlocal tokens, hits, steps
        if rec.has_requests():
            if steps >= w.max_steps:
                raise _too_long(w)
            out = rec.schedule()
            step = steps
            steps += 1
            tokens += out.total_num_scheduled_tokens
            hits += sum(nr.num_computed_tokens for nr in out.scheduled_new_reqs)
            model_executed = out.total_num_scheduled_tokens > 0
            if model_executed:
                req_ids, sampled, used = worker.execute(out, step)
                if used:
                    rec.note_spec_drafts(out, used)
                mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                        sampled_token_ids=sampled)
            else:
                worker.execute(out, step)  # frees finished requests
                mro = ModelRunnerOutput(req_ids=[], req_id_to_index={})
            queue.appendleft((mro, out))
            if on_step:
                on_step(steps)
            if len(queue) < depth and (model_executed or rec.has_requests()):
                return  # don't block on the worker unless the queue is full or nothing is left to schedule
        elif not queue:
            return
        mro, out = queue.pop()
        # the scheduler trims sampled lists in place: it gets copies, the recorder saw the originals first
        rec.update_from_output(out, ModelRunnerOutput(
            req_ids=mro.req_ids, req_id_to_index=mro.req_id_to_index,
            sampled_token_ids=[list(s) for s in mro.sampled_token_ids]))

    while pending or rec.has_requests() or queue:
        while pending and pending[0].step <= clock:
            _add(w, rec, pending.pop(0), hasher)
        clock += 1
        if not rec.has_requests() and not queue:
            continue
        step_with_batch_queue()
    return tokens, hits
