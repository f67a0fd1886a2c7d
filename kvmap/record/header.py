"""The trace header of a running vLLM engine: its scheduler, cache, parallel and forward-pass config as the
header keys of docs/trace-format.md.

Rules: read from vLLM's config objects only (no engine state); a key vLLM does not set is left out, never guessed;
the forward-pass keys (runner, cudagraph_mode, cudagraph_capture_sizes, per group attention_backend) come from the
engine's resolved config.
"""

from __future__ import annotations

from typing import Any

from kvmap.trace import FORMAT


def header_from_config(vllm_config: Any, kv_cache_config: Any,
                       kernel_block_sizes: list[int | None] | None = None, forward: dict | None = None,
                       **extra: Any) -> dict:
    """The trace header (docs/trace-format.md) from a running vLLM's configs. `kernel_block_sizes` (one per group, as
    vLLM's worker chose them: `prepare_kernel_block_sizes`; None: no split) is known only on the worker side; the
    scheduler never sees it; attention groups only. Multi-rank keys are written only where they differ from their
    defaults, so older traces keep their bytes. `forward`: the forward-pass keys (`forward_keys` for a live
    engine, the workload's for `kvmap record`; docs/trace-format.md, "Forward-pass keys"), its
    `attention_backends` (one per group, None: unknown) going into the groups; None: none written."""
    import vllm
    from vllm.v1.kv_cache_interface import AttentionSpec, SlidingWindowSpec

    sc, cc, pc = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.parallel_config
    groups, spec0 = [], None
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = "sliding_window" if isinstance(spec, SlidingWindowSpec) else "full_attention"
        name = type(spec).__name__
        if "Mamba" in name:
            kind = "mamba"
        elif "ChunkedLocal" in name:
            kind = "chunked_local"
        grp = {"group_id": i, "kind": kind, "block_size": spec.block_size,
               "sliding_window": getattr(spec, "sliding_window", None) if kind == "sliding_window" else None,
               "attention_chunk_size": getattr(spec, "attention_chunk_size", None),
               "num_layers": len(g.layer_names), "spec": name}
        kbs = kernel_block_sizes[i] if kernel_block_sizes and i < len(kernel_block_sizes) else None
        if kbs is not None and kbs != spec.block_size and isinstance(spec, AttentionSpec):
            grp["kernel_block_size"] = kbs
        if not getattr(spec, "dcp_sharded", True):  # vLLM: Mamba state and draft groups are replicated
            grp["dcp_sharded"] = False
        if kind == "sliding_window" and getattr(spec, "extra_retained_tokens", 0):  # multi-module MTP drafting
            grp["extra_retained_tokens"] = spec.extra_retained_tokens
        if kind == "mamba":  # vLLM: the V1 runner gives Mamba groups SlotMappingMode.NONE
            grp["uses_slot_mapping"] = False
        backends = (forward or {}).get("attention_backends") or []
        if i < len(backends) and backends[i] is not None and kind != "mamba":
            grp["attention_backend"] = backends[i]
        groups.append(grp)
        if spec0 is None and isinstance(spec, AttentionSpec):
            spec0 = spec
    spec_cfg = vllm_config.speculative_config
    ranks = {k: v for k, v in (("decode_context_parallel_size", pc.decode_context_parallel_size),
                               ("cp_kv_cache_interleave_size", pc.cp_kv_cache_interleave_size),
                               ("tensor_parallel_size", pc.tensor_parallel_size)) if v != 1}
    return {
        "kind": "header",
        "format": FORMAT,
        "vllm_version": vllm.__version__,
        "model_runner_protocol": "v2" if vllm_config.use_v2_model_runner else "v1",
        "block_size": cc.block_size,
        "num_gpu_blocks": kv_cache_config.num_blocks,
        "null_block_id": 0,
        "kv_cache_groups": groups,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_num_scheduled_tokens": getattr(sc, "max_num_scheduled_tokens", None),
        "max_model_len": vllm_config.model_config.max_model_len,
        "num_speculative_tokens": spec_cfg.num_speculative_tokens if spec_cfg else 0,
        "enable_prefix_caching": cc.enable_prefix_caching,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "async_scheduling": bool(sc.async_scheduling),
        "scheduling_policy": str(getattr(sc, "policy", "fcfs")),
        "kv_cache_spec": {"num_layers": sum(len(g.layer_names) for g in kv_cache_config.kv_cache_groups),
                          "num_kv_heads": getattr(spec0, "num_kv_heads", None),
                          "head_size": getattr(spec0, "head_size", None),
                          "dtype": str(getattr(spec0, "dtype", "")).replace("torch.", "") or None},
        **ranks,
        **_deployed_keys(vllm_config),
        **{k: v for k, v in (forward or {}).items() if k != "attention_backends" and v is not None},
        **extra,
    }


def forward_keys(vllm_config: Any, kv_cache_config: Any) -> dict:
    """A live engine's forward-pass keys: the runner (`use_v2_model_runner`), the resolved
    `compilation_config.cudagraph_mode` (its CUDAGraphMode name) and `cudagraph_capture_sizes`, and the attention
    backend when the engine's `attention_config.backend` names one (the platform picks it in the worker process
    otherwise, out of the scheduler's reach: then unknown)."""
    out: dict = {"runner": "mrv2" if getattr(vllm_config, "use_v2_model_runner", False) else "v1"}
    try:
        cc = vllm_config.compilation_config
        mode = cc.cudagraph_mode
        sizes = sorted(int(n) for n in (cc.cudagraph_capture_sizes or []))
        # no capture size: no graph is ever captured and both runners' dispatchers run every step eager (NONE)
        out["cudagraph_mode"] = (getattr(mode, "name", None) or "NONE") if sizes else "NONE"
        out["cudagraph_capture_sizes"] = sizes
    except Exception:  # noqa: BLE001 - a config without them: not written
        pass
    try:
        backend = vllm_config.attention_config.backend
    except Exception:  # noqa: BLE001
        backend = None
    if backend is not None:
        num_groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or ())
        out["attention_backends"] = [getattr(backend, "name", str(backend))] * num_groups
    return out


def _deployed_keys(vllm_config: Any) -> dict:
    """`max_concurrent_batches` (the engine's batch-queue depth; docs/trace-format.md, "Extensions for vLLM as
    deployed today"), written only where it differs from its default 1, so synchronous traces keep their bytes.
    `eos_token_id` and `stop_token_ids` are the caller's to pass (`extra`): offline from the workload, live from
    the model."""
    try:
        depth = int(vllm_config.max_concurrent_batches)
    except Exception:  # noqa: BLE001
        depth = 1
    return {"max_concurrent_batches": depth} if depth != 1 else {}


def eos_of(vllm_config: Any) -> dict:
    """The model's own EOS id (its HF config), as header keys, for a live recording."""
    try:
        eos = getattr(vllm_config.model_config.hf_config, "eos_token_id", None)
    except Exception:  # noqa: BLE001
        return {}
    if isinstance(eos, (list, tuple)):
        return {"eos_token_id": eos[0], "stop_token_ids": [int(t) for t in eos[1:]]} if eos else {}
    return {"eos_token_id": int(eos)} if isinstance(eos, int) else {}
