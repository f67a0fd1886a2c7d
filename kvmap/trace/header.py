"""Parse and check the trace header (line 1): format, protocol, pool, groups, limits.

Rules: every key the worker relies on is checked here, once; unknown keys are kept as informational `extra`.
"""

from __future__ import annotations

from kvmap.trace.checks import Where, dict_field, int_field
from kvmap.trace.records import FORMAT, GROUP_KINDS, PROTOCOLS, KVCacheGroup, KVCacheSpec, TraceHeader

def parse_header(obj: object, where: Where) -> TraceHeader:
    if not isinstance(obj, dict) or obj.get("kind") != "header":
        raise where.error("not a kvmap trace: line 1 must be the header object with \"kind\": \"header\"")
    if obj.get("format") != FORMAT:
        raise where.error(f"unsupported format {obj.get('format')!r}, expected {FORMAT!r}", field="format")
    protocol = obj.get("model_runner_protocol")
    if protocol not in PROTOCOLS:
        raise where.error(f"must be one of {PROTOCOLS}, got {protocol!r}", field="model_runner_protocol")
    for key in ("block_size", "num_gpu_blocks", "kv_cache_groups", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len"):
        if key not in obj:
            raise where.error("missing required header key", field=key)
    block_size = int_field(obj["block_size"], where, "block_size", minimum=1)
    num_gpu_blocks = int_field(obj["num_gpu_blocks"], where, "num_gpu_blocks", minimum=1)
    groups_raw = obj["kv_cache_groups"]
    if not isinstance(groups_raw, list) or not groups_raw:
        raise where.error("expected a non-empty list of groups", field="kv_cache_groups")
    groups = []
    for i, g in enumerate(groups_raw):
        name = f"kv_cache_groups[{i}]"
        g = dict_field(g, where, name)
        kind = g.get("kind")
        if kind not in GROUP_KINDS:
            raise where.error(f"kind must be one of {GROUP_KINDS}, got {kind!r}", field=f"{name}.kind")
        gid = int_field(g.get("group_id", i), where, f"{name}.group_id")
        if gid != i:
            raise where.error(f"group_id {gid} must equal its index {i}", field=f"{name}.group_id")
        bs = int_field(g.get("block_size", block_size), where, f"{name}.block_size", minimum=1)
        window = g.get("sliding_window")
        if kind == "sliding_window":
            window = int_field(window, where, f"{name}.sliding_window", minimum=1)
        elif window is not None:
            window = None  # informational on other kinds (vLLM's FullAttentionSpec may carry it)
        chunk = g.get("attention_chunk_size")
        if kind == "chunked_local":
            chunk = int_field(chunk, where, f"{name}.attention_chunk_size", minimum=1)
        groups.append(KVCacheGroup(gid, kind, bs, window, chunk))
    groups, multirank = _multirank_fields(obj, where, groups)
    spec_raw = obj.get("kv_cache_spec") or {}
    spec_raw = dict_field(spec_raw, where, "kv_cache_spec")
    spec = KVCacheSpec(**{k: spec_raw.get(k) for k in ("num_layers", "num_kv_heads", "head_size", "dtype")})
    known = {"kind", "format", "model_runner_protocol", "block_size", "num_gpu_blocks", "kv_cache_groups",
             "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_speculative_tokens",
             "null_block_id", "max_num_scheduled_tokens", "vllm_version", "enable_prefix_caching",
             "enable_chunked_prefill", "async_scheduling", "scheduling_policy", "kv_cache_spec"}
    null_block_id = obj.get("null_block_id")
    if null_block_id is not None:
        int_field(null_block_id, where, "null_block_id", minimum=0)
        if null_block_id >= num_gpu_blocks:
            raise where.error(f"{null_block_id} is outside the pool of {num_gpu_blocks}", field="null_block_id")
    max_sched = obj.get("max_num_scheduled_tokens")
    if max_sched is not None:
        int_field(max_sched, where, "max_num_scheduled_tokens", minimum=1)
    return TraceHeader(
        model_runner_protocol=protocol,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        kv_cache_groups=tuple(groups),
        max_num_seqs=int_field(obj["max_num_seqs"], where, "max_num_seqs", minimum=1),
        max_num_batched_tokens=int_field(obj["max_num_batched_tokens"], where, "max_num_batched_tokens", minimum=1),
        max_model_len=int_field(obj["max_model_len"], where, "max_model_len", minimum=1),
        num_speculative_tokens=int_field(obj.get("num_speculative_tokens") or 0, where, "num_speculative_tokens",
                                    minimum=0),
        null_block_id=null_block_id,
        max_num_scheduled_tokens=max_sched,
        vllm_version=obj.get("vllm_version"),
        enable_prefix_caching=obj.get("enable_prefix_caching"),
        enable_chunked_prefill=obj.get("enable_chunked_prefill"),
        async_scheduling=obj.get("async_scheduling"),
        scheduling_policy=obj.get("scheduling_policy"),
        kv_cache_spec=spec,
        extra={k: v for k, v in obj.items() if k not in known | set(multirank)},
        **multirank,
    )


MULTIRANK_KEYS = ("decode_context_parallel_size", "cp_kv_cache_interleave_size", "tensor_parallel_size",
                  "max_concurrent_batches")


def _multirank_fields(obj: dict, where: Where, groups: list[KVCacheGroup]) -> tuple[list[KVCacheGroup], dict]:
    """trace-format.md, "Extensions for vLLM as deployed today": DCP, interleave, TP and per-group kernel
    block sizes, `dcp_sharded`, `uses_slot_mapping`. Every key defaults to today's behaviour."""
    fields = {k: int_field(obj.get(k, 1), where, k, minimum=1) for k in MULTIRANK_KEYS}
    interleave = fields["cp_kv_cache_interleave_size"]
    out = []
    for i, g in enumerate(groups):
        raw = obj["kv_cache_groups"][i]
        name = f"kv_cache_groups[{i}]"
        kbs = raw.get("kernel_block_size")
        if kbs is not None:
            kbs = int_field(kbs, where, f"{name}.kernel_block_size", minimum=1)
            if g.block_size % kbs:
                raise where.error(f"kernel_block_size {kbs} must divide the group's block_size {g.block_size}",
                                  field=f"{name}.kernel_block_size")
        flags = {}
        for key, default in (("dcp_sharded", True), ("uses_slot_mapping", g.kind != "mamba")):
            v = raw.get(key, default)
            if type(v) is not bool:
                raise where.error(f"expected true or false, got {v!r:.40}", field=f"{name}.{key}")
            flags[key] = v
        if flags["dcp_sharded"] and fields["decode_context_parallel_size"] > 1 and g.block_size % interleave:
            raise where.error(f"cp_kv_cache_interleave_size {interleave} must divide the block_size "
                              f"{g.block_size} of group {i}", field="cp_kv_cache_interleave_size")
        out.append(KVCacheGroup(g.group_id, g.kind, g.block_size, g.sliding_window, g.attention_chunk_size,
                                kbs, **flags))
    return out, fields
