"""Parse and check the trace header (line 1): format, protocol, pool, groups, limits.

Rules:
- Every key the worker relies on is checked here, once; unknown keys are kept as informational `extra`.
- Every size has a sanity bound (`LIMITS`: generous for any real vLLM deployment) checked at parse time, so a
  header bomb (`max_num_seqs: 1e12`) is one located line before anything is allocated.
- What the sizes cost in memory is checked by `check_fits` before anything is allocated (the worker state
  for its rows and buffers, the host KV cache for its pages at the chosen geometry), against the memory this
  process can still get (MemAvailable, and the address-space limit `ulimit -v` less what is mapped). The
  message names the field that costs most and the size it would need.
"""

from __future__ import annotations

import os

from kvmap.errors import TraceError
from kvmap.trace.checks import Where, dict_field, int_field, type_name
from kvmap.trace.records import FORMAT, GROUP_KINDS, PROTOCOLS, KVCacheGroup, KVCacheSpec, TraceHeader

# field -> (largest accepted value, what a real vLLM has)
LIMITS = {
    "block_size": (2**16, "vLLM block sizes are at most a few thousand tokens"),
    "num_gpu_blocks": (2**28, "a 141 GB GPU holds fewer than 2**28 blocks of any real model"),
    "max_num_seqs": (2**16, "vLLM runs at most a few thousand sequences per step"),
    "max_num_batched_tokens": (2**24, "a step of more than 16M tokens does not fit any GPU"),
    "max_num_scheduled_tokens": (2**24, "a step of more than 16M tokens does not fit any GPU"),
    "max_model_len": (2**24, "the longest context windows are about 10M tokens"),
    "num_speculative_tokens": (2**10, "speculative decoding proposes tens of tokens, not thousands"),
    "kv_cache_groups": (2**10, "a model has at most one group per layer"),
}
HEADROOM = 0.8  # use at most this share of the memory left


def _limit(value: int, where: Where, name: str) -> int:
    top, why = LIMITS[name.rsplit(".", 1)[-1]]
    if value > top:
        raise where.error(f"{value} is implausibly large (at most {top}: {why}); the header is corrupt or "
                          "not from vLLM", field=name)
    return value


def _sized(obj: dict, key: str, where: Where, minimum: int) -> int:
    return _limit(int_field(obj[key], where, key, minimum=minimum), where, key)

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
    block_size = _sized(obj, "block_size", where, 1)
    num_gpu_blocks = _sized(obj, "num_gpu_blocks", where, 1)
    groups_raw = obj["kv_cache_groups"]
    if not isinstance(groups_raw, list) or not groups_raw:
        raise where.error("expected a non-empty list of groups", field="kv_cache_groups")
    _limit(len(groups_raw), where, "kv_cache_groups")
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
        bs = _limit(int_field(g.get("block_size", block_size), where, f"{name}.block_size", minimum=1), where,
                    f"{name}.block_size")
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
    spec = _kv_cache_spec(obj, where)
    known = {"kind", "format", "model_runner_protocol", "block_size", "num_gpu_blocks", "kv_cache_groups",
             "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_speculative_tokens",
             "null_block_id", "max_num_scheduled_tokens", "vllm_version", "enable_prefix_caching",
             "enable_chunked_prefill", "async_scheduling", "scheduling_policy", "kv_cache_spec",
             "max_concurrent_batches", "eos_token_id", "stop_token_ids", *FORWARD_KEYS}
    null_block_id = obj.get("null_block_id")
    if null_block_id is not None:
        int_field(null_block_id, where, "null_block_id", minimum=0)
        if null_block_id >= num_gpu_blocks:
            raise where.error(f"{null_block_id} is outside the pool of {num_gpu_blocks}", field="null_block_id")
    max_sched = obj.get("max_num_scheduled_tokens")
    if max_sched is not None:
        _sized(obj, "max_num_scheduled_tokens", where, 1)
    return TraceHeader(
        model_runner_protocol=protocol,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        kv_cache_groups=tuple(groups),
        max_num_seqs=_sized(obj, "max_num_seqs", where, 1),
        max_num_batched_tokens=_sized(obj, "max_num_batched_tokens", where, 1),
        max_model_len=_sized(obj, "max_model_len", where, 1),
        num_speculative_tokens=_limit(int_field(obj.get("num_speculative_tokens") or 0, where,
                                                "num_speculative_tokens", minimum=0), where, "num_speculative_tokens"),
        null_block_id=null_block_id,
        max_num_scheduled_tokens=max_sched,
        vllm_version=obj.get("vllm_version"),
        enable_prefix_caching=obj.get("enable_prefix_caching"),
        enable_chunked_prefill=obj.get("enable_chunked_prefill"),
        async_scheduling=obj.get("async_scheduling"),
        **_engine_keys(obj, where),
        **_forward_keys(obj, where),
        scheduling_policy=obj.get("scheduling_policy"),
        kv_cache_spec=spec,
        extra={k: v for k, v in obj.items() if k not in known | set(multirank)},
        source=where.path,
        **multirank,
    )


def _engine_keys(obj: dict, where: Where) -> dict:
    """The engine-loop keys of vLLM as deployed (docs/trace-format.md): batch-queue depth, stop tokens."""
    out: dict = {"max_concurrent_batches": int_field(obj.get("max_concurrent_batches", 1), where,
                                                     "max_concurrent_batches", minimum=1)}
    if obj.get("eos_token_id") is not None:
        out["eos_token_id"] = int_field(obj["eos_token_id"], where, "eos_token_id", minimum=0)
    stop = obj.get("stop_token_ids") or []
    if not isinstance(stop, list):
        raise where.error("expected a list of token ids", field="stop_token_ids")
    out["stop_token_ids"] = tuple(int_field(t, where, "stop_token_ids", minimum=0) for t in stop)
    return out


# ---------------------------------------------------------------------------------- memory


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n < 2**40 else f"{n / 2**40:.1f} TiB"


def _proc_kib(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


CGROUP = "/sys/fs/cgroup"  # where a container sees its own cgroup (v2 at the root, v1 under memory/)


def cgroup_memory_left(root: str | None = None) -> tuple[int, int] | None:
    """(bytes left, limit) under this container's cgroup memory limit: the limit less what is charged, page cache
    that can be dropped (inactive_file) not counted; None without a limit (v2 memory.max, v1
    memory.limit_in_bytes)."""
    root = root or CGROUP
    for folder, limit_file, used_file, inactive in (
            (root, "memory.max", "memory.current", "inactive_file"),
            (os.path.join(root, "memory"), "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
        try:
            with open(os.path.join(folder, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(folder, used_file)) as f:
                used = int(f.read())
            with open(os.path.join(folder, "memory.stat")) as f:
                stat = dict(line.split()[:2] for line in f if line.strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 2**60:  # "max", or v1's page-rounded 2**63 - 1: no limit
            return None
        return max(int(limit) - used + int(stat.get(inactive, 0)), 0), int(limit)
    return None


def available_memory() -> tuple[int, str]:
    """Bytes this process can still allocate, and what bounds it (MemAvailable, a container's cgroup memory
    limit, or the address-space limit)."""
    best, what = _proc_kib("/proc/meminfo", "MemAvailable"), "memory available (MemAvailable)"
    if best is None:
        try:
            best = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            what = "free memory"
        except (ValueError, OSError, AttributeError):
            best, what = 2**62, "memory"
    cgroup = cgroup_memory_left()
    if cgroup is not None and cgroup[0] < best:
        best, what = cgroup[0], f"memory left under the container's cgroup limit of {_gib(cgroup[1])}"
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        soft = -1 if soft == resource.RLIM_INFINITY else soft
    except (ImportError, OSError, ValueError):
        soft = -1
    if soft >= 0:
        left = soft - (_proc_kib("/proc/self/status", "VmSize") or 0)
        if left < best:
            best, what = max(left, 0), f"address space left under the limit of {_gib(soft)} (ulimit -v)"
    return best, what


def worker_memory(h: TraceHeader) -> list[tuple[str, int]]:
    """(what, bytes) of the host worker's preallocated rows and buffers for header `h`."""
    R, width = h.max_num_seqs, h.max_model_len + h.num_speculative_tokens
    T = max(h.max_num_batched_tokens, h.max_num_scheduled_tokens or 0)
    G = h.num_groups
    row_blocks = sum(-(-width // g.block_size) for g in h.kv_cache_groups)
    return [
        (f"max_num_seqs {R} x (max_model_len + num_speculative_tokens) {width} token rows", R * width * 4),
        (f"max_num_seqs {R} x {row_blocks} block-table entries (max_model_len / block_size, every group),"
         " twice", 2 * R * row_blocks * 4),
        (f"max_num_batched_tokens {T} x {G} group(s) per-step token buffers", T * (48 + 8 * G)),
        (f"max_num_seqs {R} per-request buffers", R * 80),
    ]


def kv_memory(h: TraceHeader, slot_bytes: int) -> list[tuple[str, int]]:
    """(what, bytes) of a host KV cache of `slot_bytes` per slot (K, V and the written flag) per group."""
    slots = h.num_gpu_blocks * sum(g.block_size for g in h.kv_cache_groups)
    return [(f"num_gpu_blocks {h.num_gpu_blocks} x block_size x {h.num_groups} group(s) = {slots} KV slots of "
             f"{slot_bytes} bytes", slots * slot_bytes)]


def check_fits(h: TraceHeader, parts: list[tuple[str, int]] | None = None, path: str | None = None) -> None:
    """Refuse a header whose preallocated arrays (`parts`, default the worker's) would not fit in the memory
    left, naming the field that costs most and the size it would need."""
    parts = sorted(worker_memory(h) if parts is None else parts, key=lambda p: -p[1])
    need = sum(n for _, n in parts)
    have, what = available_memory()
    if need > HEADROOM * have:
        field = parts[0][0].split()[0]
        raise TraceError(f"replaying this header needs {_gib(need)}, mostly {parts[0][0]} ({_gib(parts[0][1])}); "
                         f"{_gib(have)} is the {what}", path=path or h.source, line=1, field=field,
                         kind="header")


MULTIRANK_KEYS = ("decode_context_parallel_size", "cp_kv_cache_interleave_size", "tensor_parallel_size")


def _multirank_fields(obj: dict, where: Where, groups: list[KVCacheGroup]) -> tuple[list[KVCacheGroup], dict]:
    """docs/trace-format.md, "Extensions for vLLM as deployed today": DCP, interleave, TP and per-group kernel
    block sizes, `dcp_sharded`, `uses_slot_mapping`, a sliding-window group's `extra_retained_tokens`. Every key
    defaults to today's behaviour."""
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
        extra = int_field(raw.get("extra_retained_tokens", 0), where, f"{name}.extra_retained_tokens", minimum=0,
                          maximum=LIMITS["max_model_len"][0])
        if g.kind != "sliding_window":
            extra = 0  # vLLM sets it on SlidingWindowSpec only
        out.append(KVCacheGroup(g.group_id, g.kind, g.block_size, g.sliding_window, g.attention_chunk_size,
                                kbs, **flags, extra_retained_tokens=extra,
                                attention_backend=_backend_name(raw, where, name)))
    return out, fields


# ---------------------------------------------------------------------------------- forward pass

FORWARD_KEYS = ("runner", "cudagraph_mode", "cudagraph_capture_sizes")
RUNNERS = ("mrv2", "v1")
# vLLM 0.33's CUDAGraphMode names (vllm/config/compilation.py:53-63)
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def _kv_cache_spec(obj: dict, where: Where) -> KVCacheSpec:
    """The engine's KV geometry, informational (docs/trace-format.md): each number, when present, at least 1;
    `dtype` a string."""
    raw = dict_field(obj.get("kv_cache_spec") or {}, where, "kv_cache_spec")
    spec = KVCacheSpec(**{k: None if raw.get(k) is None else int_field(
        raw[k], where, f"kv_cache_spec.{k}", minimum=1, maximum=1 << 20)
        for k in ("num_layers", "num_kv_heads", "head_size")}, dtype=raw.get("dtype"))
    if spec.dtype is not None and type(spec.dtype) is not str:
        raise where.error(f"expected a string, got {type_name(spec.dtype)}", field="kv_cache_spec.dtype")
    return spec


def _forward_keys(obj: dict, where: Where) -> dict:
    """docs/trace-format.md, "Forward-pass keys": the runner, the resolved cudagraph mode and capture sizes. Each
    is optional (older traces: runner unknown, eager)."""
    out: dict = {}
    runner = obj.get("runner")
    if runner is not None and runner not in RUNNERS:
        raise where.error(f"must be one of {RUNNERS}, got {runner!r:.40}", field="runner")
    out["runner"] = runner
    mode = obj.get("cudagraph_mode")
    if mode is not None and mode not in CUDAGRAPH_MODES:
        raise where.error(f"must be one of vLLM's CUDAGraphMode names {CUDAGRAPH_MODES}, got {mode!r:.40}",
                          field="cudagraph_mode")
    out["cudagraph_mode"] = mode
    sizes = obj.get("cudagraph_capture_sizes")
    if sizes is not None:
        if not isinstance(sizes, list):
            raise where.error("expected a list of token counts", field="cudagraph_capture_sizes")
        sizes = tuple(sorted({int_field(n, where, "cudagraph_capture_sizes", minimum=1, maximum=2**24) for n in sizes}))
    if mode not in (None, "NONE") and not sizes:  # vLLM resolves them whenever graphs are on
        raise where.error(f"required when cudagraph_mode is {mode}: the engine's resolved capture sizes",
                          field="cudagraph_capture_sizes")
    out["cudagraph_capture_sizes"] = sizes
    return out


def _backend_name(raw: dict, where: Where, name: str) -> str | None:
    """A group's `attention_backend`: vLLM's AttentionBackendEnum name (FLASH_ATTN, FLASHINFER, TRITON_ATTN...)."""
    v = raw.get("attention_backend")
    if v is not None and not (isinstance(v, str) and v.isupper() and v.replace("_", "").isalnum()):
        raise where.error(f"expected vLLM's attention backend enum name (FLASH_ATTN, FLASHINFER, TRITON_ATTN, "
                          f"...), got {v!r:.40}", field=f"{name}.attention_backend")
    return v
